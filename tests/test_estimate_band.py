"""The band of a step's estimate (nash_mhc.tpu_compile.estimate): kernels at their roofline and at KERNEL_SLOW of it,
their matmul FLOPs at the MXU's rate and the rest at the vector unit's; and the matmul FLOPs read from a kernel's
Mosaic module (nash_mhc.tpu_compile.mosaic)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from helpers import needs_libtpu

from nash_mhc.tpu_compile import estimate
from nash_mhc.tpu_compile.estimate import CLOCK_HZ, KERNEL_SLOW, ROOFLINE, VECTOR_RATE, step_cost

KIND = "TPU v6 lite"
CLOCK = CLOCK_HZ[KIND]


def program(flops: int, moved: int) -> str:
    """One fusion of 1,000 cycles and one Pallas kernel declaring ``flops`` FLOPs and ``moved`` bytes."""
    declared = f'"cost_estimate":{{"flops":"{flops}","transcendentals":"0","bytes_accessed":"{moved}"}}'
    config = f'{{"custom_call_config":{{{declared}}}}}'
    return f"""HloModule m

ENTRY %main (x: f32[4]) -> f32[4] {{
  %x = f32[4] parameter(0)
  %y = f32[4] fusion(%x), kind=kLoop, calls=%f, backend_config={{"estimated_cycles":"1000"}}
  ROOT %k = f32[4] custom-call(%y), custom_call_target="tpu_custom_call", backend_config={config}
}}
"""


def with_dots(monkeypatch, dots: int | None) -> None:
    """Every kernel's Mosaic module counts ``dots`` matmul FLOPs (None: unreadable)."""
    monkeypatch.setattr(estimate, "dot_flops", lambda text: dots)


@pytest.mark.parametrize(("flops", "moved"), [(10**12, 10**6), (10**6, 10**9)])  # bound by its FLOPs, its bytes
def test_all_mxu_kernels_at_their_roofline_are_the_old_estimate(monkeypatch, flops, moved):
    """Kernel FLOPs that are all matmuls (or a module that cannot be read) cost what the single-number estimate
    charged: clock x max(FLOPs / MXU FLOP/s, bytes / HBM bytes/s)."""
    peak, bandwidth = ROOFLINE[KIND]
    old = 1000 + math.ceil(max(flops / peak, moved / bandwidth) * CLOCK)
    for dots in (flops, None, 10 * flops):  # at most the declared total is MXU work
        with_dots(monkeypatch, dots)
        cost = step_cost(program(flops, moved), KIND)
        assert cost.cycles == old
        assert cost.band(CLOCK)[0] == pytest.approx(old / CLOCK)
        assert cost.matmul_cycles == (cost.kernel_cycles if flops == 10**12 else 0)


def test_the_slow_end_scales_only_the_kernels_by_one_over_the_slow_fraction(monkeypatch):
    with_dots(monkeypatch, 10**12)
    cost = step_cost(program(10**12, 10**6), KIND)
    kernel = cost.cycles - 1000
    assert kernel == cost.kernel_cycles > 1000
    low, high = cost.band(CLOCK)
    assert high == pytest.approx((1000 + kernel / KERNEL_SLOW) / CLOCK)
    assert high - low == pytest.approx(kernel / CLOCK * (1 / KERNEL_SLOW - 1))
    assert KERNEL_SLOW == 0.6


def test_vector_flops_are_charged_at_the_vector_rate(monkeypatch):
    flops, moved = 4 * 10**10, 10**3
    with_dots(monkeypatch, 0)  # no matmul: every FLOP is vector work
    vector_only = step_cost(program(flops, moved), KIND)
    assert vector_only.kernel_cycles == math.ceil(flops / VECTOR_RATE[KIND] * CLOCK)
    assert vector_only.matmul_cycles == 0
    with_dots(monkeypatch, flops // 4)  # a quarter matmuls: the roofline is the slower unit
    mixed = step_cost(program(flops, moved), KIND)
    assert mixed.kernel_cycles == math.ceil(max(flops / 4 / ROOFLINE[KIND][0], 3 * flops / 4 / VECTOR_RATE[KIND])
                                            * CLOCK)
    # the vector unit is far slower than the MXU on every chip, so the same FLOPs cost more as vector work
    assert all(VECTOR_RATE[kind] < ROOFLINE[kind][0] / 10 for kind in CLOCK_HZ)


def test_the_band_line_states_both_ends(monkeypatch):
    with_dots(monkeypatch, 0)
    cost = step_cost(program(10**10, 10**3), KIND)
    figures = estimate.step_estimate(cost, device_kind=KIND, chips=1, tokens_per_step=1024, flops_per_token=1.0)
    line = estimate.band_line(figures)
    low, high = (float(x) for x in line.removeprefix("estimated step: ").split(" ms")[0].split("-"))
    assert 0 < low < high
    assert low == pytest.approx(1e3 * figures.seconds, abs=1e-3) and high == pytest.approx(
        1e3 * figures.slow_seconds, abs=1e-3)
    assert "of their declared roofline, vector work at the VPU rate" in line


@needs_libtpu
def test_the_matmul_flops_of_a_kernel_are_read_from_its_mosaic_module():
    """A kernel on a grid of 4 that multiplies [128, 256] x [256, 128] three times in a constant-bound loop, then
    scales the product: 4 x 3 x 2 x 128 x 256 x 128 matmul FLOPs; the scaling is not counted."""
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from nash_mhc.tpu_compile.fit import topology_devices
    from nash_mhc.tpu_compile.mosaic import dot_flops

    def kernel(a_ref, b_ref, o_ref):
        def body(_, acc):
            return acc + jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        o_ref[...] = 2 * jax.lax.fori_loop(0, 3, body, jnp.zeros(o_ref.shape, jnp.float32))

    declared = 10**9

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((512, 128), jnp.float32), grid=(4,),
                              in_specs=[pl.BlockSpec((128, 256), lambda i: (i, 0)),
                                        pl.BlockSpec((256, 128), lambda i: (0, 0))],
                              out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
                              cost_estimate=pl.CostEstimate(flops=declared, transcendentals=0,
                                                            bytes_accessed=10**3))(a, b)

    mesh = Mesh(topology_devices("v6e-1")[:1], ("x",))
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P()))  # noqa: E731
    text = jax.jit(f).lower(shape(512, 256), shape(256, 128)).compile().as_text()
    (call,) = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    dots = 4 * 3 * 2 * 128 * 256 * 128
    assert dot_flops(call) == dots
    assert dot_flops(call.replace('"body":"', '"body":"AAAA')) is None  # unreadable: the caller's fallback
    cost = step_cost(text, KIND)
    assert cost.kernel_cycles == math.ceil(max(dots / ROOFLINE[KIND][0], (declared - dots) / VECTOR_RATE[KIND],
                                               10**3 / ROOFLINE[KIND][1]) * CLOCK)
