"""Run outputs on a ``gs://`` bucket, through the same code path as on Google Cloud, against a real GCS server.

The server is ``gcp-storage-emulator`` (tests/gcs_emulator.py), started once for this module on 127.0.0.1. Real
on the client side: ``nash_mhc.paths`` → ``etils.epath`` → fsspec's ``gcsfs``; Orbax's GCS logic (``gs://``
detection, ``commit_success.txt`` instead of atomic renames, GCS deletes, its ``google-cloud-storage`` bucket
query); TensorStore's native GCS driver writing and reading the arrays (it reaches no other server: without
the emulator its requests would fail).
"""

from __future__ import annotations

import json
import os
import sys

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gcs_emulator import emulator
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc import paths
from nash_mhc.training.checkpoint import MODEL_FORMAT, Checkpointer, find_checkpoint
from nash_mhc.training.logger import RunLogger


@pytest.fixture(scope="module")
def gcs():
    """The emulator, bucket ``bucket``; ``gcs.fs`` lists and reads it directly."""
    with emulator() as server:
        yield server


def objects(gcs, prefix: str) -> list[str]:
    """Object names under ``bucket/<prefix>`` (fresh listing), relative to it."""
    gcs.fs.invalidate_cache()
    base = f"bucket/{prefix}"
    return sorted(name[len(base) + 1:] for name in gcs.fs.find(base))


# ------------------------------------------------------------------------------------------------ tests
def test_local_paths_keep_their_meaning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(paths.as_path("runs/a")) == str(tmp_path / "runs" / "a")
    assert os.fspath(paths.as_path(f"file://{tmp_path}/b")) == str(tmp_path / "b")
    assert not paths.is_remote("runs/a") and not paths.is_remote("file:///x") and paths.is_remote("gs://b/x")
    mirror = paths.Mirror("runs/a")
    assert not mirror.active and mirror.local == tmp_path / "runs" / "a" and mirror.local.is_dir()
    assert mirror.sync(force=True) == []


def test_unknown_scheme_and_missing_bucket_packages_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"unsupported path scheme memory://"):
        paths.as_path("memory://x")

    def no_gcsfs(protocol: str):
        raise ImportError(f"Install gcsfs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcsfs)  # a machine without gcsfs ...
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # ... and without google-cloud-storage
    with pytest.raises(ValueError, match=r"gs:// paths need gcsfs and google-cloud-storage \(pip install -e "
                       r"\"\.\[gcs\]\"") as error:
        paths.as_path("gs://bucket/run")
    assert "\n" not in str(error.value)


def test_a_bucket_uri_without_a_bucket_or_with_a_missing_one_is_a_one_line_error_before_any_write(gcs, capsys):
    """``gs://`` once failed with gcsfs's HttpError traceback (exit 1) and a missing bucket with the URL of the
    config.json upload it refused; both, and a name GCS refuses, are one line naming the bucket, exit 2."""
    from nash_mhc.train import main

    with pytest.raises(ValueError, match=r"^s3:///x: no bucket name \(write s3://BUCKET/path\)$"):
        paths.as_path("s3:///x")
    paths.check_bucket("gs://bucket/new-run")  # an existing (empty) bucket passes
    for directory, message in [("gs://", "gs://: no bucket name (write gs://BUCKET/path)"),
                               ("gs://no-such-bucket/run", "gs://no-such-bucket/run: bucket no-such-bucket does "
                                                           "not exist"),
                               ("gs://Bad_Bucket/run", "gs://Bad_Bucket/run: 'Bad_Bucket' is not a GCS bucket name")]:
        code = main(["--model", "tiny", "--dataset", "synthetic", "--no-progress", "--compile-cache-dir", "none",
                     "--checkpoint-dir", directory])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {message}"), err
    gcs.fs.invalidate_cache()
    assert not gcs.fs.exists("no-such-bucket") and objects(gcs, "") == []


def test_orbax_checkpoints_round_trip_through_gs(gcs):
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))
    state = {"w": sharded, "b": jnp.ones(3), "step": jnp.int32(7)}
    checkpointer = Checkpointer("gs://bucket/run", max_to_keep=2)
    assert checkpointer.latest_step() is None
    for step in (1, 2, 3):
        checkpointer.save(step, jax.tree.map(lambda x, s=step: x * s, state), {"step": step, "note": "gs"})
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 3]  # max_to_keep deleted step 1 through the GCS delete path
    assert checkpointer.read_meta(3) == {"step": 3, "note": "gs", "model_format": MODEL_FORMAT}
    template = jax.tree.map(jnp.zeros_like, state)
    restored = checkpointer.restore(3, template)
    checkpointer.close()
    np.testing.assert_array_equal(restored["w"], np.arange(32.0).reshape(8, 4) * 3)
    assert restored["w"].sharding == sharded.sharding and int(restored["step"]) == 21

    names = objects(gcs, "run")
    assert sorted({name.split("/")[0] for name in names}) == ["2", "3"]
    assert "3/commit_success.txt" in names  # Orbax's GCS commit marker, not a local rename

    directory, step = find_checkpoint("gs://bucket/run/3")
    assert (os.fspath(directory), step) == ("gs://bucket/run", 3)
    reader = Checkpointer(directory, read_only=True)
    assert reader.latest_step() == 3
    reader.close()


def test_run_logger_uploads_metrics_and_events_and_appends_on_resume(gcs, tmp_path):
    def metrics() -> list[dict]:
        gcs.fs.invalidate_cache()
        return [json.loads(line) for line in gcs.fs.cat_file("bucket/logs/metrics.jsonl").decode().splitlines()]

    logger = RunLogger("gs://bucket/logs", enabled=True, total_steps=4, start_step=0, progress=False)
    logger.write({"step": 1, "loss": 2.5})
    assert metrics()[0]["loss"] == 2.5  # first write uploads at once
    logger.write({"step": 2, "loss": 2.0})  # inside the upload interval: stays local for now
    assert len(metrics()) == 1
    staging = logger._mirror.local
    logger.close()
    assert [r["step"] for r in metrics()] == [1, 2]
    events = [n for n in objects(gcs, "logs") if n.startswith("events.out.tfevents")]
    assert events and all(gcs.fs.size(f"bucket/logs/{n}") > 0 for n in events)
    assert not staging.exists()

    resumed = RunLogger("gs://bucket/logs", enabled=True, total_steps=4, start_step=2, progress=False)
    resumed.write({"step": 3, "loss": 1.5})
    resumed.close()
    assert [r["step"] for r in metrics()] == [1, 2, 3]

    # process != 0: nothing is written anywhere
    RunLogger("gs://bucket/other", enabled=False, total_steps=1, start_step=0).close()
    assert objects(gcs, "other") == []


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_prepare_puts_config_logs_and_checkpoints_in_the_bucket(gcs):
    """The training program's set-up with --checkpoint-dir gs://...: config.json and the run logger go through
    the path layer, the checkpointer is opened there (resuming from it is the round trip above)."""
    from nash_mhc.config import ModelConfig
    from nash_mhc.data import DataConfig
    from nash_mhc.run_config import RunConfig
    from nash_mhc.sharding import MeshConfig
    from nash_mhc.training.config import LoopConfig, TrainConfig
    from nash_mhc.training.session import prepare

    loop = LoopConfig(checkpoint_dir="gs://bucket/prepared", progress=False)
    session = prepare(RunConfig(ModelConfig.preset("tiny"), train=TrainConfig(batch_size=8, total_steps=4,
                                                                              warmup_steps=1),
                                data=DataConfig(dataset="synthetic"), mesh=MeshConfig(), loop=loop))
    assert "fresh start" in session.summary
    assert any(line.startswith("layout: process 0 of 1") for line in session.summary)
    assert os.fspath(session.checkpointer.directory) == "gs://bucket/prepared"
    session.logger.write({"step": 1, "loss": 3.0})
    session.logger.close()
    session.checkpointer.close()
    gcs.fs.invalidate_cache()
    config = json.loads(gcs.fs.cat_file("bucket/prepared/config.json"))
    assert config["run_config"]["checkpoint_dir"] == "gs://bucket/prepared"
    assert json.loads(gcs.fs.cat_file("bucket/prepared/metrics.jsonl")) == {"step": 1, "loss": 3.0}
