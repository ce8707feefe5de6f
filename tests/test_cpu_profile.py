"""benchmarks/cpu_profile.py's summaries: thread occupancy from profiler events and the FLOPs of a module's
matmuls, on hand-written events and HLO."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from cpu_profile import matmul_flops, occupancy  # noqa: E402


def test_occupancy_merges_each_threads_nested_events_and_splits_the_span():
    # thread 0 busy [0, 10) (an event nested inside another) and [30, 40); thread 1 busy [5, 20)
    both, one, none = occupancy([[(0, 10), (2, 5), (30, 40)], [(5, 20)]])
    assert (both, one, none) == (5, 25, 10)
    assert occupancy([[(0, 4)]]) == (0, 4, 0)
    assert occupancy([]) == (0, 0, 0)


HLO = """HloModule m

%fused_computation.1 (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,16], b: f32[16,4], c: f32[3,5,7]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %c = f32[3,5,7]{2,1,0} parameter(2)
  %ynn_fusion = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.1
  %dot.2 = f32[5,5]{1,0} dot(%c, %c), lhs_contracting_dims={0,2}, rhs_contracting_dims={0,2}
  ROOT %add = f32[8,4]{1,0} add(%ynn_fusion, %ynn_fusion)
}
"""


def test_matmul_flops_counts_fused_and_bare_dots_and_nothing_else():
    assert matmul_flops(HLO) == {"ynn_fusion": 2 * 8 * 4 * 16, "dot.2": 2 * 5 * 5 * (3 * 7)}
