"""A real GCS JSON-API server for the bucket tests: ``gcp-storage-emulator`` (PyPI) on 127.0.0.1, in memory.

Everything on the client side is the production path: ``nash_mhc.paths`` → ``etils.epath`` → fsspec's ``gcsfs``
(the plain ``GCSFileSystem``; ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` keeps gcsfs from asking Google's
storage-control API for the bucket type), Orbax with ``google-cloud-storage``, and TensorStore's native GCS
driver. They find the emulator through their own settings, set here in ``os.environ`` (inherited by training
subprocesses) for the life of the context:

- ``STORAGE_EMULATOR_HOST``: gcsfs and google-cloud-storage (anonymous credentials there);
- ``FSSPEC_GCS_TOKEN=anon``: gcsfs skips the credential search (no metadata-server probe);
- ``TENSORSTORE_GCS_HTTP_URL`` + ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: TensorStore;
- ``NO_GCE_CHECK=True``: google-auth never probes for a GCE metadata server.

Nothing leaves the machine: every URL is the emulator's on 127.0.0.1.

The server is the emulator with one gap filled (:func:`_serve`): its media downloads carry the object's
``x-goog-generation`` header and answer ``ifGenerationNotMatch`` of the current generation with 304, as GCS
does. Without the header, TensorStore's revalidating read of an OCDBT manifest replaced the manifest's
generation with a malformed one, and the next conditional write of an Orbax save failed with "Malformed
StorageGeneration" whenever that read returned first (3 in 15 runs of tests/test_paths.py's round trip on the
loaded 2-core VM, and once in a clean-clone CI run).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import types
import urllib.request
from collections.abc import Iterator

BUCKET = "bucket"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator() -> Iterator[types.SimpleNamespace]:
    """Start the emulator (bucket ``bucket`` exists) and point every GCS client of this process and its
    children at it; yields ``namespace(url, env, fs)`` with ``fs`` a gcsfs filesystem on it."""
    import fsspec
    import gcsfs.core
    from etils.epath import backend as epath_backend

    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "start", "--host", "127.0.0.1", "--port",
                             str(port), "--default-bucket", BUCKET, "--in-memory", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           "FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "True",
           "GOOGLE_CLOUD_PROJECT": "emulator"}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_conf = fsspec.config.conf.get("gcs")
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/", timeout=5).close()  # its health check
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start (exit {proc.poll()})") from None
                time.sleep(0.1)
        os.environ.update(env)
        fsspec.config.conf["gcs"] = {**(saved_conf or {}), "token": "anon"}  # fsspec read FSSPEC_* at import
        for protocol in ("gs", "gcs"):  # the plain GCSFileSystem, whatever gcsfs chose at its import
            fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
        yield types.SimpleNamespace(url=url, env=env, fs=gcsfs.core.GCSFileSystem(token="anon"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved_conf is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved_conf
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def _serve(argv: list[str]) -> None:
    """Run the emulator's command line (``argv``) with media downloads that report the object's generation."""
    from http import HTTPStatus

    from gcp_storage_emulator import __main__ as cli
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    plain_download = objects.download

    def download(request, response, storage, *args, **kwargs):  # noqa: ANN001, ANN202 - the emulator's handler
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return plain_download(request, response, storage, *args, **kwargs)
        generation = str(obj["generation"])
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = str(obj["metageneration"])
        if request.query.get("ifGenerationNotMatch", [None])[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        return plain_download(request, response, storage, *args, **kwargs)

    objects.download = download  # objects.get calls it for ?alt=media, the JSON API's download
    for _, methods in server.HANDLERS:  # the routes that name it directly (/download/..., public URLs)
        for method, handler in methods.items():
            if handler is plain_download:
                methods[method] = download
    cli.main(argv)


if __name__ == "__main__":
    _serve(sys.argv[1:])
