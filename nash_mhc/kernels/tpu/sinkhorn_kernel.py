"""Sinkhorn of every token's n x n matrix as Pallas TPU kernels, the tokens along the vector lanes.

    sinkhorn_tokens(logits, num_iters)    logits [T, n, n] → [T, n, n] float32

The same function as :func:`nash_mhc.ops.sinkhorn.sinkhorn` (``num_iters`` rounds of: columns, then rows, each
normalised to sum 1 in log space; then ``exp``). In XLA each round is a handful of separate fusions over the
[T, n, n] array (about 160 per projection; its compiler estimate is in docs/results/tpu_estimate/README.md,
"Moved from docstrings"). The kernels hold a tile of tokens on chip for all rounds:

  forward    reads the logits once, writes exp(z) once
  backward   reads the logits and the output's cotangent, reruns the rounds keeping every iterate in VMEM, and
             walks them back (:func:`nash_mhc.ops.sinkhorn_rounds.walk_back`); writes d logits once

The matrices are laid out [n, n, T] so a token tile [n, n, tile] keeps the tokens in the lanes. Each
``pallas_call`` declares its cost (:func:`kernel_costs`). Used on TPU only (:func:`nash_mhc.ops.sinkhorn.
sinkhorn` dispatches with ``dispatch.platform_dependent``); ``interpret=True`` runs the kernels in Pallas'
interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.ops.sinkhorn_rounds import project, sinkhorn_round, walk_back

F32 = jnp.float32
TOKEN_BLOCKS = (512, 256, 128)  # a token tile: a multiple of the 128 lanes


def token_block(tokens: int) -> int | None:
    """The token tile for ``tokens`` matrices; None: no kernel (the XLA path runs)."""
    return next((b for b in TOKEN_BLOCKS if tokens % b == 0), None)


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """The declared cost of the forward and backward kernel for one call."""

    forward: pl.CostEstimate
    backward: pl.CostEstimate


def kernel_costs(tokens: int, n: int, num_iters: int) -> KernelCosts:
    """FLOPs, transcendentals and HBM bytes of the two kernels for ``tokens`` n x n matrices.

    One normalisation of an n x n matrix along one axis: n² maxima, n² subtractions, n² exponentials, n² additions
    for the sums, n logarithms, n additions of the maxima back and n² subtractions of the result: 4 n² + n FLOPs,
    n² + n transcendentals. Forward: 2 normalisations per round and the final n² exponentials. Backward: the
    rounds again, and per normalisation walked back n² exponentials, n² multiply-adds for the sums and n² for
    the update (4 n² FLOPs), then the cotangent times exp(z) (n²). Bytes: float32 [T, n, n] read once and
    written once per operand (forward: logits, out; backward: logits, cotangent, d logits)."""
    norm_flops, norm_exps = 4 * n * n + n, n * n + n
    forward_flops = 2 * num_iters * norm_flops
    forward_exps = 2 * num_iters * norm_exps + n * n
    matrix = tokens * n * n * 4
    forward = pl.CostEstimate(flops=tokens * forward_flops, transcendentals=tokens * forward_exps,
                              bytes_accessed=2 * matrix)
    backward = pl.CostEstimate(flops=tokens * (forward_flops + 2 * num_iters * 4 * n * n + n * n),
                               transcendentals=tokens * (forward_exps + 2 * num_iters * n * n),
                               bytes_accessed=3 * matrix)
    return KernelCosts(forward, backward)


# -------------------------------------------------------------------------------------------- kernels
def _forward_kernel(z_ref, out_ref, *, num_iters):
    out_ref[...] = project(z_ref[...], num_iters)


def _backward_kernel(z_ref, g_ref, dz_ref, columns, rows, *, num_iters):
    """``columns[k]`` / ``rows[k]``: the iterate after round k's column / row step."""
    def forward(k, z):
        columns[k], rows[k] = sinkhorn_round(z)
        return rows[k]
    z = jax.lax.fori_loop(0, num_iters, forward, z_ref[...])
    out = jnp.exp(z)

    def backward(step, dz):
        k = num_iters - 1 - step
        return walk_back(dz, columns[k], rows[k])
    dz_ref[...] = jax.lax.fori_loop(0, num_iters, backward, g_ref[...] * out)


# ------------------------------------------------------------------------------------------ pallas calls
def _call(kernel, operands, n, tokens, block, cost, interpret, scratch=()):
    spec = pl.BlockSpec((n, n, block), lambda t: (0, 0, t))
    return pallas_call(
        kernel, grid=(tokens // block,), in_specs=[spec] * len(operands), out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((n, n, tokens), F32), scratch_shapes=list(scratch), cost_estimate=cost,
        interpret=interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(*operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _sinkhorn(z, num_iters, block, interpret):
    return _forward(z, num_iters, block, interpret)


def _forward(z, num_iters, block, interpret):
    n, _, tokens = z.shape
    return _call(functools.partial(_forward_kernel, num_iters=num_iters), (z,), n, tokens, block,
                 kernel_costs(tokens, n, num_iters).forward, interpret)


def _sinkhorn_fwd(z, num_iters, block, interpret):
    return _forward(z, num_iters, block, interpret), z


def _sinkhorn_bwd(num_iters, block, interpret, z, g):
    n, _, tokens = z.shape
    iterates = pltpu.VMEM((num_iters, n, n, block), F32)
    return (_call(functools.partial(_backward_kernel, num_iters=num_iters), (z, g.astype(F32)), n, tokens, block,
                  kernel_costs(tokens, n, num_iters).backward, interpret, scratch=(iterates, iterates)),)


_sinkhorn.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


def sinkhorn_tokens(logits: jax.Array, num_iters: int, *, block: int | None = None, interpret: bool = False
                    ) -> jax.Array:
    """Sinkhorn of ``logits`` [T, n, n] (any float dtype) by the Pallas kernels → [T, n, n] float32.

    ``block``: the token tile (default :func:`token_block`); ValueError unless it is a multiple of 128 that
    divides T, or when ``num_iters`` < 1."""
    tokens = logits.shape[0]
    block = token_block(tokens) if block is None else block
    if num_iters < 1:
        raise ValueError(f"sinkhorn needs num_iters >= 1, got {num_iters}")
    if block is None or block % 128 or tokens % block:
        raise ValueError(f"sinkhorn_tokens needs a token tile that is a multiple of 128 and divides {tokens}, "
                         f"got {block}")
    z = jnp.moveaxis(logits.astype(F32), 0, -1)  # [n, n, T]
    return jnp.moveaxis(_sinkhorn(z, num_iters, block, interpret), -1, 0)
