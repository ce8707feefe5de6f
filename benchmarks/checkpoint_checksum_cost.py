"""What the checkpoint checksums (nash_mhc/training/checksums.py) cost a save, at a preset's real TrainState.

    python benchmarks/checkpoint_checksum_cost.py --model base --repeats 3

Builds the preset's TrainState on this host's devices and times, for each repeat, side by side:
- ``save call``: ``Checkpointer.save``, which returns when the step may go on (it makes the host copies that the
  hashing reads), with the checksums (today's save) and without them (Orbax's items alone, as before);
- ``save total``: save + wait, until the step is on disk, with and without;
- ``hashing``: :func:`checksums.record`, the crc32c of the host copies alone (it runs in Orbax's background
  thread, beside the writes).

Writes ``docs/results/checkpoint_checksums/results.{json,md}`` with the machine, commit and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import checksums, init_train_state
from nash_mhc.training.checkpoint import Checkpointer, state_arrays

try:
    from host import machine
except ImportError:  # run from elsewhere than benchmarks/
    from benchmarks.host import machine

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "checkpoint_checksums"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def save_times(directory: Path, state, step: int, with_checksums: bool) -> tuple[float, float]:
    """(seconds in the save call, seconds until the save is on disk) of one save at ``step``."""
    checkpointer = Checkpointer(directory, max_to_keep=1)
    if not with_checksums:  # Orbax's items alone: the save as it was before the checksums
        arrays = state_arrays(state)

        def save() -> None:
            args = ocp.args.Composite(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave({"step": step}))
            checkpointer.manager.save(step, args=args, force=True)
    else:
        def save() -> None:
            checkpointer.save(step, state, {"step": step})
    start = time.perf_counter()
    save()
    call = time.perf_counter() - start
    checkpointer.wait()
    total = time.perf_counter() - start
    checkpointer.close()
    return call, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="base", help="model preset (default: base)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each measurement (default: 3)")
    parser.add_argument("--out", type=Path, default=OUT, help="results folder (default: %(default)s)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # the code measured: before it may move

    config = ModelConfig.preset(args.model)
    mesh = make_mesh(data=jax.device_count(), fsdp=1, tp=1)
    state = init_train_state(config, TrainConfig(), mesh, key=jax.random.key(0))
    arrays = state_arrays(state)
    nbytes = sum(a.nbytes for a in arrays.values() if isinstance(a, jax.Array))
    rows: dict[str, list[float]] = {k: [] for k in ("hashing_s", "save_call_s", "save_total_s", "save_call_plain_s",
                                                    "save_total_plain_s")}
    work = Path(tempfile.mkdtemp(prefix="checksum_cost_"))
    try:
        for repeat in range(args.repeats):
            shards = checksums.host_shards(arrays)
            hash_s, _ = timed(lambda shards=shards: checksums.record(shards))
            del shards
            call, total = save_times(work / "with", state, repeat + 1, True)
            plain_call, plain_total = save_times(work / "plain", state, repeat + 1, False)
            for key, value in zip(rows, (hash_s, call, total, plain_call, plain_total), strict=True):
                rows[key].append(value)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"model": args.model, "state_bytes": nbytes, "arrays": len(arrays), "repeats": args.repeats,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}", "machine": machine(),
              "commit": commit, "date": datetime.date.today().isoformat(),
              "median": {k: statistics.median(v) for k, v in rows.items()}, "all": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["median"]
    lines = [
        "# What the checkpoint checksums cost a save",
        "",
        f"`python benchmarks/checkpoint_checksum_cost.py --model {args.model} --repeats {args.repeats}` on "
        f"{result['machine']} ({result['devices']}), commit {commit}, {result['date']}. Medians of "
        f"{args.repeats} repeats; this shared machine drifts, so read the rows of one run side by side.",
        "",
        f"TrainState of `{args.model}`: {len(arrays)} arrays, {nbytes / 2**30:.2f} GiB (parameters and AdamW state).",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| save call (holds up the step), with checksums | {m['save_call_s']:.3f} |",
        f"| save call (holds up the step), Orbax items alone | {m['save_call_plain_s']:.3f} |",
        f"| crc32c of the state's host copies (Orbax's background thread) | {m['hashing_s']:.3f} |",
        f"| save until on disk, with checksums | {m['save_total_s']:.3f} |",
        f"| save until on disk, Orbax items alone | {m['save_total_plain_s']:.3f} |",
        "",
        f"crc32c rate: {nbytes / m['hashing_s'] / 2**30:.2f} GiB/s. The save call's extra time is the host copies "
        "the hashing reads: on this CPU memory copies of the state; on an accelerator a second device-to-host "
        "transfer of it (Orbax makes its own). Not measured on an accelerator.",
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
