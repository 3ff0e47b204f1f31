"""Stable content hashes for configs and inputs (what an output directory's identity is made of).

Not here: deciding *what* is hashed (each job's config module says which settings change its output).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys), as hex."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()
