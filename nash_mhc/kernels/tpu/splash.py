"""Causal attention on TPU by JAX's shipped splash attention kernel (``jax.experimental.pallas.ops.tpu.
splash_attention``, hardware-tested, MaxText's default), with the function of :func:`nash_mhc.ops.attention.
causal_attention`.

    splash_causal_attention(q, k, v)   q, k, v [B, T, H, K] → [B, T, H, K]

Splash takes one sequence head-major, [H, T, K], and a :class:`MultiHeadMask` of one ``CausalMask((T, T))`` per
head (offset 0: query i sees keys j ≤ i); the batch is vmapped. Its block schedule skips the all-masked blocks
above the diagonal; inside the diagonal blocks masked scores are set to ``DEFAULT_MASK_VALUE`` (-0.7 x the
float32 maximum), whose exponential underflows to exactly 0 next to the unmasked diagonal score, so a change at
key j never reaches a query i < j (tests/test_splash.py checks it bit for bit). Scores, the online softmax and
its accumulators are float32 (the forward's P V matmul too), operands in the inputs' dtype.

Splash does not scale the scores: q is multiplied by 1/√K here, in q's dtype, before the kernel (as MaxText
does), so the gradient of q carries the same factor through JAX's autodiff. Every block size (forward, dQ,
dK/dV) is :func:`splash_block`: the largest of 512, 256, 128 that divides T (a block must be a multiple of the
128 lanes); for other lengths :func:`splash_block` is None and :func:`nash_mhc.ops.attention.attend` keeps XLA.

Splash's ``pallas_call`` declares no ``CostEstimate``, which would leave it uncosted in
:mod:`nash_mhc.tpu_compile.estimate` (and free to the TPU compiler). While its kernels are traced, the module's
``pl`` is replaced by :class:`_Costed`, which hands each ``pallas_call`` (told apart by splash's kernel names:
``splash_mha_fwd…``, ``splash_mha_dq…``, ``splash_mha_dkv…``) the declaration of :func:`kernel_costs`, and
drops its xprof ``metadata`` (a JSON string that the compiled HLO text prints inside the instruction over several
lines, where :func:`nash_mhc.tpu_compile.estimate.parse_hlo`, line by line, lost the kernel's declaration). The
backward kernels are traced when the VJP is transposed, outside this module's call, so the VJP is wrapped
(:func:`_splash`): its backward pass runs splash's own pullback (saved as residuals by ``jax.vjp``) under the
same replacement. Tracing only: this changes nothing in what the kernels compute.

``interpret=True`` (or the ``pallas`` kernels setting off TPU: :func:`nash_mhc.ops.dispatch.interpreting`) runs
splash in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _kernel_module
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from nash_mhc.kernels.tpu.flash_attention import flash_block
from nash_mhc.kernels.tpu.flash_attention import kernel_costs as flash_costs
from nash_mhc.kernels.tpu.tpu_tiles import LANES
from nash_mhc.ops.dispatch import interpreting

F32 = jnp.float32


def splash_block(seq: int) -> int | None:
    """The block size of every splash kernel (query and key blocks equal) for ``seq`` positions; None: no kernel
    (T not a multiple of 128). The same sizes as the flash kernel's (:func:`nash_mhc.kernels.tpu.flash_attention.
    flash_block`)."""
    return flash_block(seq)


def kernel_costs(batch: int, seq: int, heads: int, head_dim: int, itemsize: int, block: int
                 ) -> dict[str, pl.CostEstimate]:
    """The declared cost of splash's forward, dQ and dK/dV kernels for one call ({"fwd", "dq", "dkv"}).

    Splash runs the causal block schedule of our flash kernels (visited block pairs only, a skipped block's index
    held at the last visited one, D made in XLA): their count (:func:`kernels.tpu.flash_attention.kernel_costs`),
    with splash's log-sum-exp stored 128 lanes wide ([H, T, 128] float32, written by the forward and read by dQ
    once per query block and by dK/dV once per visited pair) instead of a row."""
    costs = flash_costs(batch, seq, heads, head_dim, itemsize, block)
    n = seq // block
    pairs = n * (n + 1) // 2
    wide = batch * heads * (LANES - 1) * 4  # the extra bytes of one position's lane-wide log-sum-exp

    def plus(cost: pl.CostEstimate, positions: int) -> pl.CostEstimate:
        return pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                               bytes_accessed=cost.bytes_accessed + positions * wide)
    return {"fwd": plus(costs.forward, seq), "dq": plus(costs.dq, seq),
            "dkv": plus(costs.dkv, (pairs - (n > 1)) * block)}


class _Costed:
    """Splash's ``pl`` with a ``pallas_call`` that declares ``costs`` by the phase in the kernel's name."""

    def __init__(self, costs: dict[str, pl.CostEstimate]):
        self._costs = costs

    def __getattr__(self, name: str) -> Any:
        return getattr(pl, name)

    def pallas_call(self, kernel: Any, *, name: str, **options: Any) -> Any:
        phase = next(p for p in ("dkv", "dq", "fwd") if f"_{p}" in name)
        options.pop("metadata", None)  # its block sizes for xprof: printed over three lines of the compiled HLO
        return pl.pallas_call(kernel, name=name, cost_estimate=self._costs[phase], **options)


@contextlib.contextmanager
def _declaring(costs: dict[str, pl.CostEstimate]) -> Iterator[None]:
    saved = _kernel_module.pl
    _kernel_module.pl = _Costed(costs)
    try:
        yield
    finally:
        _kernel_module.pl = saved


def _kernel(heads: int, seq: int, block: int, interpret: bool) -> Any:
    """Splash for one sequence [H, T, K] under the causal mask."""
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq, seq)) for _ in range(heads)])
    sizes = _kernel_module.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                      block_kv_dq=block)
    return _kernel_module.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                          interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _splash(q: jax.Array, k: jax.Array, v: jax.Array, block: int, interpret: bool) -> jax.Array:
    with _declaring(_costs_of(q, block)):
        return jax.vmap(_kernel(q.shape[1], q.shape[2], block, interpret))(q, k, v)


def _costs_of(q: jax.Array, block: int) -> dict[str, pl.CostEstimate]:
    """The costs of one sequence: vmapping a ``pallas_call`` over the batch multiplies its declaration by B."""
    _, heads, seq, head_dim = q.shape
    return kernel_costs(1, seq, heads, head_dim, q.dtype.itemsize, block)


def _splash_fwd(q, k, v, block, interpret):
    kernel = jax.vmap(_kernel(q.shape[1], q.shape[2], block, interpret))
    with _declaring(_costs_of(q, block)):
        out, pullback = jax.vjp(kernel, q, k, v)
    return out, (pullback, q)


def _splash_bwd(block, interpret, residuals, do):
    pullback, q = residuals
    with _declaring(_costs_of(q, block)):
        return pullback(do.astype(q.dtype))


_splash.defvjp(_splash_fwd, _splash_bwd)


def splash_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False) -> jax.Array:
    """softmax(q kᵀ / √K + causal mask) v of q, k, v [B, T, H, K] (one dtype) → [B, T, H, K] by splash attention
    (module docstring); ValueError unless :func:`splash_block` has a block for T."""
    seq, head_dim = q.shape[1], q.shape[-1]
    block = splash_block(seq)
    if block is None:
        raise ValueError(f"splash attention needs a sequence length that is a multiple of {LANES}, got {seq}")
    q = q * jnp.asarray(head_dim**-0.5, q.dtype)
    out = _splash(*(jnp.swapaxes(a, 1, 2) for a in (q, k, v)), block, interpret or interpreting())
    return jnp.swapaxes(out, 1, 2)


__all__ = ["kernel_costs", "splash_block", "splash_causal_attention"]
