"""Checkpoint content is verified: every save records the crc32c of each array slice a host writes, every restore
checks the slices it reads (nash_mhc/training/checksums.py), and an export carries its tensors' crc32c.

Flipped bytes in an array file used to restore silently (export wrote NaN weights, evaluate printed NaN as JSON,
training ran into its non-finite limit). The reference here is ``google_crc32c`` on the saved NumPy values.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, cpu_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc.training.checkpoint import Checkpointer, CheckpointError

TRAIN = ["--model", "tiny", "--batch-size", "8", "--dataset", "synthetic", "--no-progress", "--log-interval", "1",
         "--checkpoint-interval", "1", "--lr-schedule-steps", "40", "--warmup-steps", "4", "--learning-rate", "3e-3"]


def flip_bytes(step_dir: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of the step's largest array file."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in p.as_posix()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    largest.write_bytes(bytes(data))


def replace_arrays(step_dir: Path, source_dir: Path) -> None:
    """``step_dir``'s array files replaced by ``source_dir``'s, its checksum record kept."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(source_dir / "state", step_dir / "state")


def sharded_state() -> dict:
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    # normal draws, as weights are: the array files hold their bytes nearly uncompressed, so flipped bytes decode
    # into other values (a file of low-entropy values fails TensorStore's decompression instead)
    values = np.random.default_rng(0).normal(size=(64, 96)).astype(np.float32)
    w = jax.device_put(values, NamedSharding(mesh, P("data")))
    return {"w": w, "b": jnp.linspace(-1, 1, 5), "step": jnp.int32(3)}


def test_each_slice_is_recorded_with_its_crc32c_and_flipped_bytes_are_refused(tmp_path):
    state = sharded_state()
    checkpointer = Checkpointer(tmp_path / "run")
    checkpointer.save(1, state, {"step": 1})
    checkpointer.wait()
    record = json.loads((tmp_path / "run" / "1" / "checksums" / "process_0.json").read_text())
    w = np.asarray(state["w"])
    rows = w.shape[0] // jax.device_count()
    expected = sorted([[[i * rows, (i + 1) * rows], [0, 96]], google_crc32c.value(w[i * rows:(i + 1) * rows].tobytes())]
                      for i in range(jax.device_count()))
    assert sorted(record["['w']"]) == expected  # one entry per shard written, crc32c of its C-order bytes
    assert record["['b']"] == [[[[0, 5]], google_crc32c.value(np.asarray(state["b"]).tobytes())]]  # replicated: once
    restored = checkpointer.restore(1, state)
    np.testing.assert_array_equal(restored["w"], w)
    checkpointer.close()

    flip_bytes(tmp_path / "run" / "1")
    reader = Checkpointer(tmp_path / "run", read_only=True)
    with pytest.raises(CheckpointError, match=r"run/1 is corrupt: crc32c of \['w'\]\[\d+:\d+, 0:96\]") as error:
        reader.restore(1, state)
    assert "\n" not in str(error.value)
    reader.close()


def test_a_checkpoint_saved_without_checksums_still_restores(tmp_path):
    state = sharded_state()
    checkpointer = Checkpointer(tmp_path / "run")
    checkpointer.save(1, state, {"step": 1})
    checkpointer.wait()
    checkpointer.close()
    for file in (tmp_path / "run" / "1" / "checksums").iterdir():  # as an older nash_mhc wrote it
        file.unlink()
    (tmp_path / "run" / "1" / "checksums").rmdir()
    reader = Checkpointer(tmp_path / "run", read_only=True)
    np.testing.assert_array_equal(reader.restore(1, state)["w"], np.asarray(state["w"]))
    reader.close()


@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory, cache_dir) -> Path:
    """A tiny run with steps 1 and 2 whose step 2's array files hold step 1's bytes: other values that decode, as
    flipped bytes of a weight file do (where flipped bytes hit a compressed block's framing instead, TensorStore's
    read fails: a one-line "cannot restore" already, and not what this guards)."""
    from nash_mhc.train import main

    run = tmp_path_factory.mktemp("corrupt") / "run"
    assert main([*TRAIN, "--compile-cache-dir", str(cache_dir), "--total-steps", "2", "--checkpoint-dir",
                 str(run)]) == 0
    replace_arrays(run / "2", run / "1")
    return run


def one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("program", ["evaluate", "generate", "export"])
def test_evaluate_generate_and_export_refuse_a_corrupt_checkpoint(corrupt_run, program, tmp_path, capsys):
    module = __import__(f"nash_mhc.{program}", fromlist=["main"])
    extra = {"evaluate": ["--num-batches", "1"], "generate": ["--max-new-tokens", "2"],
             "export": ["--out", str(tmp_path / "export")]}[program]
    capsys.readouterr()
    assert module.main(["--checkpoint-dir", str(corrupt_run), *extra]) == 2
    one_line(capsys.readouterr().err, f"{corrupt_run}/2 is corrupt: crc32c of .model.")
    assert not (tmp_path / "export").exists()


@pytest.mark.slow
def test_training_skips_a_corrupt_checkpoint_and_resumes_from_the_step_before(corrupt_run, tmp_path, cache_dir,
                                                                              capsys):
    import shutil

    from nash_mhc.train import main

    run = tmp_path / "run"
    shutil.copytree(corrupt_run, run)
    capsys.readouterr()
    assert main([*TRAIN, "--compile-cache-dir", str(cache_dir), "--total-steps", "3", "--checkpoint-dir",
                 str(run)]) == 0
    out = capsys.readouterr()
    log = out.out + out.err
    assert "skipped checkpoint step 2" in log and "is corrupt: crc32c of .model." in log
    assert "resuming from step 1" in log


@pytest.mark.slow
def test_an_export_with_flipped_bytes_is_refused_by_load_exported(corrupt_run, tmp_path):
    from nash_mhc.export import main as export_main
    from nash_mhc.exported import ExportError, load_exported

    out = tmp_path / "export"
    assert export_main(["--checkpoint-dir", str(corrupt_run), "--step", "1", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    model = load_exported(out)
    leaves = {name: np.asarray(leaf) for name, leaf in __import__("nash_mhc.exported").exported.named_arrays(model)}
    assert config["checksums"] == {name: google_crc32c.value(np.ascontiguousarray(v).tobytes())
                                   for name, v in leaves.items()}
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-200:-136] = bytes(b ^ 0xFF for b in data[-200:-136])  # inside the last tensor's bytes
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model.safetensors is corrupt: crc32c of \S+ differs"):
        load_exported(out)


WORKER = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, index, run, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from nash_mhc.training.checkpoint import Checkpointer, CheckpointError
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    full = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    sharding = NamedSharding(mesh, P("data"))
    w = jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])
    state = {"w": w}
    if mode == "save":  # step 2: the rows of process 1 (the second half) changed
        other = full.copy(); other[128:] += 1
        c = Checkpointer(run); c.save(1, state, {"step": 1})
        c.save(2, {"w": jax.make_array_from_callback(full.shape, sharding, lambda i: other[i])}, {"step": 2})
        c.wait(); c.close()
        print("saved")
    else:
        c = Checkpointer(run, read_only=True)
        try:
            c.restore(1, state); print("restored")
        except CheckpointError as e:
            print("refused:", e)
        c.close()
""")


def two_processes(mode: str, run: Path) -> list[str]:
    from test_train_cli import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(run), mode], cwd=ROOT,
                              env=cpu_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    return [o.strip().splitlines()[-1] for o in outputs]


@pytest.mark.slow
def test_two_hosts_each_record_their_own_shards_and_refuse_corruption_together(tmp_path):
    run = tmp_path / "run"
    assert two_processes("save", run) == ["saved", "saved"]
    full = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    for index in range(2):  # process i holds rows [128i, 128i + 128), in two shards of 64
        record = json.loads((run / "1" / "checksums" / f"process_{index}.json").read_text())
        assert sorted(record["['w']"]) == sorted([[[r, r + 64], [0, 64]], google_crc32c.value(full[r:r + 64].tobytes())]
                                                 for r in (128 * index, 128 * index + 64))
    assert two_processes("restore", run) == ["restored", "restored"]
    replace_arrays(run / "1", run / "2")  # other values in process 1's rows: that host finds them, the other is told
    results = two_processes("restore", run)
    assert all(line.startswith("refused:") and "is corrupt: crc32c of " in line for line in results), results
    assert sum("slices on other hosts" in line for line in results) == 1, results


@pytest.mark.slow
def test_evaluate_prints_a_non_finite_loss_as_null_and_exits_3(corrupt_run, monkeypatch, capsys):
    """JSON has no NaN: the line stays valid JSON (null), stderr says why in one line, the exit code is 3."""
    from nash_mhc.evaluate import main as evaluate_main
    from nash_mhc.training import evaluation

    real = evaluation.evaluate

    def overflowing(*args, **kwargs):
        result = real(*args, **kwargs)
        return dataclasses.replace(result, loss=float("nan"), perplexity=float("inf"))

    monkeypatch.setattr(evaluation, "evaluate", overflowing)
    capsys.readouterr()
    assert evaluate_main(["--checkpoint-dir", str(corrupt_run), "--step", "1", "--num-batches", "1"]) == 3
    out = capsys.readouterr()
    record = json.loads(out.out.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert record["loss"] is None and record["perplexity"] is None and record["aux_loss"] is not None
    one_line(out.err, "loss, perplexity not finite (nan)")
