"""gcp-storage-emulator (a GCS JSON API server in Python) on 127.0.0.1 for tests, plain or with generation
preconditions, and the `STORAGE_EMULATOR_HOST` variable that points `pipeline.fs` and google-cloud-storage
at it.

    with gcs_emulator(folder, "leases", preconditions=True) as url: ...

The emulator ignores `ifGenerationMatch` (its object handlers never read it), so a lease on it is refused
by the lease's probe: `preconditions=False` is that store. `preconditions=True` runs it with a test-only
extension, a stand-in for real GCS (which cannot run here): every object handler first compares the
request's `ifGenerationMatch` with the object's stored generation (0: absent) and answers 412
`conditionNotMet` when they differ, as GCS does. The server handles one request at a time, so the check
and the write are atomic.

Run as a script (`python tests/gcs_support.py PORT BUCKET [--preconditions]`) it is the server (its
requests logged to `<folder>/gcs-preconditions.log` or `gcs-plain.log` when started from here); the
emulator runs in its own process because pyarrow's GCS client can hold the GIL while it waits for an
answer (an in-process server thread would never answer it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from s3_support import free_port, start_server, stop, wait_until_up

PRECONDITION_FAILED = {
    "error": {
        "code": 412,
        "message": "At least one of the pre-conditions you specified did not hold.",
        "errors": [{"domain": "global", "reason": "conditionNotMet", "message": "Precondition Failed"}],
    }
}


def _object_name(request) -> str | None:
    params = request.params or {}
    if params.get("object_id"):
        return params["object_id"]
    if request.query.get("name"):
        return request.query["name"][0]
    data = request.data  # a multipart upload names the object in its metadata part (cached for the handler)
    if isinstance(data, dict) and isinstance(data.get("meta"), dict):
        return data["meta"].get("name")
    return None


def checking_generation(handler):
    """`handler` behind GCS's `ifGenerationMatch` check (412 when the stored generation differs)."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound

    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        name = _object_name(request) if wanted else None
        if wanted and name:
            try:
                stored = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
            except NotFound:
                stored = "0"
            if stored != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json(PRECONDITION_FAILED)
                return None
        return handler(request, response, storage, *args, **kwargs)

    return checked


def serve(port: int, bucket: str, preconditions: bool) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if preconditions:
        server.HANDLERS = tuple(
            (route, {method: checking_generation(h) if h.__module__ == objects.__name__ else h
                     for method, h in by.items()})
            for route, by in server.HANDLERS
        )  # fmt: skip
    server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


def start_emulator(folder: Path, bucket: str, preconditions: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    name = f"gcs-{'preconditions' if preconditions else 'plain'}"  # its log: every request it answered
    command = [sys.executable, __file__, str(port), bucket] + (["--preconditions"] if preconditions else [])
    server = start_server(command, folder, name)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(server, url, folder / f"{name}.log", "gcp-storage-emulator")
    return server, url


@contextmanager
def emulator_env(url: str) -> Iterator[str]:
    """`STORAGE_EMULATOR_HOST` set to `url` meanwhile (read by `pipeline.fs` and google-cloud-storage)."""
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        yield url
    finally:
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved


@contextmanager
def gcs_emulator(folder: Path, bucket: str, preconditions: bool) -> Iterator[str]:
    """The emulator with `bucket`, `STORAGE_EMULATOR_HOST` pointing at it meanwhile: its URL."""
    server, url = start_emulator(folder, bucket, preconditions)
    try:
        with emulator_env(url):
            yield url
    finally:
        stop(server)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    serve(int(sys.argv[1]), sys.argv[2], "--preconditions" in sys.argv[3:])
