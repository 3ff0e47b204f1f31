"""Credentials out of every log line (issue #52, item 4), without Ray: the filter sits on the handlers, so a
child logger's records, tracebacks, tokens as a URI's user name and tokens in query strings are masked too.

Injected from outside: records logged by a library-like child logger (`some_library.store`) and an exception
whose message holds the URI, through a handler of the root logger (as Hydra's job logging installs one).
Before the fix the filter sat on the "pipeline" logger alone, and knew only `user:password@`.
"""

from __future__ import annotations

import io
import logging

import pytest

from pipeline.redact import install_log_filter, redact


@pytest.mark.parametrize(
    "text, masked",
    [
        ("http://alice:s3cret@h:5000/x", "http://alice:***@h:5000/x"),
        ("https://ghp_tok123@github.com/o/r", "https://***@github.com/o/r"),
        ("http://h/api?token=abc&x=1", "http://h/api?token=***&x=1"),
        ("s3://b/k?X-Amz-Signature=ff00&X-Amz-Credential=AK/1", "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***"),
        (r"mlflow.tracking_uri=http\://alice\:pw@h\:5000", r"mlflow.tracking_uri=http\://alice\:***@h\:5000"),
        ("mail alice@example.com at hdfs://nn:8020/p?x=1", "mail alice@example.com at hdfs://nn:8020/p?x=1"),
    ],
)
def test_redact_masks_every_kind_of_uri_credential(text, masked):
    assert redact(text) == masked


def test_a_child_loggers_records_and_tracebacks_are_masked_at_the_root_handler():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        install_log_filter()
        child = logging.getLogger("some_library.store")
        child.warning("retrying http://alice:pw-child@h:5000/api (attempt %d)", 2)
        try:
            raise ConnectionError("cannot reach https://ghp_toksecret@h/x?token=tok-query")
        except ConnectionError:
            child.exception("request failed")
    finally:
        root.removeHandler(handler)
    shown = stream.getvalue()
    assert "pw-child" not in shown and "ghp_toksecret" not in shown and "tok-query" not in shown
    assert "http://alice:***@h:5000/api (attempt 2)" in shown and "https://***@h/x?token=***" in shown
