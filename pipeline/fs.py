"""Where the job's files live: local paths and URIs, opened through `pyarrow.fs`.

    location = resolve("s3://bucket/runs/a", "output_dir")   # or a local path, file://, gs://, hdfs://, ...
    write_bytes(location.child("_manifest.json"), data)        # atomic: temp + rename, or one PUT

`resolve` turns `data.path` / `output_dir` into a `Location` (a filesystem and a path in it): local paths
and `file://` on `pyarrow.fs.LocalFileSystem`; `s3://` on `S3FileSystem` configured from the standard AWS
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`AWS_REGION`, `AWS_SHARED_CREDENTIALS_FILE`, ...; the Ray actors get the settings, never the credentials:
`forwarded_env`); `gs://` with `STORAGE_EMULATOR_HOST` set (the GCS client libraries' variable) on an
anonymous `GcsFileSystem` at that endpoint; other schemes pyarrow knows (`gs://`, `hdfs://`, `abfs://`)
through `FileSystem.from_uri`; anything else fsspec knows through pyarrow's fsspec handler. An unknown
scheme, an unreachable endpoint, wrong credentials or a missing bucket raise `JobInputError` with one line
naming the key and the problem.

Writes are all-or-nothing: on a local disk (or NFS) a temporary name, fsync, rename; on HDFS a temporary
name and a rename; on object stores one upload of the finished object, which becomes visible whole.

Not here: what the files contain (`pipeline.generate.output`, `pipeline.generate.commit_log`).
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipeline.errors import JobInputError

# The standard AWS variables the S3 filesystem reads (the SDK reads the credentials itself).
AWS_ENV_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_PROFILE",
)
# Credentials: never sent to the Ray actors (Ray writes a runtime_env's values to its logs and shows them to
# whoever lists actors); the actors use their nodes' own: environment, instance role, or credentials file.
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
GCS_EMULATOR_VAR = "STORAGE_EMULATOR_HOST"  # a GCS emulator's address (http://host:port): anonymous, no TLS
_PYARROW_SCHEMES = ("gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_RENAMING = ("local", "hdfs")  # filesystems whose rename is atomic: write a temporary name, then rename
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 60.0
GCS_RETRY_LIMIT_S = 60.0  # on a GCS emulator: how long pyarrow's client retries a request


@dataclass(frozen=True)
class Location:
    """A file or directory: `path` inside `filesystem`; `uri` is how users and workers name it."""

    filesystem: pafs.FileSystem
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        return self.filesystem.type_name == "local"

    @property
    def renames_atomically(self) -> bool:
        return self.filesystem.type_name in _RENAMING

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> Location:
        return Location(self.filesystem, f"{self.path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.uri


def scheme_of(uri: str) -> str:
    """'' for a plain local path, else the URI scheme ('s3', 'file', ...)."""
    if "://" not in uri:
        return ""
    return uri.split("://", 1)[0].lower()


def resolve(uri: str, key: str) -> Location:
    """The filesystem and path of a local path or URI. Raises JobInputError for an unknown scheme."""
    scheme = scheme_of(uri)
    if scheme in ("", "file", "local"):
        local = urlparse(uri).path if scheme else uri
        path = os.path.abspath(os.path.expanduser(local))
        return Location(_local(), path, path)
    if scheme in ("s3", "s3a"):
        parsed = urlparse(uri)
        if not parsed.netloc:
            raise JobInputError(f"{key}: {uri} names no bucket; expected s3://bucket/path")
        path = f"{parsed.netloc}{parsed.path}".rstrip("/") or parsed.netloc
        return Location(s3_filesystem(*_s3_settings()), path, f"s3://{path}")
    if scheme in ("gs", "gcs") and os.environ.get(GCS_EMULATOR_VAR):
        parsed = urlparse(uri)
        path = f"{parsed.netloc}{parsed.path}".rstrip("/") or parsed.netloc
        return Location(gcs_emulator_filesystem(os.environ[GCS_EMULATOR_VAR]), path, uri.rstrip("/"))
    if scheme in _PYARROW_SCHEMES:
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except Exception as err:  # noqa: BLE001 - pyarrow raises OSError/ArrowInvalid/... per backend
            raise JobInputError(f"{key}: cannot open {uri}: {_first_line(err)}") from None
        return Location(filesystem, path.rstrip("/") or path, uri.rstrip("/"))
    return _fsspec_location(uri, scheme, key)


def _fsspec_location(uri: str, scheme: str, key: str) -> Location:
    import fsspec

    try:
        filesystem = fsspec.filesystem(scheme)
    except (ValueError, ImportError) as err:
        raise JobInputError(
            f"{key}: cannot open the URI scheme '{scheme}://' of {uri} ({_first_line(err)}); pyarrow.fs opens "
            "local paths, file://, s3://, gs://, hdfs:// and abfs://, and fsspec opens the schemes it has a "
            "package for"
        ) from None
    path = filesystem._strip_protocol(uri)
    handler = pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    return Location(handler, path.rstrip("/") or path, uri.rstrip("/"))


@functools.lru_cache(maxsize=1)
def _local() -> pafs.LocalFileSystem:
    return pafs.LocalFileSystem()


def _s3_settings() -> tuple[str | None, str | None, str]:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    # the credentials are read by the AWS SDK itself; they are in the key so that new ones take effect
    credentials = "\x00".join(os.environ.get(name, "") for name in AWS_ENV_VARS)
    return endpoint, region, credentials


@functools.lru_cache(maxsize=8)
def s3_filesystem(endpoint: str | None, region: str | None, _credentials: str) -> pafs.S3FileSystem:
    """One S3 filesystem per (endpoint, region, credentials), with bounded timeouts and retries."""
    options = {
        "region": region or "us-east-1",
        "connect_timeout": S3_CONNECT_TIMEOUT_S,
        "request_timeout": S3_REQUEST_TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
        "allow_bucket_creation": False,
        "allow_bucket_deletion": False,
    }
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        options["scheme"] = parsed.scheme
    return pafs.S3FileSystem(**options)


@functools.lru_cache(maxsize=2)
def gcs_emulator_filesystem(host: str) -> pafs.GcsFileSystem:
    """`GcsFileSystem` on a GCS emulator (`STORAGE_EMULATOR_HOST`): anonymous, http unless https is named."""
    parsed = urlparse(host if "://" in host else f"http://{host}")
    return pafs.GcsFileSystem(
        anonymous=True, scheme=parsed.scheme, endpoint_override=parsed.netloc,
        retry_time_limit=timedelta(seconds=GCS_RETRY_LIMIT_S),
    )  # fmt: skip


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def info(location: Location, key: str) -> pafs.FileInfo:
    """The file info of `location` (type NotFound when absent). An unreachable store raises JobInputError."""
    try:
        return location.filesystem.get_file_info(location.path)
    except Exception as err:  # noqa: BLE001 - OSError from the SDKs; ArrowInvalid for a bad path
        raise JobInputError(f"{key}: cannot reach {location.uri}: {_first_line(err)}") from None


def check_bucket(location: Location, key: str) -> None:
    """On object stores, the bucket (or container) must exist and answer with these credentials."""
    if location.filesystem.type_name not in ("s3", "gcs", "abfs"):
        return
    bucket = location.path.split("/", 1)[0]
    found = info(Location(location.filesystem, bucket, bucket), key)
    if found.type == pafs.FileType.NotFound:
        raise JobInputError(
            f"{key}: bucket '{bucket}' of {location.uri} does not exist (or these credentials cannot see it)"
        )


def list_files(location: Location, key: str, recursive: bool = False) -> list[pafs.FileInfo]:
    """Files under a directory (sorted by path); an absent directory gives []."""
    selector = pafs.FileSelector(location.path, recursive=recursive, allow_not_found=True)
    try:
        found = location.filesystem.get_file_info(selector)
    except Exception as err:  # noqa: BLE001
        raise JobInputError(f"{key}: cannot list {location.uri}: {_first_line(err)}") from None
    return sorted((f for f in found if f.type == pafs.FileType.File), key=lambda f: f.path)


def read_bytes(location: Location) -> bytes:
    with location.filesystem.open_input_stream(location.path) as stream:
        return stream.read()


def read_range(location: Location, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a file (one ranged read on object stores)."""
    with location.filesystem.open_input_file(location.path) as f:
        return f.read_at(stop - start, start)


FILE_MODE = 0o640  # files the jobs write on local disks and NFS (they hold prompts and completions): no world read
DIR_MODE = 0o750  # and the directories they create


def make_dirs(location: Location) -> bool:
    """Create a local or HDFS directory (object stores have none; a local one `DIR_MODE`); True when it did not
    exist before."""
    if not location.renames_atomically:
        return False
    existed = location.filesystem.get_file_info(location.path).type == pafs.FileType.Directory
    if location.is_local:
        os.makedirs(location.path, mode=DIR_MODE, exist_ok=True)
    else:
        location.filesystem.create_dir(location.path, recursive=True)
    return not existed


def write_bytes(location: Location, data: bytes) -> None:
    """Write a whole file so that readers see either nothing (or the old version) or all of it."""
    if location.is_local:
        _write_local(Path(location.path), data)
        return
    filesystem = location.filesystem
    if location.renames_atomically:
        tmp = f"{location.path.rsplit('/', 1)[0]}/.{location.name}.tmp-{uuid.uuid4().hex[:12]}"
        with filesystem.open_output_stream(tmp) as stream:
            stream.write(data)
        filesystem.move(tmp, location.path)
        return
    with filesystem.open_output_stream(location.path) as stream:  # one upload; visible when closed
        stream.write(data)


BEST_EFFORT_ATTEMPTS = 3


def write_bytes_best_effort(location: Location, data: bytes, what: str, backoff_s: float = 0.5) -> bool:
    """`write_bytes` for bookkeeping (run records): retried `BEST_EFFORT_ATTEMPTS` times, then a warning;
    never raises. Returns whether it was written."""
    import logging
    import time

    for attempt in range(BEST_EFFORT_ATTEMPTS):
        try:
            write_bytes(location, data)
            return True
        except Exception as err:  # noqa: BLE001 - bookkeeping never fails a job
            if attempt + 1 == BEST_EFFORT_ATTEMPTS:
                logging.getLogger("pipeline").warning(
                    "%s: could not write %s (%s: %s); the job goes on without it", what, location.uri,
                    type(err).__name__, err,
                )  # fmt: skip
                return False
            time.sleep(backoff_s * (attempt + 1))
    return False


def temporary_name(name: str) -> str:
    """`.<name>.tmp-<pid>-<random>`: the temporary files a killed writer can leave behind."""
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _write_local(path: Path, data: bytes) -> None:
    tmp = path.with_name(temporary_name(path.name))
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete(location: Location) -> None:
    """Delete a file; a missing one is fine."""
    try:
        location.filesystem.delete_file(location.path)
    except FileNotFoundError:
        pass
    except OSError as err:
        if "not found" not in str(err).lower() and "does not exist" not in str(err).lower():
            raise


def exists(location: Location) -> bool:
    return location.filesystem.get_file_info(location.path).type != pafs.FileType.NotFound


def forwarded_env() -> dict[str, str]:
    """The object stores' settings set in this process, for the Ray actors (which may run elsewhere): the
    AWS endpoint, region, profile and the path of a credentials file, and a GCS emulator's address. Never
    the credentials themselves (`SECRET_ENV_VARS`): an actor reads its node's."""
    names = [name for name in (*AWS_ENV_VARS, GCS_EMULATOR_VAR) if name not in SECRET_ENV_VARS]
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def secrets_in_env() -> list[str]:
    """The credential variables set in this process (names only), which `forwarded_env` leaves out."""
    return [name for name in SECRET_ENV_VARS if os.environ.get(name)]
