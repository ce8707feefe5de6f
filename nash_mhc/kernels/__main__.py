"""``python -m nash_mhc.kernels check``: run every Pallas kernel of a preset's train step on the local devices
against its XLA form (forward and VJP, at the step's per-device shapes) and time both.

Exit 0 when every kernel matches, 1 on a mismatch, 2 on bad arguments (one line). Off TPU the kernels run in
Pallas' interpreter: use the ``tiny`` preset and a small batch there.
"""

from __future__ import annotations

import sys

from nash_mhc.cli import OneLineParser, fail
from nash_mhc.config import DTYPES, ModelConfig
from nash_mhc.training.config import TrainConfig


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m nash_mhc.kernels", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="check the kernels of a preset's train step")
    check.error = parser.error  # one-line errors for the subcommand's flags too
    check.add_argument("--model", default="tiny", choices=list(ModelConfig.PRESETS), help="model preset")
    check.add_argument("--batch-size", type=int, default=TrainConfig.batch_size,
                       help="batch over the local devices, as train's --batch-size on this host (default: %(default)s)")
    check.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    check.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default: the preset's)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax

    from nash_mhc.kernels.check import report_lines, run_check

    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("dtype", args.dtype)) if v is not None}
    devices = jax.local_devices()
    try:
        model_config = ModelConfig.preset(args.model, **overrides)
        batch = args.batch_size
        if batch < 1 or batch % len(devices):
            raise ValueError(f"--batch-size {batch} must be a positive multiple of the {len(devices)} local devices")
        report = run_check(model_config, TrainConfig(batch_size=batch, total_steps=1), devices, seed=args.seed)
    except ValueError as error:
        return fail(error)
    print("\n".join(report_lines(report)))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
