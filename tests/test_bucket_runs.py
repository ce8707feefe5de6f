"""Training runs whose --checkpoint-dir is a bucket (the GCS emulator, tests/gcs_emulator.py): the run cleans only
what it wrote. Orbax's own clean-up took every folder of a bucket directory without a commit marker for a failed
save: a run at ``gs://bucket`` deleted its neighbours, and every resume deleted the run's ``profile/``.

One module-scoped run trains in-process (``tiny``, the 8 devices of the test process) and the tests continue it.
"""

from __future__ import annotations

import json

import pytest
from gcs_emulator import emulator

from nash_mhc.train import main

pytestmark = pytest.mark.slow  # an emulator and in-process trainings: I/O integration, the quick loop is full

ARGS = ["--model", "tiny", "--batch-size", "8", "--dataset", "synthetic", "--no-progress", "--log-interval", "1",
        "--checkpoint-interval", "1", "--lr-schedule-steps", "40", "--warmup-steps", "4", "--learning-rate", "3e-3"]
NEIGHBOURS = {"other-run/3/state/_METADATA": b"a neighbour's step without commit marker",
              "notes/keep.txt": b"a user's folder", "2024/keep.txt": b"a user's folder named like a step",
              "profile/trace.json.gz": b"the run's own --profile-steps trace"}


@pytest.fixture(scope="module")
def gcs():
    with emulator() as server:
        yield server


def objects(gcs, prefix: str = "") -> set[str]:
    gcs.fs.invalidate_cache()
    base = f"bucket/{prefix}".rstrip("/")
    return {name[len(base) + 1:] for name in gcs.fs.find(base)}


def train(cache_dir, *argv: str) -> int:
    return main([*ARGS, "--compile-cache-dir", str(cache_dir), *argv])


def steps(gcs, prefix: str) -> list[int]:
    return sorted({int(n.split("/")[0]) for n in objects(gcs, prefix) if n.split("/")[0].isdigit()
                   and n.endswith("/commit_success.txt") and n.count("/") == 1})


def logged(gcs, prefix: str) -> list[int]:
    return [json.loads(line)["step"] for line in gcs.fs.cat_file(f"bucket/{prefix}metrics.jsonl").decode().splitlines()]


def test_a_run_at_the_bucket_root_keeps_its_neighbours_through_training_and_resume(gcs, cache_dir):
    for name, data in NEIGHBOURS.items():
        gcs.fs.pipe(f"bucket/{name}", data)
    assert train(cache_dir, "--total-steps", "1", "--checkpoint-dir", "gs://bucket") == 0
    assert train(cache_dir, "--total-steps", "2", "--checkpoint-dir", "gs://bucket") == 0  # resumes from step 1
    assert steps(gcs, "") == [1, 2] and logged(gcs, "") == [1, 2]
    for name, data in NEIGHBOURS.items():
        assert gcs.fs.cat_file(f"bucket/{name}") == data, name


def test_a_resume_in_a_bucket_keeps_profile_and_sets_later_steps_and_metrics_aside(gcs, cache_dir):
    run = "gs://bucket/runs/a"
    assert train(cache_dir, "--total-steps", "3", "--checkpoint-dir", run) == 0
    gcs.fs.pipe("bucket/runs/a/profile/trace.json.gz", b"a trace")
    gcs.fs.pipe("bucket/runs/a/mine/keep.txt", b"a user's folder in the run")
    gcs.fs.pipe("bucket/runs/a/5/state/_METADATA", b"an interrupted save")  # no commit marker: removed
    before = {n for n in objects(gcs, "runs/a/3")}
    assert train(cache_dir, "--total-steps", "3", "--resume-from", f"{run}/2", "--checkpoint-dir", run) == 0
    names = objects(gcs, "runs/a")
    assert {"profile/trace.json.gz", "mine/keep.txt"} <= names
    assert not any(n.startswith("5/") for n in names)
    aside = sorted({n.split("/")[1] for n in names if n.startswith("set_aside/")})
    assert len(aside) == 1 and aside[0].endswith("-after-2")
    moved = {n[len(f"set_aside/{aside[0]}/3/"):] for n in names if n.startswith(f"set_aside/{aside[0]}/3/")}
    assert moved == before  # the whole step, object for object
    kept = gcs.fs.cat_file(f"bucket/runs/a/set_aside/{aside[0]}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [3]
    assert steps(gcs, "runs/a/") == [1, 2, 3] and logged(gcs, "runs/a/") == [1, 2, 3]  # step 3 trained again


def replace_arrays(gcs, step: str, source: str) -> None:
    """``step``'s array objects replaced by ``source``'s (other values that decode, as flipped bytes of a weight file
    do), its checksum record kept."""
    gcs.fs.invalidate_cache()
    gcs.fs.rm(f"bucket/{step}/state", recursive=True)
    gcs.fs.copy(f"bucket/{source}/state", f"bucket/{step}/state", recursive=True)
    gcs.fs.invalidate_cache()


def test_corrupt_checkpoints_in_a_bucket_fall_back_then_fail_in_one_line(gcs, cache_dir, capsys):
    run = "gs://bucket/runs/corrupt"
    assert train(cache_dir, "--total-steps", "2", "--checkpoint-dir", run) == 0
    replace_arrays(gcs, "runs/corrupt/2", "runs/corrupt/1")  # other values that decode: only the crc32c sees it
    capsys.readouterr()
    assert train(cache_dir, "--total-steps", "2", "--checkpoint-dir", run) == 0
    log = "".join(capsys.readouterr())
    assert "skipped checkpoint step 2" in log and "is corrupt: crc32c of .model." in log
    assert "resuming from step 1" in log
    gcs.fs.copy("bucket/runs/corrupt/1/state", "bucket/runs/step1-arrays/state", recursive=True)
    replace_arrays(gcs, "runs/corrupt/1", "runs/corrupt/2")  # both steps swap arrays (step 2 was trained again):
    replace_arrays(gcs, "runs/corrupt/2", "runs/step1-arrays")  # nothing restores, one line, no asyncio report
    assert train(cache_dir, "--total-steps", "2", "--checkpoint-dir", run) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()], err[-3000:]
    assert err.startswith("error: no checkpoint in gs://bucket/runs/corrupt restores: step 2 (")
