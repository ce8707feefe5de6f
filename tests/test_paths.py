"""Run outputs on a ``gs://`` bucket, through the same code path as on Google Cloud — with a fake GCS.

What is real here: ``nash_mhc.paths`` → ``etils.epath`` (its fsspec backend, the one it uses for ``gs://``
when TensorFlow is absent) → ``fsspec.filesystem("gcs")``; Orbax's GCS-specific logic (``gs://`` detection,
``commit_success.txt`` instead of atomic renames, GCS deletes); TensorStore's native GCS driver speaking the
GCS JSON API over HTTP. What is fake: the three things that would talk to Google —

- fsspec's ``gcs`` implementation (gcsfs in production) is a directory filesystem over a local folder that,
  like gcsfs, names objects ``bucket/key``;
- the GCS server is a small JSON-API server on 127.0.0.1 serving the same folder, which TensorStore reaches
  through ``TENSORSTORE_GCS_HTTP_URL`` with ``GOOGLE_AUTH_TOKEN_FOR_TESTING``;
- ``google.cloud.storage`` (which Orbax asks whether the bucket has a hierarchical namespace) is a stub.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import types
import urllib.parse
from pathlib import Path

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_implementations
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc import paths
from nash_mhc.training.checkpoint import MODEL_FORMAT, Checkpointer, find_checkpoint
from nash_mhc.training.logger import RunLogger


# ------------------------------------------------------------------------------------------ the fake GCS
class _GCSHandler(http.server.BaseHTTPRequestHandler):
    """The part of the GCS JSON API that TensorStore's ``gcs`` kvstore uses: media GET (with ranges and
    generation preconditions), media upload, DELETE and prefix listing. Object generation = file mtime_ns."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, code: int, body: bytes | dict = b"", headers: dict | None = None,
               content_type: str = "application/json") -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _request(self) -> tuple[list[str], dict[str, str]]:
        url = urllib.parse.urlsplit(self.path)
        self.server.requests.append((self.command, url.path))
        return url.path.split("/"), dict(urllib.parse.parse_qsl(url.query))

    def _object(self, bucket: str, name: str) -> Path:
        return self.server.root / bucket / name

    @staticmethod
    def _generation(file: Path) -> str:
        return str(file.stat().st_mtime_ns) if file.is_file() else "0"

    def _meta(self, bucket: str, name: str, file: Path) -> dict:
        return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(file.stat().st_size),
                "generation": self._generation(file), "metageneration": "1"}

    def do_GET(self) -> None:
        parts, query = self._request()
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 6 or parts[5] != "o":
            return self._reply(400, {"error": {"code": 400, "message": f"fake GCS: unsupported {self.path}"}})
        bucket = parts[4]
        if len(parts) == 6:  # list objects
            prefix, base = query.get("prefix", ""), self.server.root / bucket
            items = [self._meta(bucket, f.relative_to(base).as_posix(), f) for f in sorted(base.rglob("*"))
                     if f.is_file() and f.relative_to(base).as_posix().startswith(prefix)]
            return self._reply(200, {"kind": "storage#objects", "items": items})
        name = urllib.parse.unquote("/".join(parts[6:]))
        file = self._object(bucket, name)
        if not file.is_file():
            return self._reply(404, {"error": {"code": 404, "message": "not found"}})
        generation = self._generation(file)
        if query.get("ifGenerationMatch", generation) != generation:
            return self._reply(412, {"error": {"code": 412}})
        if query.get("ifGenerationNotMatch") == generation:
            return self._reply(304)
        if query.get("alt") != "media":
            return self._reply(200, self._meta(bucket, name, file))
        data, headers, code = file.read_bytes(), {"x-goog-generation": generation}, 200
        if self.headers.get("Range"):
            first, _, last = self.headers["Range"].split("=")[1].partition("-")
            end = min(int(last), len(data) - 1) if last else len(data) - 1
            headers["Content-Range"] = f"bytes {int(first)}-{end}/{len(data)}"
            data, code = data[int(first):end + 1], 206
        self._reply(code, data, headers, "application/octet-stream")

    def do_POST(self) -> None:
        parts, query = self._request()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if parts[1:5] != ["upload", "storage", "v1", "b"] or query.get("uploadType") != "media":
            return self._reply(400, {"error": {"code": 400, "message": f"fake GCS: unsupported {self.path}"}})
        bucket, name = parts[5], query["name"]
        file = self._object(bucket, name)
        if query.get("ifGenerationMatch", self._generation(file)) != self._generation(file):
            return self._reply(412, {"error": {"code": 412}})
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(file.name + ".partial-upload")
        partial.write_bytes(body)
        os.replace(partial, file)
        self._reply(200, self._meta(bucket, name, file))

    def do_DELETE(self) -> None:
        parts, query = self._request()
        file = self._object(parts[4], urllib.parse.unquote("/".join(parts[6:])))
        if not file.is_file():
            return self._reply(404, {"error": {"code": 404}})
        if query.get("ifGenerationMatch", self._generation(file)) != self._generation(file):
            return self._reply(412, {"error": {"code": 412}})
        file.unlink()
        self._reply(204)


class _FakeGCSFileSystem(DirFileSystem):
    """fsspec ``gcs``/``gs`` protocol over a local folder; like gcsfs it returns names as ``bucket/key``.

    epath caches one instance per protocol for the whole process, so the folder is a class attribute."""

    protocol = ("gs", "gcs")
    root = ""
    cachable = False
    path = property(lambda self: type(self).root, lambda self, value: None)

    def __init__(self, *args, finalize_on_close: bool | None = None, **kwargs):
        super().__init__(path="/", fs=LocalFileSystem())


class _Bucket:
    hierarchical_namespace_enabled = False


@pytest.fixture(scope="module")
def fake_gcs(tmp_path_factory):
    """Yields the local folder behind ``gs://``; bucket ``bucket`` exists."""
    root = tmp_path_factory.mktemp("gcs")
    (root / "bucket").mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GCSHandler)
    server.daemon_threads = True
    server.root, server.requests = root, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    storage = types.ModuleType("google.cloud.storage")
    storage.Client = lambda *a, **k: types.SimpleNamespace(get_bucket=lambda name: _Bucket())
    cloud = sys.modules.get("google.cloud") or types.ModuleType("google.cloud")
    saved_modules = {k: sys.modules.get(k) for k in ("google.cloud", "google.cloud.storage")}
    saved_env = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    cloud.storage = storage
    sys.modules.update({"google.cloud": cloud, "google.cloud.storage": storage})
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "fake-token"
    _FakeGCSFileSystem.root = str(root)
    for protocol in ("gcs", "gs"):
        fsspec.register_implementation(protocol, _FakeGCSFileSystem, clobber=True)
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    yield types.SimpleNamespace(root=root, server=server)

    server.shutdown()
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    for protocol in ("gcs", "gs"):
        fsspec_implementations.pop(protocol, None)  # back to "gcsfs not installed"
    for key, module in saved_modules.items():
        if module is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = module
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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


def test_orbax_checkpoints_round_trip_through_gs(fake_gcs):
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

    run = fake_gcs.root / "bucket" / "run"
    assert sorted(p.name for p in run.iterdir()) == ["2", "3"]
    assert (run / "3" / "commit_success.txt").is_file()  # Orbax's GCS commit marker, not a local rename
    uploads = [path for method, path in fake_gcs.server.requests if method == "POST"]
    assert any(path.startswith("/upload/storage/v1/b/bucket/o") for path in uploads)  # TensorStore's driver

    directory, step = find_checkpoint("gs://bucket/run/3")
    assert (os.fspath(directory), step) == ("gs://bucket/run", 3)
    reader = Checkpointer(directory, read_only=True)
    assert reader.latest_step() == 3
    reader.close()


def test_run_logger_uploads_metrics_and_events_and_appends_on_resume(fake_gcs, tmp_path):
    run = fake_gcs.root / "bucket" / "logs"
    logger = RunLogger("gs://bucket/logs", enabled=True, total_steps=4, start_step=0, progress=False)
    logger.write({"step": 1, "loss": 2.5})
    assert json.loads((run / "metrics.jsonl").read_text())["loss"] == 2.5  # first write uploads at once
    logger.write({"step": 2, "loss": 2.0})  # inside the upload interval: stays local for now
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    staging = logger._mirror.local
    logger.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert any(p.name.startswith("events.out.tfevents") and p.stat().st_size > 0 for p in run.iterdir())
    assert not staging.exists()

    resumed = RunLogger("gs://bucket/logs", enabled=True, total_steps=4, start_step=2, progress=False)
    resumed.write({"step": 3, "loss": 1.5})
    resumed.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    # process != 0: nothing is written anywhere
    RunLogger("gs://bucket/other", enabled=False, total_steps=1, start_step=0).close()
    assert not (fake_gcs.root / "bucket" / "other").exists()


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_prepare_puts_config_logs_and_checkpoints_in_the_bucket(fake_gcs):
    """The training program's set-up with --checkpoint-dir gs://...: config.json and the run logger go through
    the path layer, the checkpointer is opened there (resuming from it is the round trip above)."""
    from nash_mhc.config import ModelConfig
    from nash_mhc.data import DataConfig
    from nash_mhc.sharding import MeshConfig
    from nash_mhc.training.config import RunConfig, TrainConfig
    from nash_mhc.training.loop import Configs, prepare

    run = RunConfig(checkpoint_dir="gs://bucket/prepared", progress=False)
    session = prepare(Configs(ModelConfig.preset("tiny"), TrainConfig(batch_size=8, total_steps=4, warmup_steps=1),
                              DataConfig(dataset="synthetic"), MeshConfig(), run))
    assert "fresh start" in session.summary
    assert any(line.startswith("layout: process 0 of 1") for line in session.summary)
    assert os.fspath(session.checkpointer.directory) == "gs://bucket/prepared"
    session.logger.write({"step": 1, "loss": 3.0})
    session.logger.close()
    session.checkpointer.close()
    directory = fake_gcs.root / "bucket" / "prepared"
    config = json.loads((directory / "config.json").read_text())
    assert config["run_config"]["checkpoint_dir"] == "gs://bucket/prepared"
    assert json.loads((directory / "metrics.jsonl").read_text()) == {"step": 1, "loss": 3.0}
