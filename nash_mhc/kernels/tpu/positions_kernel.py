"""Per-position arithmetic as one Pallas TPU kernel: the positions in the vector lanes, every value on chip.

    run_positions(fn, arrays, out_entries, *, interpret=False)

``arrays`` are float32 [k_i, P]: k_i entries (a vector's components, a matrix's entries) of P positions. ``fn``
takes one list of entries per array (each entry an array over some positions) and returns one list per output,
``out_entries[j]`` entries each; every operation in it must be elementwise over the positions. The kernel walks
tiles of ``rows`` x 128 positions and runs ``fn`` on each tile's entries, loops included, without touching HBM in
between: the Nash game's Newton loop (:mod:`nash_mhc.ops.equilibrium`) run by XLA on TPU is a dozen small fusions
per iteration, each reading and writing [B, T] arrays in HBM (its share of the `1b` step's compiler estimate:
docs/results/tpu_estimate/README.md); here it is one kernel per call.

The declared cost (:func:`elementwise_cost`) counts ``fn``'s own operations from its jaxpr: one FLOP per position
for each elementwise primitive, one transcendental for each exp / log / sqrt-like one, loops counted at their trip
count (their integer counters not counted); the bytes are the inputs read and the outputs written once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.tpu_tiles import LANES, SUBLANES
from nash_mhc.ops.dispatch import pallas_call

MAX_ROWS = 64  # rows of 128 positions per tile: 8,192 positions, a few dozen [rows, 128] float32 values in VMEM
TRANSCENDENTAL = frozenset({"exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "logistic", "pow",
                            "sin", "cos", "erf"})
FREE = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy"})

Entries = list[jax.Array]


def position_rows(positions: int) -> int | None:
    """Rows of 128 positions per tile: the most (≤ :data:`MAX_ROWS`, a multiple of 8) that divide the P / 128
    rows; None where P is not a multiple of 8 x 128 (then the caller keeps its XLA form)."""
    if positions % (SUBLANES * LANES):
        return None
    rows = positions // LANES
    return max(r for r in range(SUBLANES, min(MAX_ROWS, rows) + 1, SUBLANES) if rows % r == 0)


def elementwise_cost(fn: Callable, in_entries: Sequence[int], out_entries: Sequence[int], positions: int
                     ) -> pl.CostEstimate:
    """The cost of :func:`run_positions` over ``positions``: ``fn``'s primitives counted on one position (scalar
    entries), scan and fori loops at their trip count; bytes of float32 inputs read and outputs written once.
    ValueError for a ``while`` loop (no trip count) or a primitive that is not elementwise."""
    args = [[jnp.zeros((), jnp.float32)] * k for k in in_entries]
    flops, transcendentals = _count(jax.make_jaxpr(fn)(*args).jaxpr)
    return pl.CostEstimate(flops=flops * positions, transcendentals=transcendentals * positions,
                           bytes_accessed=4 * positions * (sum(in_entries) + sum(out_entries)))


def _count(jaxpr) -> tuple[int, int]:
    """(FLOPs, transcendentals) of one position's pass through ``jaxpr``."""
    flops = transcendentals = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            (f, t), times = _count(eqn.params["jaxpr"].jaxpr), eqn.params["length"]
        elif name in ("pjit", "closed_call", "jit"):
            (f, t), times = _count(eqn.params["jaxpr"].jaxpr), 1
        elif name == "while":
            raise ValueError("elementwise_cost: a while loop has no trip count; use a fori_loop of fixed length")
        elif name in TRANSCENDENTAL:
            (f, t), times = (0, 1), 1
        elif name in FREE or all(jnp.issubdtype(v.aval.dtype, jnp.integer) for v in eqn.outvars):
            continue  # layout, or a loop counter
        elif any(getattr(v.aval, "shape", ()) != () for v in eqn.outvars):
            raise ValueError(f"elementwise_cost: {name} is not elementwise over the positions")
        else:
            (f, t), times = (1, 0), 1
        flops, transcendentals = flops + f * times, transcendentals + t * times
    return flops, transcendentals


def run_positions(fn: Callable, arrays: Sequence[jax.Array], out_entries: Sequence[int], *,
                  interpret: bool = False) -> list[jax.Array]:
    """``fn`` on the entries of float32 ``arrays`` [k_i, P] as one Pallas kernel; returns float32 [k_j, P] for
    ``out_entries``. ValueError where P has no tile (:func:`position_rows`)."""
    positions = arrays[0].shape[1]
    rows = position_rows(positions)
    if rows is None:
        raise ValueError(f"run_positions needs positions in multiples of {SUBLANES * LANES}, got {positions}")
    in_entries = [a.shape[0] for a in arrays]
    lines = positions // LANES  # the positions as [lines, 128]

    def spec(k: int) -> pl.BlockSpec:
        return pl.BlockSpec((k, rows, LANES), lambda i: (0, i, 0))

    out = pallas_call(
        functools.partial(_kernel, fn=fn, in_entries=tuple(in_entries), out_entries=tuple(out_entries)),
        grid=(lines // rows,), in_specs=[spec(k) for k in in_entries], out_specs=[spec(k) for k in out_entries],
        out_shape=[jax.ShapeDtypeStruct((k, lines, LANES), jnp.float32) for k in out_entries],
        cost_estimate=elementwise_cost(fn, in_entries, out_entries, positions), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(*[a.astype(jnp.float32).reshape(k, lines, LANES) for a, k in zip(arrays, in_entries, strict=True)])
    return [o.reshape(k, positions) for o, k in zip(out, out_entries, strict=True)]


def _kernel(*refs, fn: Callable, in_entries: tuple[int, ...], out_entries: tuple[int, ...]) -> None:
    ins, outs = refs[:len(in_entries)], refs[len(in_entries):]
    results = fn(*[[ref[e] for e in range(k)] for ref, k in zip(ins, in_entries, strict=True)])
    for ref, values, k in zip(outs, results, out_entries, strict=True):
        if len(values) != k:
            raise ValueError(f"run_positions: fn returned {len(values)} entries for an output of {k}")
        for e, value in enumerate(values):
            ref[e] = value.astype(jnp.float32)
