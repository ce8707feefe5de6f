"""``python -m nash_mhc.evaluate``: loss, perplexity and bits per byte of a trained model on held-out text.

Loads the latest (or ``--step``) checkpoint of a training run's ``--checkpoint-dir`` and evaluates it on the
held-out ``eval`` part of the run's dataset (or ``--dataset``), at the model's context length, with the same
code the training program logs ``eval_loss`` with (:mod:`nash_mhc.training.evaluation`). Prints one JSON
line: loss (mean nats per predicted token), perplexity (exp(loss)), bits_per_byte (total nats / ln 2 / UTF-8
bytes of the predicted text, comparable across tokenizers), aux_loss, tokens, bytes, batches, first_batch, step
and, for a model with several attention scales, how much each scale carries over the evaluated tokens
(scale_weight/<l>, scale_prior/<l>, scale_tv and their per-layer values: :mod:`nash_mhc.training.scale_use`).
``--first-batch K --num-batches N`` reads batches [K, K + N) of the held-out pass (disjoint ranges read disjoint
windows); ``--window-seed`` fixes the windows' order across runs of different seeds.
``--untrained`` evaluates the run's step-0 initialisation instead, the baseline to compare with.
``--mesh-data/--mesh-fsdp/--mesh-tp`` restore the model sharded over that mesh as training shards it (for
models larger than one device; the batch is split over data x fsdp); without them it runs on one device.
Prompt/response data (``--prompt-field``/``--response-field``, recorded by a fine-tuning run) is evaluated on
the response tokens only, as it was trained: the loss is the masked loss. An export folder
(``python -m nash_mhc.export``) works as ``--checkpoint-dir`` too.
Exit codes: 0 done, 2 bad arguments or inputs, a corrupt checkpoint included (one line on stderr), 3 a
loss that is not finite (the JSON line carries null for it, and stderr one line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from nash_mhc.cli import SettingsParser, checkpoint_program_parser, fail
from nash_mhc.platforms import select_platform
from nash_mhc.settings import NON_NEGATIVE_INT, POSITIVE_INT, check_settings, setting


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    """What to evaluate on: a part of the run's dataset (or another one), in how many batches."""

    dataset: str | None = setting(None, "'stdlib', 'synthetic' or any --dataset of the training program "
                                        "(default: the dataset the run trained on)")
    part: str = setting("eval", "part of the dataset to evaluate on", choices=("eval", "train"), flag="--split")
    batch_size: int = setting(8, "sequences per batch", check=POSITIVE_INT)
    num_batches: int = setting(16, "batches to evaluate (0: the whole part; capped at one pass over it)",
                               check=NON_NEGATIVE_INT)
    first_batch: int = setting(0, "index of the first batch to evaluate: batches [K, K + num-batches) of the pass, "
                                  "so evaluations of disjoint ranges read disjoint windows (e.g. a selection and "
                                  "a report split)", check=NON_NEGATIVE_INT)
    window_seed: int | None = setting(None, "seed of the order of the held-out windows (default: the run's seed); "
                                            "fix it to read the same windows for runs of different seeds",
                                      check=NON_NEGATIVE_INT)

    def __post_init__(self) -> None:
        check_settings(self)


def build_parser() -> SettingsParser:
    from nash_mhc.data import DataConfig

    parser = checkpoint_program_parser("python -m nash_mhc.evaluate", __doc__, EvaluateConfig)
    parser.add_settings(DataConfig, "data (default: as the run read it)",
                        only=("text_field", "prompt_field", "response_field"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from nash_mhc.data import DataConfig, NoWindows, open_windows
    from nash_mhc.execution import ExecutionConfig
    from nash_mhc.inference import load_from_flags
    from nash_mhc.sharding import batch_shards
    from nash_mhc.training.evaluation import batch_range, evaluate

    select_platform()  # before anything starts a JAX backend
    parser = build_parser()
    try:
        config, loaded = load_from_flags(parser, argv, EvaluateConfig)
        execution = parser.build(ExecutionConfig, parser.given(argv))
        data_config = loaded.data_config()
        if config.dataset not in (None, data_config.dataset):
            data_config = DataConfig(dataset=config.dataset, tokenizer=data_config.tokenizer)
        data_config = dataclasses.replace(data_config, **parser.values(DataConfig, parser.given(argv)))
        window_seed = loaded.seed if config.window_seed is None else config.window_seed
        try:
            data = open_windows(data_config, config.part, loaded.tokenizer, loaded.config.seq_len, window_seed)
        except NoWindows as error:  # the context length is the model's: no --seq-len here
            other = "--split train or " if config.part == "eval" else ""
            raise error.with_hint(f"the model's context length is fixed; use {other}a larger --dataset") from None
        batch_size = min(config.batch_size, data.num_windows)
        if batch_size % batch_shards(loaded.mesh):
            raise ValueError(f"--batch-size {batch_size} is not divisible by mesh data x fsdp = "
                             f"{batch_shards(loaded.mesh)}")
        batch_range(data.num_windows, batch_size, config.first_batch, config.num_batches)  # --first-batch fits
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)
    with execution.use():  # --kernels
        result = evaluate(loaded.model, data, loaded.tokenizer, batch_size=batch_size,
                          num_batches=config.num_batches, first_batch=config.first_batch, mesh=loaded.mesh)
    record = {**result.to_dict(), "step": loaded.step, "dataset": data_config.dataset, "split": config.part,
              "window_seed": window_seed}
    not_finite = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
    print(json.dumps({k: None if k in not_finite else v for k, v in record.items()}), flush=True)  # valid JSON
    if not_finite:
        print(f"error: {', '.join(not_finite)} not finite ({record[not_finite[0]]}): the model's outputs overflow "
              "or its weights are not finite", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
