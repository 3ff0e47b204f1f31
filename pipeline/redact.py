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
# scheme://user:password@ (the password up to the '@' that ends the userinfo; percent-encoded or not; Hydra's
# overrides escape the colons: http\://user\:password@)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*\\?://[^/\s:@]*):(?P<password>[^\s@/]*)@")
# scheme://TOKEN@host: userinfo without a colon that is a token (https://ghp_xxx@github.com), not a user name
# (hdfs://alice@nn): `_is_token`
TOKEN_PREFIXES = ("ghp_", "gho_", "ghs_", "ghu_", "github_pat_", "glpat-", "hf_", "sk-", "xox", "ya29.")
TOKEN_MIN_CHARS = 16  # a user name is shorter
_TOKEN_USER = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*\\?://)(?P<token>[^/\s:@*]+)@")
# a query's credential: ?token=..., &access_token=..., X-Amz-Signature=..., sig=... (the value up to & or space)
_QUERY = re.compile(
    r"(?P<head>[?&;](?:[\w.-]*(?:token|secret|password|passwd|pwd|api[_-]?key|apikey|signature|credential|"
    r"auth)[\w.-]*|key|sig|code)=)(?P<value>[^&#\s\"']+)",
    re.IGNORECASE,
)


def _is_token(user: str) -> bool:
    return len(user) >= TOKEN_MIN_CHARS or user.startswith(TOKEN_PREFIXES)


def redact(text: str) -> str:
    """`text` with every URI's password, user-name token and query credential replaced by `***`."""
    if "@" in text:
        text = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
        text = _TOKEN_USER.sub(lambda m: f"{m.group('head')}{MASK}@" if _is_token(m.group("token")) else m.group(0),
                               text)
    if "=" in text:
        text = _QUERY.sub(lambda m: f"{m.group('head')}{MASK}", text)
    return text


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
    """A log record's message, and its traceback, with every credential of a URI masked (formatted here, so
    its args go too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:  # the handler's formatter then prints this text
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


LOGGERS = ("pipeline", "mlflow", "ray", "py.warnings", "urllib3")


def install_log_filter(name: str = "pipeline") -> None:
    """Mask credentials in what the log shows (idempotent; call it again after a library added handlers):
    on logger `name` and the libraries' loggers (`LOGGERS`), and on every handler of the root logger and of
    any logger (a handler filters every record it prints, its children's included), and in the warnings
    Python prints (`warnings.showwarning`)."""
    import warnings

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in (name, *LOGGERS))]
    loggers += [item for item in logging.Logger.manager.loggerDict.values() if isinstance(item, logging.Logger)]
    for logger in loggers:
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactingFilter) for f in target.filters):
                target.addFilter(RedactingFilter())
    if not getattr(warnings.showwarning, "redacting", False):
        warnings.showwarning = _redacting_showwarning(warnings.showwarning)


def _redacting_showwarning(show: Any) -> Any:
    def showwarning(message, category, filename, lineno, file=None, line=None):
        return show(redact(str(message)), category, filename, lineno, file, line)

    showwarning.redacting = True
    return showwarning
