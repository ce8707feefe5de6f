"""The TPU compiler's estimate for one training-program configuration at the preset's own vocabulary, as
the estimate table of docs/results/tpu_estimate/README.md compiles it, with any flags (memory settings, batch,
mesh) instead of the table's.

    python benchmarks/tpu_config_estimate.py v6e-8 -- --model 1b --residual plain --attention full \\
        --batch-size 32 --mesh-fsdp 8 --remat none --loss-chunks 4 [--hlo OUT.hlo.gz]

Everything after ``--`` is ``python -m nash_mhc.train`` flags, parsed by the training program's own parser;
``--compile-only`` there sizes the vocabulary from the tokenizer (byte-level by default), this script keeps the
preset's (49,152 for ``base``, ``1b``, ``3b``), so its figures compare with the table's. Prints whether the step
fits the slice's HBM (GiB per chip), the estimated step time as a band, tokens/s per chip and MFU (the compiler's cost
model with Pallas kernels at their roofline and at 60 % of it, :mod:`nash_mhc.tpu_compile.estimate`; an estimate,
never a measurement) and the compile time. Needs libtpu (``pip install -e ".[tpu]"``); runs on a CPU host
(``JAX_PLATFORMS=cpu``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("slice", help="TPU slice or topology (v6e-8, v5e:2x4, ...)")
    parser.add_argument("--hlo", type=Path, default=None, help="keep the optimised HLO module here (gzip)")
    args = parser.parse_args(argv[:split])
    train_flags = argv[split + 1:]
    if not train_flags:
        parser.error("give the training program's flags after --")

    from tpu_estimate import estimate_configs

    from nash_mhc import train as train_program
    from nash_mhc.tpu_compile import estimate

    configs, _ = train_program.configs(train_flags)
    report, figures, seconds = estimate_configs(configs, args.slice, args.hlo)
    print(f"{' '.join(train_flags)} on {args.slice}, vocabulary {configs.model.vocab_size:,}")
    total = report.total_bytes
    print(f"fits: {report.fits}" + ("" if total is None else f", {total / 2**30:.2f} GiB per chip"))
    if figures is not None:
        mfu = "" if figures.mfu is None else f", est. MFU {100 * figures.mfu:.2f} %"
        print(estimate.band_line(figures))
        print(f"at the band's low end: {figures.tokens_per_second_per_chip:,.0f} tokens/s per chip{mfu}")
    print(f"compile {seconds:.0f} s")


if __name__ == "__main__":
    main()
