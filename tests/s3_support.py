"""moto's S3 server on 127.0.0.1 for tests: start it, stop it, and the AWS variables that point at it
(`start_server`, `wait_until_up` and `stop` serve `gcs_support`'s emulator too).

Plain functions (the fixtures that use them live in the test modules: `tests/jobs/test_generate_s3.py`,
`tests/pipeline/test_ray_data.py`), as `tiny_pair_support` is for the tiny pair.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MOTO = str(Path(sys.executable).with_name("moto_server"))
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], folder: Path, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a test server (`command`, in its own session; its stderr in `<folder>/<name>.log`)."""
    return subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(folder / f"{name}.log", "w")
    )


def wait_until_up(server: subprocess.Popen, url: str, log: Path, what: str) -> None:
    """Poll `url` until the server answers (an HTTP error is an answer); fail with its log if it exits."""
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError as err:
            if getattr(err, "code", None):  # an HTTP error is an answer
                return
            assert server.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.2)


def start_moto(folder: Path, name: str, **env: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = start_server([MOTO, "-H", "127.0.0.1", "-p", str(port)], folder, name, {**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    wait_until_up(server, url, folder / f"{name}.log", "moto_server")
    return server, url


def stop(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(server.pid, signal.SIGKILL)


def credentials_file(folder: Path) -> Path:
    """An AWS shared credentials file with `CREDENTIALS`: how actors on a Ray cluster the test did not start
    with these variables (the session's) get them; the job sends them its path, never the keys."""
    path = folder / "aws_credentials"
    path.write_text(
        "[default]\n"
        f"aws_access_key_id = {CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n"
    )
    return path


@contextmanager
def moto_s3(folder: Path, buckets: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """moto's S3 server with `buckets`, the AWS variables pointing at it meanwhile (the credentials also in
    a file that AWS_SHARED_CREDENTIALS_FILE names): (url, boto3 client)."""
    import boto3

    from pipeline import fs

    server, url = start_moto(folder, "moto")
    saved = {name: os.environ.get(name) for name in fs.AWS_ENV_VARS}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=url, AWS_SHARED_CREDENTIALS_FILE=str(credentials_file(folder)))
    try:
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield url, client
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        stop(server)
