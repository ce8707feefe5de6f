"""The Nash aggregation's passes over the scale outputs as Pallas TPU kernels: the outputs read once per pass.

For the L scale outputs O_l [T, D] and their availability a [T, L] (1 where scale l exists at the position):

    o_l = O_l where a_l else 0        mean = sum_l o_l / count (count = max(sum_l a_l, 1))        c_l = (o_l - mean) a_l

    sums[:, l] = sum_d o_l²  (l < L),  sums[:, L + k] = sum_d c_i c_j  (k-th pair i <= j)       kernel "gram"
    out = sum_l w_l O_l                                                                       kernel "combine"
    dots[:, l] = sum_d O_l g                      (g [T, D]: the cotangent of out)           kernel "dots"
    dO_l = a_l (dc_l - sum_m a_m dc_m / count + s o_l) + w_l g,   dc_l = sum_m A_lm c_m       kernel "pullback"

"gram" gives the game its Gram matrix and scale (:func:`nash_mhc.ops.game.centred_gram`), "combine" the
weighted sum, "dots" the weights' gradient through it, and "pullback" the outputs' whole gradient from the
per-position coefficients of the game's backward pass (A = (dRaw + dRawᵀ) / D, s = 2 dS / (D count) where the
scale was kept, w). In XLA, the TPU compiler ran the reductions over D, and the elementwise passes that broadcast a
per-position number over D, on copies of the outputs transposed to put the positions in the lanes (about 1.5e6
cycles per copy of one `1b` output, docs/tpu.md); reading the three outputs once takes about 4e5. In a kernel a
per-position number is one column of a [tokens, k] tile, broadcast over the lanes on chip. Every kernel walks
tiles of [tokens, D-columns]; the reductions add each tile's float32 sums into the token tile's row of the result
(the grid's inner axis runs over the columns). Everything is computed in float32 and rounded once.

The first output may instead be a multi-head attention output [B, T, H, K] (the others [B, T, H K]): the kernels
then read it, and write the combined output and its gradient, head-major ([B, H, T, K], one head's K columns per
column tile), the layout flash attention's kernels give it. As rows it was copied there and back around every
kernel (a share of the `1b` Nash-MHC step on v6e-8: docs/results/tpu_estimate/README.md, "Moved from docstrings").

Each ``pallas_call`` declares its cost (:func:`kernel_costs`). The kernels run on TPU only (the aggregation layer
dispatches with ``dispatch.platform_dependent``); ``interpret=True`` runs them in Pallas' interpreter (CPU tests).
Each kernel's body is also its XLA form (applied to whole [T, D] arrays), used where no tile divides a shard's
(T, D); in that form the pullback computes in its coefficients' dtype (float64 in the gradient checks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.stream_mix_kernel import mix_blocks
from nash_mhc.kernels.tpu.tpu_tiles import LANES
from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.sharding import per_shard

F32 = jnp.float32
TOKENS, COLUMNS = ("tokens", "features"), ("tokens", "scales")  # logical names for per_shard
# With a head-major operand every operand keeps its batch axis, so each splits over the batch axes alike
HEADS, ROWS, SMALL = ("batch", "features", "seq", "head_dim"), ("batch", "seq", "features"), ("batch", "seq", "scales")


def _tokens_dim(a: jax.Array) -> tuple[int, int]:
    """(positions, D) of a shard's operand: [T, D] rows or a head-major [B, H, T, K]."""
    if a.ndim == 4:
        batch, heads, seq, head_dim = a.shape
        return batch * seq, heads * head_dim
    return a.shape


def pairs(scales: int) -> list[tuple[int, int]]:
    """The (i, j), i <= j, whose centred products ``sums[:, L + k]`` holds, in order."""
    return [(i, j) for i in range(scales) for j in range(i, scales)]


def stat_columns(scales: int) -> int:
    """Columns of :func:`gram_sums`: L sums of squares, then L (L + 1) / 2 centred products."""
    return scales + len(pairs(scales))


def pullback_columns(scales: int) -> int:
    """Columns of the pullback's coefficients: a (L), A (L x L, row-major), w (L), s, count."""
    return 2 * scales + scales * scales + 2


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """The declared cost of each kernel for one call."""

    gram: pl.CostEstimate
    combine: pl.CostEstimate
    dots: pl.CostEstimate
    pullback: pl.CostEstimate


def kernel_costs(scales: int, tokens: int, dim: int, x_bytes: int, g_bytes: int) -> KernelCosts:
    """FLOPs and HBM bytes of the kernels for L outputs [T, D] of itemsize ``x_bytes`` (g and out of ``g_bytes``).

    Per output element: the mask and the mean cost 2 L + 1 (L selects, L adds, a divide), the centring 2 L
    (subtract, mask). gram: the mean, the centring and one multiply-add per sum (K = :func:`stat_columns`); reads
    the outputs once and the float32 mask [T, L] once per token tile, writes float32 sums [T, K]. combine: L
    multiply-adds; reads the outputs and the float32 weights [T, L], writes out. dots: L multiply-adds; reads the
    outputs and g, writes float32 dots [T, L]. pullback: the mean and the centring, L² multiply-adds (dc), L more
    and a divide (the mean's share), and per output a subtract, a multiply-add (s o), a select and a multiply-add
    (w g); reads the outputs, g and the float32 coefficients [T, P] (P = :func:`pullback_columns`), writes the L
    gradients in the outputs' dtype."""
    elems = tokens * dim
    outputs, g = scales * elems * x_bytes, elems * g_bytes
    mean_centred = 4 * scales + 1
    gram = pl.CostEstimate(flops=(mean_centred + 2 * stat_columns(scales)) * elems, transcendentals=0,
                           bytes_accessed=outputs + tokens * scales * 4 + tokens * stat_columns(scales) * 4)
    combine = pl.CostEstimate(flops=2 * scales * elems, transcendentals=0,
                              bytes_accessed=outputs + tokens * scales * 4 + g)
    dots = pl.CostEstimate(flops=2 * scales * elems, transcendentals=0,
                           bytes_accessed=outputs + g + tokens * scales * 4)
    pullback = pl.CostEstimate(
        flops=(mean_centred + 2 * scales * scales + 2 * scales + 1 + 6 * scales) * elems, transcendentals=0,
        bytes_accessed=2 * outputs + g + tokens * pullback_columns(scales) * 4)
    return KernelCosts(gram, combine, dots, pullback)


# --------------------------------------------------- the passes, on [rows, D] tiles or whole arrays alike
def _centred(outputs: Sequence[jax.Array], mask: jax.Array, count: jax.Array, dtype
             ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """(a_l [.., 1], o_l, c_l) of the module docstring; ``mask`` [.., L] is 1 where the scale is available."""
    a = [mask[..., s:s + 1] for s in range(len(outputs))]
    o = [jnp.where(m > 0, x.astype(dtype), 0.0) for m, x in zip(a, outputs, strict=True)]
    mean = sum(o) / count
    return a, o, [(x - mean) * m for x, m in zip(o, a, strict=True)]


def _gram_columns(outputs: Sequence[jax.Array], mask: jax.Array) -> list[jax.Array]:
    """The K float32 arrays whose sums over D are :func:`gram_sums`' columns (the centring of
    :func:`nash_mhc.ops.game.centred_gram`)."""
    count = jnp.maximum(sum(mask[..., s:s + 1] for s in range(len(outputs))), 1.0)
    _, o, c = _centred(outputs, mask, count, F32)
    return [x * x for x in o] + [c[i] * c[j] for i, j in pairs(len(outputs))]


def weighted_sum_xla(outputs: Sequence[jax.Array], weights: jax.Array) -> jax.Array:
    """sum_l w_l O_l computed in the weights' dtype, returned in the outputs' dtype: the combine kernel's body and
    the XLA form (:func:`nash_mhc.ops.game.combine`)."""
    out = sum(weights[..., s:s + 1] * x.astype(weights.dtype) for s, x in enumerate(outputs))
    return out.astype(outputs[0].dtype)


def _pullback(outputs: Sequence[jax.Array], g: jax.Array, coefficients: jax.Array) -> list[jax.Array]:
    """dO_l of the module docstring, computed in the coefficients' dtype, in the outputs' dtype."""
    scales, dtype = len(outputs), coefficients.dtype

    def column(k: int) -> jax.Array:
        return coefficients[..., k:k + 1]
    after_weights = 2 * scales + scales * scales  # the columns s and count follow a, A and w
    square, count = column(after_weights), column(after_weights + 1)
    a, o, c = _centred(outputs, coefficients[..., :scales], count, dtype)
    dc = [sum(column(scales + i * scales + j) * cj for j, cj in enumerate(c)) for i in range(scales)]
    d_mean = sum(m * d for m, d in zip(a, dc, strict=True)) / count
    g = g.astype(dtype)
    return [(jnp.where(m > 0, d - d_mean + square * x, 0.0) + column(scales + scales * scales + s) * g
             ).astype(outputs[s].dtype) for s, (m, d, x) in enumerate(zip(a, dc, o, strict=True))]


def _reduce(values: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.sum(v, axis=-1) for v in values], axis=-1)


# -------------------------------------------------------------------------------------------- kernels
def _accumulate(out_ref, values: list[jax.Array]) -> None:
    """Adds the sum over the tile's columns of each value [tm, td] into column k of the token tile's row."""
    lane = lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
    partial = jnp.zeros(out_ref.shape, F32)
    for k, value in enumerate(values):
        partial = jnp.where(lane == k, jnp.sum(value, axis=1, keepdims=True), partial)

    @pl.when(pl.program_id(1) == 0)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, F32)

    out_ref[...] += partial


def _gram_kernel(*refs):
    *o_refs, mask_ref, out_ref = refs
    _accumulate(out_ref, _gram_columns([r[...] for r in o_refs], mask_ref[...]))


def _dots_kernel(*refs):
    *o_refs, g_ref, out_ref = refs
    g = g_ref[...].astype(F32)
    _accumulate(out_ref, [r[...].astype(F32) * g for r in o_refs])


def _combine_kernel(*refs):
    *o_refs, w_ref, out_ref = refs
    out_ref[...] = weighted_sum_xla([r[...] for r in o_refs], w_ref[...])


def _pullback_kernel(*refs):
    scales = (len(refs) - 2) // 2
    o_refs, (g_ref, coefficients_ref), d_refs = refs[:scales], refs[scales:scales + 2], refs[scales + 2:]
    for d_ref, d in zip(d_refs, _pullback([r[...] for r in o_refs], g_ref[...], coefficients_ref[...]), strict=True):
        d_ref[...] = d


def _tiles(blocks: tuple[int, int] | None, tokens: int, dim: int) -> tuple[int, int] | None:
    blocks = mix_blocks(tokens, dim) if blocks is None else blocks
    if blocks is not None and (tokens % blocks[0] or blocks[0] % 8 or dim % blocks[1]):
        raise ValueError(f"aggregation kernels need tiles that divide (tokens, dim) = ({tokens}, {dim}) with a "
                         f"token tile that is a multiple of 8, got {blocks}")
    return blocks


def _run(kernel, xla, arrays, small, out, reduce, *, blocks, interpret, cost) -> tuple[jax.Array, ...]:
    """The results (a tuple) of ``kernel`` on one shard's [T, D] ``arrays`` (and the [T, k] ``small``, or None), or
    of ``xla`` (a list) where no tile divides the shard."""
    operands = [*arrays] + ([small] if small is not None else [])
    tokens, dim = _tokens_dim(arrays[0])
    head_major = [a for a in arrays if a.ndim == 4]
    if head_major:  # one head's K columns per column tile, token tiles within a sequence
        _, _, seq, head_dim = head_major[0].shape
        tiles = mix_blocks(seq, head_dim)
        if tiles is None or head_dim % LANES:  # no tile, or a head is no whole lane tile: rows (a copy each way)
            def rows(a):
                return jnp.swapaxes(a, 1, 2).reshape(-1, a.shape[1] * a.shape[3]) if len(a.shape) == 4 else a
            flat = [jax.ShapeDtypeStruct((o.shape[0] * o.shape[2], o.shape[1] * o.shape[3]), o.dtype)
                    if len(o.shape) == 4 else o for o in out]
            results = _run(kernel, xla, [rows(a) for a in arrays], small, flat, reduce, blocks=blocks,
                           interpret=interpret, cost=cost)
            return tuple(jnp.swapaxes(r.reshape(o.shape[0], o.shape[2], o.shape[1], o.shape[3]), 1, 2)
                         if len(o.shape) == 4 else r for r, o in zip(results, out, strict=True))
        tm, td, per_seq = tiles[0], head_dim, seq // tiles[0]
    else:
        tiles = _tiles(blocks, tokens, dim)
        if tiles is None:
            return tuple(xla(*operands))
        tm, td = tiles
        per_seq = 1

    def tile(four: bool) -> pl.BlockSpec:
        """A [tm, td] tile: of a head-major [B, H, T, K] operand (head d, positions of sequence t // per_seq) or of
        rows [T, D]."""
        if four:
            return pl.BlockSpec((None, None, tm, td), lambda t, d: (t // per_seq, d, t % per_seq, 0))
        return pl.BlockSpec((tm, td), lambda t, d: (t, d))
    specs = [tile(a.ndim == 4) for a in arrays] + ([pl.BlockSpec((tm, small.shape[1]), lambda t, d: (t, 0))]
                                                    if small is not None else [])
    out_specs = [pl.BlockSpec((tm, o.shape[1]), lambda t, d: (t, 0)) if reduce else tile(len(o.shape) == 4)
                 for o in out]
    result = pallas_call(
        kernel, grid=(tokens // tm, dim // td), in_specs=specs, out_specs=out_specs, out_shape=list(out),
        cost_estimate=cost(arrays), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary" if reduce else "parallel"))
    )(*operands)
    return tuple(result)


def _costs(arrays, g_bytes: int | None = None) -> KernelCosts:
    (tokens, dim), scales = _tokens_dim(arrays[0]), len(arrays)
    x_bytes = arrays[0].dtype.itemsize
    return kernel_costs(scales, tokens, dim, x_bytes, x_bytes if g_bytes is None else g_bytes)


def _gram_shard(*operands, blocks, interpret):
    *outputs, mask = operands
    columns = stat_columns(len(outputs))
    return _run(_gram_kernel, lambda *a: [_reduce(_gram_columns(a[:-1], a[-1]))], outputs, mask,
                [jax.ShapeDtypeStruct((_tokens_dim(outputs[0])[0], columns), F32)], True, blocks=blocks,
                interpret=interpret, cost=lambda a: _costs(a).gram)[0]


def _dots_shard(*operands, blocks, interpret):
    *outputs, g = operands
    return _run(_dots_kernel, lambda *a: [_reduce([x.astype(F32) * a[-1].astype(F32) for x in a[:-1]])],
                [*outputs, g], None, [jax.ShapeDtypeStruct((_tokens_dim(g)[0], len(outputs)), F32)], True,
                blocks=blocks, interpret=interpret, cost=lambda a: _costs(a[:-1], g.dtype.itemsize).dots)[0]


def _combine_shard(*operands, blocks, interpret):
    *outputs, weights = operands
    return _run(_combine_kernel, lambda *a: [weighted_sum_xla(a[:-1], a[-1])], outputs, weights,
                [jax.ShapeDtypeStruct(outputs[0].shape, outputs[0].dtype)], False, blocks=blocks,
                interpret=interpret, cost=lambda a: _costs(a).combine)[0]


def _pullback_shard(*operands, blocks, interpret):
    *outputs, g, coefficients = operands
    return _run(_pullback_kernel, lambda *a: _pullback(a[:-2], a[-2], a[-1]), [*outputs, g], coefficients,
                [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs], False, blocks=blocks,
                interpret=interpret, cost=lambda a: _costs(a[:-1], g.dtype.itemsize).pullback)


# ---------------------------------------------------------------------------------------------- public
def _flat(a: jax.Array) -> jax.Array:
    return a.reshape(-1, a.shape[-1])


def _head_major(a: jax.Array) -> bool:
    """Whether ``a`` is a multi-head output [B, T, H, K], read by the kernels head-major (module docstring)."""
    return a.ndim == 4


def _as_tuple(result) -> tuple[jax.Array, ...]:
    return result if isinstance(result, tuple) else (result,)


def _sharded(shard, arrays: Sequence[jax.Array], small: Sequence[jax.Array], out_like, blocks, interpret
             ) -> tuple[jax.Array, ...]:
    """``shard`` on each device's positions of the [..., D] (or [B, T, H, K]) ``arrays`` and [..., k] ``small``.
    ``out_like``: per result, (its shape, its kind: "rows" [..., D], "small" [..., k] or "heads" [B, T, H, K]).

    Rows are flattened to [positions, D]. With a head-major operand, every operand keeps its batch axis under
    :func:`nash_mhc.sharding.per_shard`, so all of them split over the batch axes alike whatever divides, and is
    flattened inside the shard; the [B, T, H, K] operands are passed as [B, H, T, K], the layout flash attention's
    kernels give them, so that transpose is no copy."""
    run = functools.partial(shard, blocks=blocks, interpret=interpret)
    if not any(map(_head_major, arrays)):
        names = (TOKENS,) * len(arrays) + (COLUMNS,) * len(small)
        out_names = tuple(COLUMNS if kind == "small" else TOKENS for _, kind in out_like)
        results = per_shard(lambda *a: _as_tuple(run(*a)), names, out_names)(*map(_flat, arrays), *map(_flat, small))
        return tuple(r.reshape(shape) for r, (shape, _) in zip(results, out_like, strict=True))

    batch, seq = arrays[0].shape[:2]

    def on_shard(*operands: jax.Array) -> tuple[jax.Array, ...]:
        local = operands[0].shape[0]
        results = _as_tuple(run(*(a if a.ndim == 4 else _flat(a) for a in operands)))
        return tuple(r if kind == "heads" else r.reshape(local, seq, r.shape[-1])
                     for r, (_, kind) in zip(results, out_like, strict=True))

    names = tuple(HEADS if _head_major(a) else ROWS for a in arrays) + (SMALL,) * len(small)
    out_names = tuple({"heads": HEADS, "rows": ROWS, "small": SMALL}[kind] for _, kind in out_like)
    operands = [jnp.swapaxes(a, 1, 2) if _head_major(a) else a.reshape(batch, seq, -1) for a in [*arrays, *small]]
    results = per_shard(on_shard, names, out_names)(*operands)
    return tuple(jnp.swapaxes(r, 1, 2) if kind == "heads" else r.reshape(shape)
                 for r, (shape, kind) in zip(results, out_like, strict=True))


def _kind(a: jax.Array) -> str:
    return "heads" if _head_major(a) else "rows"


def gram_sums(outputs: Sequence[jax.Array], available: jax.Array, *, blocks: tuple[int, int] | None = None,
              interpret: bool = False) -> jax.Array:
    """The gram kernel's sums [..., K] float32 (module docstring) of the L outputs O_l [..., D] (any float dtype)
    and ``available`` [..., L] (bool), on each device's positions (:func:`nash_mhc.sharding.per_shard`).

    ``blocks``: (token tile, column tile) of the flattened positions, default
    :func:`.stream_mix_kernel.mix_blocks` of each shard, and the XLA form where none divides; ValueError
    when given tiles do not divide. The same for every function below."""
    shape = (*available.shape[:-1], stat_columns(len(outputs)))
    return _sharded(_gram_shard, outputs, [available.astype(F32)], [(shape, "small")], blocks, interpret)[0]


def weighted_sum(outputs: Sequence[jax.Array], weights: jax.Array, *, blocks: tuple[int, int] | None = None,
                 interpret: bool = False) -> jax.Array:
    """The combine kernel's sum_l w_l O_l [..., D] in the outputs' dtype, weights [..., L] float32."""
    return _sharded(_combine_shard, outputs, [weights.astype(F32)], [(outputs[0].shape, _kind(outputs[0]))], blocks,
                    interpret)[0]


def output_dots(outputs: Sequence[jax.Array], g: jax.Array, *, blocks: tuple[int, int] | None = None,
                interpret: bool = False) -> jax.Array:
    """The dots kernel's sum_d O_l g [..., L] float32 of the L outputs O_l [..., D] and g [..., D]."""
    shape = (*outputs[-1].shape[:-1], len(outputs))  # the last output is rows [..., D]
    return _sharded(_dots_shard, [*outputs, g], [], [(shape, "small")], blocks, interpret)[0]


def gram_pullback(outputs: Sequence[jax.Array], g: jax.Array, coefficients: jax.Array, *,
                  blocks: tuple[int, int] | None = None, interpret: bool = False) -> tuple[jax.Array, ...]:
    """The pullback kernel's dO_l [..., D] (module docstring), each in its output's dtype, of the L outputs, g
    [..., D] and the float32 coefficients [..., P] (:func:`pullback_columns`: a, A row-major, w, s, count)."""
    return _sharded(_pullback_shard, [*outputs, g], [coefficients], [(x.shape, _kind(x)) for x in outputs], blocks,
                    interpret)


def pullback_xla(outputs: Sequence[jax.Array], g: jax.Array, coefficients: jax.Array) -> list[jax.Array]:
    """:func:`gram_pullback`'s XLA form on whole arrays, computed in the coefficients' dtype (float64 checks)."""
    return _pullback(outputs, g, coefficients)


__all__ = ["KernelCosts", "gram_pullback", "gram_sums", "kernel_costs", "output_dots", "pairs", "pullback_columns",
           "pullback_xla", "stat_columns", "weighted_sum", "weighted_sum_xla"]
