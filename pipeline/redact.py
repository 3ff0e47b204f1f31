"""Passwords out of what the jobs write and print: `user:password@` in a URI becomes `user:***@`.

    redact("http://alice:s3cret@mlflow:5000")    # 'http://alice:***@mlflow:5000'
    redacted({"mlflow": {"tracking_uri": ...}})  # the same for every string of a nested dict / list
    install_log_filter()                         # the same for every record of the "pipeline" logger

The jobs apply it where a URI leaves the process: MLflow params, tags, dataset inputs and artifacts
(`pipeline.tracking`), the output directory's run records (`_manifest.json`'s settings, `_mlflow_run.json`),
the log, and what `jobs.generate` prints. The URIs themselves keep their passwords where they are used
(opening a store, MLflow's client). Credentials in the environment (`AWS_SECRET_ACCESS_KEY`, ...) are
never copied anywhere: Ray's actors read their own nodes' (`pipeline.fs.forwarded_env`).

Not here: where the URIs are opened (`pipeline.fs`, `pipeline.tracking`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"
# scheme://user:password@ (the password up to the '@' that ends the userinfo; percent-encoded or not)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*):(?P<password>[^\s@/]*)@")


def redact(text: str) -> str:
    """`text` with the password of every URI in it replaced by `***`."""
    if "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)


def redacted(value: Any) -> Any:
    """A copy of `value` (a str, or dicts, lists and tuples of them) with every URI's password masked."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item) for item in value)
    return value


class RedactingFilter(logging.Filter):
    """A log record's message with every URI's password masked (formatted here, so its args go too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


def install_log_filter(name: str = "pipeline") -> None:
    """Mask passwords in the records of logger `name` (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
