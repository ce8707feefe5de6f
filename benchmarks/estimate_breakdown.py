"""Where the TPU compiler's estimated step time goes: the estimate's cycles by kind of operation, and its largest
operations, from an optimised HLO module that ``benchmarks/tpu_estimate.py --hlo-dir DIR`` kept.

    python benchmarks/estimate_breakdown.py DIR/1b_v6e-8_plain+full_16_main.hlo.gz [--top 12] \
        [--device-kind "TPU v6 lite"]

Each operation counts estimated_cycles x the trip counts of the loops around it (as
:func:`nash_mhc.training.estimate.step_cost` does); a Pallas kernel counts its declared cost at the roofline of
``--device-kind`` (:func:`nash_mhc.training.estimate.kernel_roofline`, kind "Pallas kernel"). Kind: the
operation, or for a fusion the root operation of the fused computation; "matmul" says whether the operation
contains a convolution or dot, or for a kernel whether its FLOPs (not its bytes) set its roofline.
"""

from __future__ import annotations

import argparse
import collections
import gzip
from pathlib import Path

from nash_mhc.training import estimate


def breakdown(text: str, device_kind: str | None = None) -> list[tuple[int, int, int, str, bool, str, str]]:
    """(cycles per step, times per step, cycles once, kind, matmul, result type, name) of every costed
    operation, largest first."""
    computations, entry = estimate.parse_hlo(text)
    times, _ = estimate.multiplicities(computations, entry)
    has_matmul = estimate._matmul_finder(computations)
    rows = []
    for name, count in times.items():
        for op in computations[name]:
            if (kernel := estimate.kernel_roofline(op, device_kind)) is not None:
                rows.append((count * kernel[0], count, kernel[0], "Pallas kernel", kernel[2], op.type, op.name))
            elif op.cycles:
                rows.append((count * op.cycles, count, op.cycles, estimate._kind(computations, op), has_matmul(op),
                             op.type, op.name))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hlo", help="an optimised HLO module (.hlo.gz from tpu_estimate.py --hlo-dir, or text)")
    parser.add_argument("--top", type=int, default=12, help="how many kinds and operations to list")
    parser.add_argument("--device-kind", default="TPU v6 lite", choices=sorted(estimate.CLOCK_HZ),
                        help="the chip whose roofline costs Pallas kernels")
    args = parser.parse_args()
    raw = Path(args.hlo).read_bytes()
    rows = breakdown((gzip.decompress(raw) if args.hlo.endswith(".gz") else raw).decode(), args.device_kind)
    total = sum(r[0] for r in rows)
    print(f"{total:.4g} cycles per step")
    kinds: collections.Counter[tuple[str, bool]] = collections.Counter()
    for r in rows:
        kinds[r[3], r[4]] += r[0]
    for (kind, matmul), cycles in kinds.most_common(args.top):
        print(f"{cycles / total:6.1%}  {kind}{' (matmul)' if matmul else ''}")
    print()
    for cycles, count, once, kind, _, type_, name in rows[:args.top]:
        print(f"{cycles / total:6.2%}  x{count:<5} {once:>10} cycles  {kind:<22} {type_[:60]}  {name}")


if __name__ == "__main__":
    main()
