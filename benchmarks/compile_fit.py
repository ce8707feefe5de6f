"""Compile the train step of a preset for a TPU topology on this (CPU) host and print its per-chip memory.

    python benchmarks/compile_fit.py --preset 1b --topology v5e-8 --fsdp 8 --per-chip-batch 8 --remat full \
        [--dump-dir /tmp/dump] [--top 15] [--set dtype=float32 ...]

Needs libtpu (``pip install -e ".[tpu]"``); no TPU. Prints :func:`nash_mhc.tpu_compile.fit.report_lines`. With
``--dump-dir`` the TPU compiler also writes its buffer assignment there (``XLA_FLAGS=--xla_dump_to``), and the
largest HBM buffers of the train step's memory-usage report are listed with the shapes they hold, which says
what the temporaries are. A 1b compile takes 10-20 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import pathlib
import re
import time


def largest_buffers(dump_dir: str, top: int) -> list[str]:
    """The ``top`` largest chunks of HBM ("default" memory space) in the train step's memory-usage report."""
    reports = [path for path in glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt"))
               if "jit__lambda" in path and "cpu_" not in path]
    if not reports:
        return [f"(no TPU memory-usage report in {dump_dir})"]
    text = pathlib.Path(max(reports, key=os.path.getmtime)).read_text()
    default = text.split("Memory Space: default")[1].split("Memory Space:")[0]
    rows = []
    for line in default.splitlines():
        parts = [p.strip() for p in line.split(";")]
        if len(parts) == 5 and re.match(r"[\d.]+\s*\w*B", parts[1]):
            rows.append((_bytes(parts[1]), parts[1], parts[4]))
    rows.sort(key=lambda row: -row[0])
    total = re.search(r"Total bytes: (\d+)", default)
    lines = [f"HBM buffers (memory-usage report, default space, total {int(total[1]) / 2**30:.2f} GiB), largest "
             f"{top}:"] if total else []
    for _, size, shapes in rows[:top]:
        lines.append(f"  {size:>10}  {shapes[:160]}")
    return lines


def _bytes(text: str) -> int:
    number, unit = re.fullmatch(r"([\d.]+)\s*(\w*B)", text.strip()).groups()
    return int(float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b", help="ModelConfig preset")
    parser.add_argument("--topology", default="v5e-8", help="TPU topology or Cloud accelerator type")
    parser.add_argument("--data", type=int, default=1, help="mesh data axis (-1: the rest)")
    parser.add_argument("--fsdp", type=int, default=-1, help="mesh fsdp axis (-1: the rest)")
    parser.add_argument("--tp", type=int, default=1, help="mesh tp axis")
    parser.add_argument("--per-chip-batch", type=int, default=8, help="sequences per data shard (data x fsdp)")
    parser.add_argument("--grad-accum-steps", type=int, default=1, help="microbatches per step")
    parser.add_argument("--remat", default="full", help="none | full | dots")
    parser.add_argument("--loss-chunks", type=int, default=1, help="cross-entropy over this many sequence slices")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelConfig override, e.g. dtype=float32 or seq_len=4096 (repeatable)")
    parser.add_argument("--dump-dir", default=None, help="write the TPU compiler's buffer assignment here")
    parser.add_argument("--top", type=int, default=15, help="largest HBM buffers to list (with --dump-dir)")
    args = parser.parse_args()
    if args.dump_dir:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.dump_dir}".strip()

    from nash_mhc import ExecutionConfig, ModelConfig, TrainConfig
    from nash_mhc.sharding import resolve_mesh_shape
    from nash_mhc.tpu_compile.fit import check_fit, report_lines, resolve_topology

    overrides = {}
    for item in args.set:
        field, _, value = item.partition("=")
        try:
            overrides[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[field] = value
    model_config = ModelConfig.preset(args.preset, **overrides)
    data, fsdp, _ = resolve_mesh_shape(args.data, args.fsdp, args.tp, resolve_topology(args.topology).chips)
    train_config = TrainConfig(batch_size=args.per_chip_batch * data * fsdp, grad_accum_steps=args.grad_accum_steps)
    start = time.perf_counter()
    with ExecutionConfig(remat=args.remat, loss_chunks=args.loss_chunks).use():
        report = check_fit(model_config, train_config, topology=args.topology, data=args.data, fsdp=args.fsdp,
                           tp=args.tp)
    print("\n".join(report_lines(report)))
    if args.dump_dir:
        print("\n".join(largest_buffers(args.dump_dir, args.top)))
    print(f"wall time {time.perf_counter() - start:.0f} s; {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
