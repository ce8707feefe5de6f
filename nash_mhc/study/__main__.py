"""``python -m nash_mhc.study {ablation3,scaling,stability} [flags]``: run a study into an output directory.

Exit codes: 0 every run finished (or the study stopped cleanly on SIGTERM/SIGINT: rerun the same command
to continue), 1 some runs failed (their logs are named), 2 bad arguments or an output directory holding
another study's settings, or a retired study's name (one line on stderr).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from nash_mhc.cli import OneLineParser, fail
from nash_mhc.platforms import select_platform
from nash_mhc.study import ablation3, scaling, stability
from nash_mhc.study.runner import StudyError

RETIRED = {  # a retired study's name -> what to run instead
    "ablation": "the v2 ablation study was retired (it chose each variant's learning rate on one seed; its record "
                "is docs/results/ablation_v2): run `python -m nash_mhc.study ablation3` instead",
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.study", description=__doc__.splitlines()[0].split(": ", 1)[-1])
    commands = p.add_subparsers(dest="study", required=True, parser_class=OneLineParser)
    for name, module in (("ablation3", ablation3), ("scaling", scaling), ("stability", stability)):
        summary = module.__doc__.splitlines()[0].split(": ", 1)[-1]
        sub = commands.add_parser(name, help=summary, description=summary,
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return p


def main(argv: list[str] | None = None) -> int:
    select_platform()  # before anything starts a JAX backend
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in RETIRED:
        return fail(RETIRED[argv[0]])
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["python", "-m", "nash_mhc.study", *argv])
    try:
        return args.run(args)
    except StudyError as error:
        return fail(error)


if __name__ == "__main__":
    sys.exit(main())
