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
    ln 2 / bytes; aux_loss: mean aggregation-entropy term; tokens and bytes predicted, batches read."""

    loss: float
    perplexity: float
    bits_per_byte: float
    aux_loss: float
    tokens: int
    bytes: int
    batches: int

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def evaluate(model: LanguageModel, dataset: PackedDataset, tokenizer: Tokenizer, *, batch_size: int,
             num_batches: int | None, mesh: Mesh | None = None) -> EvalResult:
    """``model`` on the first ``num_batches`` batches of ``dataset`` (its fixed, seed-determined windows; never
    more than one pass, 0/None: the whole pass). Each process reads its own rows; ``mesh`` as in
    :func:`~nash_mhc.training.step.eval_step`. Sums are accumulated on the host in float64."""
    if batch_size < 1 or (num_batches or 0) < 0:
        raise ValueError(f"batch size must be >= 1 and number of batches >= 0, got {batch_size} and {num_batches}")
    count = max(1, dataset.num_windows // batch_size)
    count = min(count, num_batches) if num_batches else count
    nats = aux = 0.0
    tokens = num_bytes = 0
    for i in range(count):
        arrays = dataset.arrays_at(i, global_batch=batch_size, process_index=jax.process_index(),
                                   process_count=jax.process_count())
        metrics = jax.device_get(eval_step(model, Batch(**arrays), mesh=mesh))
        nats += float(metrics["ce_loss"]) * float(metrics["tokens"])
        aux += float(metrics["aux_loss"]) / count
        tokens += int(metrics["tokens"])
        targets, mask = dataset.batch_at(i, global_batch=batch_size)[:, 1:], dataset.mask_at(i, global_batch=batch_size)
        num_bytes += count_bytes(tokenizer, targets if mask is None else np.where(mask > 0, targets, tokenizer.pad_id))
    loss = nats / max(tokens, 1)
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)),
                      bits_per_byte=nats / math.log(2) / max(num_bytes, 1), aux_loss=aux, tokens=tokens,
                      bytes=num_bytes, batches=count)
