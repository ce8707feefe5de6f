"""The TPU compiler's step-time estimate (nash_mhc.tpu_compile.estimate): loops counted by their trip counts, checked
against fully unrolled compiles of the same programs, and the clock table checked against the compiler's own
cycle estimates of a large matmul. Needs libtpu (skips without it); no TPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, needs_libtpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc import ExecutionConfig, ModelConfig, TrainConfig
from nash_mhc.sharding import make_mesh
from nash_mhc.tpu_compile.estimate import CLOCK_HZ, EstimateError, parse_hlo, step_cost, trip_count
from nash_mhc.tpu_compile.fit import abstract_batch, abstract_train_state, topology_devices
from nash_mhc.training import step as step_module
from nash_mhc.training.throughput import table_peak


@contextlib.contextmanager
def unrolled_scans():
    """Every ``jax.lax.scan`` traced inside is fully unrolled (only ``while_loop``s reach the compiler as loops)."""
    scan = jax.lax.scan

    def unrolled(f, init=None, xs=None, length=None, reverse=False, unroll=1, **kwargs):
        return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kwargs)

    jax.lax.scan = unrolled
    try:
        yield
    finally:
        jax.lax.scan = scan


def one_chip(name: str) -> tuple[Mesh, callable]:
    mesh = Mesh(topology_devices(name)[:1], ("x",))
    return mesh, lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))


# ------------------------------------------------------------------------------------------------ clock
@needs_libtpu
@pytest.mark.parametrize("slice_name", ["v4-8", "v5e-1", "v5p-8", "v6e-1"])
def test_the_clock_puts_a_large_matmul_between_85_and_100_percent_of_the_peak(slice_name):
    """A wrong clock (say v6e at its 2-MXU reading, 3.5 GHz, or at 1 GHz) would put the compiler's estimate of a
    compute-bound matmul above the peak or far below it. Seen: v4 97 %, v5e 98 %, v5p 98 %, v6e 92 %."""
    _, shape = one_chip(slice_name)
    m, k, n = 32768, 4096, 4096
    compiled = jax.jit(lambda a, b: a @ b).lower(shape(m, k), shape(k, n)).compile()
    kind = compiled.input_shardings[0][0].mesh.devices.flat[0].device_kind
    cost = step_cost(compiled.as_text())
    achieved = 2 * m * k * n / cost.seconds(CLOCK_HZ[kind])
    assert cost.loops == () and cost.matmul_cycles == cost.cycles > 0
    assert 0.85 <= achieved / table_peak(kind) <= 1.0, achieved / table_peak(kind)


# ---------------------------------------------------------------------------------------- Pallas kernels
def declared_kernel(shape_of, flops: int):
    """A Pallas kernel (x ↦ 2x over [4096, 512] float32) declaring ``flops`` FLOPs and its operands' bytes."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    def f(x):
        tile = pl.BlockSpec((256, 512), lambda i: (i, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(16,),
                              in_specs=[tile], out_specs=tile,
                              cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                                            bytes_accessed=2 * x.size * 4))(x)
    return jax.jit(f).lower(jax.ShapeDtypeStruct((4096, 512), jnp.float32, sharding=shape_of(1).sharding))


@needs_libtpu
@pytest.mark.parametrize("slice_name", ["v4-8", "v5e-1", "v5p-8", "v6e-1"])
@pytest.mark.parametrize("flops", [10**6, 10**12])  # bound by its bytes, by its FLOPs
def test_a_pallas_kernel_is_costed_at_the_roofline_libtpu_computes_from_its_declaration(slice_name, flops,
                                                                                        monkeypatch):
    """The compiler gives a custom call no estimated_cycles; its ``optimal_seconds`` (a whole-program total) of a
    program that is one kernel is libtpu's own reading of the declaration, every FLOP at the MXU's rate: the
    estimate's must agree when every declared FLOP is a matmul's. This kernel has no matmul, so the estimate
    charges its FLOPs at the vector unit's rate (tests/test_estimate_band.py)."""
    from nash_mhc.tpu_compile import estimate

    compiled = declared_kernel(one_chip(slice_name)[1], flops).compile()
    kind = compiled.input_shardings[0][0].mesh.devices.flat[0].device_kind
    text = compiled.as_text()
    assert step_cost(text).uncosted == {"custom-call": 1}  # without a device kind: listed, not costed
    cost = step_cost(text, kind)
    assert cost.kernel_cycles == cost.cycles == cost.cycles_once > 0 and cost.uncosted == {}
    assert cost.matmul_cycles == 0 and cost.hbm_bytes == 2 * 4096 * 512 * 4
    vector = flops / estimate.VECTOR_RATE[kind]
    assert cost.seconds(CLOCK_HZ[kind]) == pytest.approx(max(vector, cost.hbm_bytes / estimate.ROOFLINE[kind][1]),
                                                         rel=0.01)
    monkeypatch.setattr(estimate, "dot_flops", lambda text: flops)  # read as all matmuls
    all_mxu = step_cost(text, kind)
    # matrix work only when its FLOPs, not its bytes, set the roofline
    assert all_mxu.matmul_cycles == (all_mxu.cycles if flops == 10**12 else 0)
    assert all_mxu.seconds(CLOCK_HZ[kind]) == pytest.approx(compiled.cost_analysis()["optimal_seconds"], rel=0.01)


# ------------------------------------------------------------------------------------ loops, small programs
def scan_program(steps: int):
    def f(w, x):
        def body(carry, w_i):
            return jnp.tanh(carry @ w_i), None

        return jax.lax.scan(body, x, w)[0].sum()

    return f


@pytest.mark.slow  # three TPU compiles; the full run (CI) keeps it
@needs_libtpu
def test_a_scanned_matmul_costs_one_body_more_per_step():
    """cost_analysis counts the body of a 3-, 4- and 9-step scan once (the same FLOPs); the step cost grows by
    exactly one body per step. (A 2-step scan gets another tiling of the same matmul from the compiler, so it
    is not compared; the fully unrolled program is another program again: the scan's body also copies its
    carry into the loop's layout every step, which the unrolled program never does.)"""
    _, shape = one_chip("v6e-1")
    costs, flops = {}, {}
    for steps in (3, 4, 9):
        compiled = jax.jit(scan_program(steps)).lower(shape(steps, 2048, 2048), shape(4096, 2048)).compile()
        costs[steps], flops[steps] = step_cost(compiled.as_text()), compiled.cost_analysis()["flops"]
        assert [trips for _, trips, _ in costs[steps].loops] == [steps]
    assert flops[3] == flops[4] == flops[9]  # the compiler's own totals do not see the trip count
    for part in ("cycles", "matmul_cycles"):
        body = getattr(costs[4], part) - getattr(costs[3], part)
        assert getattr(costs[9], part) - getattr(costs[4], part) == 5 * body > 0, part


def test_trip_counts_are_read_from_the_condition_the_start_and_the_step():
    text = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(11)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  %x = f32[4] get-tuple-element(%p), index=1
  %y = f32[4] fusion(%x), kind=kLoop, calls=%f, backend_config={"estimated_cycles":"100"}
  ROOT %t = (s32[], f32[4]) tuple(%next, %y)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4] parameter(0)
  %start = s32[] constant(3)
  %init = (s32[], f32[4]) tuple(%start, %x)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""
    computations, entry = parse_hlo(text)
    loop = computations[entry][-1]
    assert trip_count(computations, loop, computations[entry]) == 4  # 3, 5, 7, 9
    assert step_cost(text).cycles == 400
    with pytest.raises(EstimateError, match="does not compare a counter with a constant"):
        step_cost(text.replace("compare(%i, %n)", "compare(%i, %i)"))
    # a loop that may stop early (the Nash solver: i < max_iters & residual > tol) counts its most iterations
    stops_early = text.replace("""  ROOT %lt = pred[] compare(%i, %n), direction=LT
""", """  %lt = pred[] compare(%i, %n), direction=LT
  %x = f32[4] get-tuple-element(%p), index=1
  %r = f32[] reduce(%x), dimensions={0}
  %tol = f32[] constant(1e-06)
  %gt = pred[] compare(%r, %tol), direction=GT
  ROOT %both = pred[] and(%gt, %lt)
""")
    assert step_cost(stops_early).cycles == 400
    with pytest.raises(EstimateError, match="no part of its condition compares a counter"):
        step_cost(stops_early.replace("compare(%i, %n)", "compare(%i, %i)"))



def test_a_conditional_around_one_computation_counts_it_once_and_a_real_choice_is_refused():
    """The compiler can keep a conditional whose only branch runs whatever its index (seen around the
    gradient of a per-shard Pallas call inside the layer scan): that branch counts once; with two branches the
    estimate cannot know which runs."""
    text = """HloModule m

%branch (p: (f32[4])) -> f32[4] {
  %p = (f32[4]) parameter(0)
  %x = f32[4] get-tuple-element(%p), index=0
  ROOT %y = f32[4] fusion(%x), kind=kLoop, calls=%f, backend_config={"estimated_cycles":"70"}
}

%other (p: (f32[4])) -> f32[4] {
  %p = (f32[4]) parameter(0)
  ROOT %x = f32[4] get-tuple-element(%p), index=0
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %k = s32[] constant(0)
  %t = (f32[4]) tuple(%x)
  %c = f32[4] conditional(%k, %t), branch_computations={%branch}
  ROOT %z = f32[4] fusion(%c), kind=kLoop, calls=%g, backend_config={"estimated_cycles":"5"}
}
"""
    assert step_cost(text).cycles == 75
    with pytest.raises(EstimateError, match="c: conditionals are not supported"):
        step_cost(text.replace("branch_computations={%branch}", "branch_computations={%branch, %other}"))

# --------------------------------------------------------------------------------------- the train step
def compile_step(model: ModelConfig, train: TrainConfig, slice_name: str):
    mesh = make_mesh(-1, 1, 1, devices=topology_devices(slice_name))
    state = abstract_train_state(model, train, mesh)
    batch = abstract_batch(train.batch_size, model.seq_len, mesh)
    return jax.jit(lambda b, s: step_module._train_step_jit(b, s), donate_argnums=1).lower(batch, state).compile()


@pytest.mark.slow  # two TPU compiles with every Pallas kernel: 257 s in the full run of 2026-11-29 (2 cores)
@needs_libtpu
def test_the_train_steps_loops_match_an_unrolled_compile_of_the_same_step():
    """mhc + multiscale + nash with every kind of loop (2 microbatches, 2 loss chunks, remat in groups of 2
    layers, 5 Nash iterations; Sinkhorn's 3 run inside its Pallas kernels) and the splash and stream kernels:
    the loops the estimate finds have the configured trip counts, and the matmuls of the step add up to those
    of the fully unrolled compile within 10 % (seen: 1.03 x; 1.04 x before the stream kernels). The rest of the
    scanned program costs more than the unrolled one (seen: 1.04 x in all, 1.12 x before): stacking the saved
    activations into the scan's buffers and slicing the stacked weights, work the unrolled program does not do.
    (This check found grouped remat recomputing each group's last layer for nothing: the unrolled program
    dropped that dead work, the scanned one could not; see model.grouped_scan.)"""
    model = ModelConfig.preset("tiny", d_model=256, seq_len=256, sinkhorn_iters=3, nash_iters=5)
    train = TrainConfig(batch_size=16, grad_accum_steps=2)
    with ExecutionConfig(remat="full", remat_group=2, loss_chunks=2).use():
        scanned = step_cost(compile_step(model, train, "v6e-8").as_text(), "TPU v6 lite")
        with unrolled_scans():
            flat = step_cost(compile_step(model, train, "v6e-8").as_text(), "TPU v6 lite")
    # seq 256 runs splash attention (forward, recomputed forward, dK/dV, dQ), costed by the declarations
    # nash_mhc.kernels.tpu.splash hands it
    assert scanned.kernel_cycles > 0 and flat.kernel_cycles > 0 and "custom-call" not in scanned.uncosted
    assert {trips for _, trips, _ in flat.loops} == {5}  # only the Nash solver's while loops stay (may stop early)
    assert {trips for _, trips, _ in scanned.loops} == {2, 5}
    assert scanned.cycles > 2 * scanned.cycles_once  # the loops count
    assert scanned.matmul_cycles == pytest.approx(flat.matmul_cycles, rel=0.10)
    assert scanned.cycles >= flat.cycles


@pytest.mark.slow  # libtpu start-up and one small compile in a subprocess, about 25 s
@needs_libtpu
def test_compile_only_prints_the_estimated_step_time_tokens_per_second_and_mfu():
    result = subprocess.run([sys.executable, "-m", "nash_mhc.train", "--compile-only", "--topology", "v6e-8",
                             "--model", "tiny", "--batch-size", "8"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert result.returncode == 0, result.stderr
    (band,) = [line for line in result.stdout.splitlines() if line.startswith("estimated step:")]
    low, high = (float(x) for x in band.removeprefix("estimated step: ").split(" ms")[0].split("-"))
    assert 0 < low <= high and "(kernels at 100 %-60 % of their declared roofline" in band
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("estimated step time")]
    assert "the TPU compiler's cost model, not a measurement" in line
    assert " ms, " in line and "tokens/s per chip" in line and "MFU " in line and "% of 918 TFLOP/s" in line
    # the step traced under its TPU mesh holds only the TPU branches (nash_mhc.ops.dispatch.platform_dependent):
    # no platform choice is left as a conditional (8 of them before, around the kernels' gradients)
    assert "conditional" not in result.stdout
