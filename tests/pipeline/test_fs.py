"""Locations: local paths and URIs through pyarrow.fs (and fsspec), whole-file writes, one-line errors."""

from __future__ import annotations

import os

import pytest

from pipeline import fs
from pipeline.errors import JobInputError


def test_local_paths_and_file_uris_are_the_same_location(tmp_path):
    plain = fs.resolve(str(tmp_path / "a"), "output_dir")
    uri = fs.resolve(f"file://{tmp_path}/a", "output_dir")
    assert plain.is_local and plain.path == uri.path == str(tmp_path / "a") and plain.renames_atomically
    assert fs.resolve("rel/dir", "output_dir").path == os.path.abspath("rel/dir")


def test_whole_file_writes_leave_no_temporary_behind(tmp_path):
    target = fs.resolve(str(tmp_path / "x.bin"), "output_dir")
    fs.write_bytes(target, b"one")
    fs.write_bytes(target, b"two")
    assert fs.read_bytes(target) == b"two" and [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    assert fs.read_range(target, 1, 3) == b"wo"
    fs.delete(target)
    fs.delete(target)  # a missing file is fine
    assert not fs.exists(target)


def test_fsspec_schemes_go_through_pyarrows_handler():
    folder = fs.resolve("memory://bucket/fs-test", "output_dir")
    assert not folder.is_local and not folder.renames_atomically
    fs.write_bytes(folder.child("a.txt"), b"hello")
    assert fs.read_bytes(folder.child("a.txt")) == b"hello"
    assert [info.base_name for info in fs.list_files(folder, "output_dir")] == ["a.txt"]


def test_gs_on_a_gcs_emulator_is_anonymous_at_its_address_and_forwarded_to_the_actors(monkeypatch):
    """`STORAGE_EMULATOR_HOST` (the GCS libraries' variable): gs:// opens pyarrow's GcsFileSystem at that
    address, anonymously (pyarrow's own default would look for credentials), and the actors get it too."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    out = fs.resolve("gs://bucket/runs/a/", "output_dir")
    assert out.filesystem.type_name == "gcs" and out.path == "bucket/runs/a" and out.uri == "gs://bucket/runs/a"
    assert out.child("_lease.json").path == "bucket/runs/a/_lease.json" and not out.renames_atomically
    assert fs.forwarded_env()["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:9"


def test_the_actors_get_the_stores_settings_never_the_credentials(monkeypatch):
    """Issue #40: Ray writes a runtime_env's values to its logs; the actors get the endpoint, the region and
    the path of a credentials file, and read the keys from their own node."""
    settings = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-1",
                "AWS_SHARED_CREDENTIALS_FILE": "/etc/aws/credentials", "AWS_PROFILE": "batch"}  # fmt: skip
    for name, value in {**settings, "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}.items():
        monkeypatch.setenv(name, value)
    assert fs.forwarded_env() == settings
    assert fs.secrets_in_env() == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]


def test_uri_passwords_are_masked_in_text_config_and_log_records(caplog):
    import logging

    from pipeline.redact import install_log_filter, redact, redacted

    assert redact("at http://alice:p%40ss@host:5000/x and s3://bucket/k") == "at http://alice:***@host:5000/x and s3://bucket/k"
    assert redact("postgresql://u:pw@db/mlflow http://u@h mail a@b") == "postgresql://u:***@db/mlflow http://u@h mail a@b"
    assert redacted({"a": ["https://u:pw@h"], "b": 1}) == {"a": ["https://u:***@h"], "b": 1}
    install_log_filter()
    install_log_filter()  # once only
    with caplog.at_level(logging.INFO, logger="pipeline"):
        logging.getLogger("pipeline").info("mlflow at %s", "http://u:hunter2@h")
    assert caplog.messages == ["mlflow at http://u:***@h"]


def test_unknown_scheme_and_missing_bucket_name_are_one_line_errors():
    with pytest.raises(JobInputError, match=r"^data.path: cannot open the URI scheme 'nosuch://'") as caught:
        fs.resolve("nosuch://x/y", "data.path")
    assert "\n" not in str(caught.value)
    with pytest.raises(JobInputError, match="names no bucket"):
        fs.resolve("s3:///x", "output_dir")


def test_best_effort_write_retries_then_warns_and_never_raises(tmp_path, caplog):
    """Bookkeeping (run records) never fails a job: a write that keeps failing (the name is a directory)
    is retried, then logged; the same write through `write_bytes` raises (negative control)."""
    (tmp_path / "_mlflow_run.json").mkdir()
    location = fs.resolve(str(tmp_path), "output_dir").child("_mlflow_run.json")
    with pytest.raises(OSError):
        fs.write_bytes(location, b"{}")
    with caplog.at_level("WARNING", logger="pipeline"):
        assert fs.write_bytes_best_effort(location, b"{}", "run record", backoff_s=0.0) is False
    assert "run record: could not write" in caplog.text
    assert fs.write_bytes_best_effort(fs.resolve(str(tmp_path), "output_dir").child("ok.json"), b"{}", "x")
