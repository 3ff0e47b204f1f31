"""The one error type for mistakes a user can fix: bad config, bad data, bad model paths.

`jobs.generate` turns a `JobInputError` into a one-line message and a non-zero exit, without a
traceback. Anything else that goes wrong is a bug or an infrastructure failure and keeps its traceback.
"""

from __future__ import annotations


class JobInputError(ValueError):
    """A user-fixable problem, found before any actor starts and before anything is written."""


class JobFailedError(RuntimeError):
    """The job ran to the end but its result is not acceptable (e.g. too many prompts failed)."""
