"""Held-out evaluation, one path for the training program (``eval_loss`` every ``--eval-interval`` steps) and
``python -m nash_mhc.evaluate``: token-weighted cross-entropy, perplexity and bits per byte.

Bits per byte are tokenizer-independent: total nats / ln 2 / UTF-8 bytes of the predicted text. With a loss mask
(prompt/response data) both count only the masked-in targets: the loss is the response tokens' loss.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

from nash_mhc.data import PackedDataset, Tokenizer, count_bytes
from nash_mhc.model import LanguageModel
from nash_mhc.training.state import Batch
from nash_mhc.training.step import eval_step


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """loss: mean cross-entropy per predicted token (nats); perplexity = exp(loss); bits_per_byte = total nats /
    ln 2 / bytes; aux_loss: mean aggregation-entropy term; tokens and bytes predicted, batches read (from batch
    ``first_batch`` on); scale_use: the scale-use metrics over every predicted token (with several attention
    scales; :mod:`nash_mhc.training.scale_use`), flat beside the others in :meth:`to_dict`."""

    loss: float
    perplexity: float
    bits_per_byte: float
    aux_loss: float
    tokens: int
    bytes: int
    batches: int
    first_batch: int = 0
    scale_use: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, float | int]:
        record = dataclasses.asdict(self)
        scale_use = record.pop("scale_use")
        return {**record, **scale_use}


def batch_range(num_windows: int, batch_size: int, first_batch: int, num_batches: int | None) -> range:
    """The batch indices an evaluation reads: ``num_batches`` (0/None: all that are left) from ``first_batch``,
    within one pass over the ``num_windows`` windows (a pass has ``max(1, num_windows // batch_size)`` batches;
    batch i holds windows ``perm[i*B:(i+1)*B]``), so batches of disjoint ranges hold disjoint windows. A
    ``first_batch`` past the pass is a one-line ``ValueError``."""
    if batch_size < 1 or (num_batches or 0) < 0 or first_batch < 0:
        raise ValueError(f"batch size must be >= 1, number of batches and first batch >= 0, got {batch_size}, "
                         f"{num_batches} and {first_batch}")
    in_pass = max(1, num_windows // batch_size)
    if first_batch >= in_pass:
        raise ValueError(f"first batch {first_batch} is past the held-out pass: it has {in_pass} batches of "
                         f"{batch_size} sequences ({num_windows} windows)")
    left = in_pass - first_batch
    return range(first_batch, first_batch + (min(left, num_batches) if num_batches else left))


def evaluate(model: LanguageModel, dataset: PackedDataset, tokenizer: Tokenizer, *, batch_size: int,
             num_batches: int | None, first_batch: int = 0, mesh: Mesh | None = None) -> EvalResult:
    """``model`` on ``num_batches`` batches of ``dataset`` from batch ``first_batch`` on (its fixed,
    seed-determined windows; never past one pass, 0/None: the rest of the pass; :func:`batch_range`). Each
    process reads its own rows; ``mesh`` as in :func:`~nash_mhc.training.step.eval_step`. Sums are
    accumulated on the host in float64."""
    batches = batch_range(dataset.num_windows, batch_size, first_batch, num_batches)
    count = len(batches)
    nats = aux = 0.0
    tokens = num_bytes = 0
    scale_use: dict[str, float] = {}  # Σ over batches of tokens x the batch's metric: the mean over every token
    for i in batches:
        arrays = dataset.arrays_at(i, global_batch=batch_size, process_index=jax.process_index(),
                                   process_count=jax.process_count())
        metrics = jax.device_get(eval_step(model, Batch(**arrays), mesh=mesh))
        nats += float(metrics["ce_loss"]) * float(metrics["tokens"])
        aux += float(metrics["aux_loss"]) / count
        tokens += int(metrics["tokens"])
        for name in (k for k in metrics if k.startswith("scale_")):
            scale_use[name] = scale_use.get(name, 0.0) + float(metrics[name]) * float(metrics["tokens"])
        targets, mask = dataset.batch_at(i, global_batch=batch_size)[:, 1:], dataset.mask_at(i, global_batch=batch_size)
        num_bytes += count_bytes(tokenizer, targets if mask is None else np.where(mask > 0, targets, tokenizer.pad_id))
    loss = nats / max(tokens, 1)
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)),
                      bits_per_byte=nats / math.log(2) / max(num_bytes, 1), aux_loss=aux, tokens=tokens,
                      bytes=num_bytes, batches=count, first_batch=first_batch,
                      scale_use={name: total / max(tokens, 1) for name, total in scale_use.items()})
