"""The planner's warm start: what `method=auto` learned, kept for resumes, sweeps and later jobs.

    pair = pair_key(plan)                      # on the driver: the models, bounds, batch size, warps
    states = load_states(plan, pair)           # {entry key: chooser state}, handed to the actors
    key = entry_key(pair, device_name, dtype)  # on the actor: its own device and dtype complete the key
    save_states(plan, pair, {key: state})      # on the driver, at the end of the job (best effort)

A cache entry is keyed by (pair, device name, dtype, batch size, warps, compile mode): the models' identity
(their files), `spectr.max_num_drafts` / `max_draft_length`, `spectr.batch_size`, temperature / top-k / top-p,
`spectr.compile`,
then the actor's device name (`NVIDIA H200`, `cpu`) and dtype. Its value is the chooser's own
`state()` (a JSON-able dict, opaque here). Two places hold entries, in the same format (one JSON object,
`{key: {"pair": ..., "state": ..., "updated": ...}}`):

- `_plan_cache.json` next to the output (so a resumed job starts from what its first run learned);
- `plan_cache.json` in the user cache directory (`$SPECTR_CACHE_DIR`, else `$XDG_CACHE_HOME/spectr`,
  else `~/.cache/spectr`), so that later jobs and sweep cells on the same pair start warm.

The output directory's entry wins over the user cache's. Reading or writing either never fails a job: a
problem is logged and the job runs cold. `spectr.plan_cache=false` turns both off. A warm start
changes only the speed: every configuration the chooser may run is exact.

Not here: the chooser (`spectr.planner`), how the actor uses a state (`pipeline.generate.feed`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OUTPUT_FILE = "_plan_cache.json"
USER_FILE = "plan_cache.json"


def user_cache_dir() -> Path:
    """Where later jobs find what earlier ones learned."""
    if os.environ.get("SPECTR_CACHE_DIR"):
        return Path(os.environ["SPECTR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spectr"


def pair_key(plan: Any) -> str:
    """The driver's half of an entry's key: models, bounds, batch size and warps (no device yet)."""
    s = plan.config.spectr
    described = {
        "models": plan.settings.get("models"),
        "bounds": [s.max_num_drafts, s.max_draft_length],
        "batch_size": s.batch_size,
        "warps": [s.temperature, s.top_k, s.top_p],
        "dtype": plan.config.model.dtype,
        "compile": str(s.compile),  # compiled and eager iterations cost differently: separate entries
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def entry_key(pair: str, device_name: str, dtype: str) -> str:
    """The full key: the driver's pair key plus the actor's device name and resolved dtype."""
    return f"{pair}|{device_name}|{dtype}"


def load_states(plan: Any, pair: str) -> dict[str, dict[str, Any]]:
    """Entries of this pair from the user cache, then the output dir's (which win); {} when off or absent."""
    if not plan.config.spectr.plan_cache:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for entries in (_read_user(), _read_output(plan)):
        found.update({key: entry["state"] for key, entry in entries.items()
                      if isinstance(entry, dict) and entry.get("pair") == pair and "state" in entry})
    if found:
        log.info("planner: warm start from %d cached state(s)", len(found))
    return found


def save_states(plan: Any, pair: str, states: dict[str, dict[str, Any]]) -> None:
    """Merge `states` into both caches (best effort: a failure is a warning, never a failed job)."""
    if not plan.config.spectr.plan_cache or not states:
        return
    entries = {key: {"pair": pair, "state": state, "updated": time.time()} for key, state in states.items()}
    try:
        _write_output(plan, {**_read_output(plan), **entries})
    except Exception as err:  # noqa: BLE001 - bookkeeping never fails a job
        log.warning("planner cache next to the output not written (%s: %s)", type(err).__name__, err)
    try:
        path = user_cache_dir() / USER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read_user(), **entries}
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except Exception as err:  # noqa: BLE001 - bookkeeping never fails a job
        log.warning("planner cache in %s not written (%s: %s)", user_cache_dir(), type(err).__name__, err)


def _read_user() -> dict[str, Any]:
    path = user_cache_dir() / USER_FILE
    try:
        return _entries(path.read_text()) if path.exists() else {}
    except Exception as err:  # noqa: BLE001 - a broken cache is ignored: the job runs cold
        log.warning("planner cache %s ignored (%s: %s)", path, type(err).__name__, err)
        return {}


def _read_output(plan: Any) -> dict[str, Any]:
    from pipeline import fs

    location = plan.output.child(OUTPUT_FILE)
    try:
        if not fs.exists(location):
            return {}
        return _entries(fs.read_bytes(location).decode())
    except Exception as err:  # noqa: BLE001 - a broken cache is ignored: the job runs cold
        log.warning("planner cache %s ignored (%s: %s)", OUTPUT_FILE, type(err).__name__, err)
        return {}


def _write_output(plan: Any, entries: dict[str, Any]) -> None:
    from pipeline import fs

    fs.write_bytes(plan.output.child(OUTPUT_FILE), json.dumps(entries, indent=1, sort_keys=True).encode())


def _entries(text: str) -> dict[str, Any]:
    entries = json.loads(text)
    if not isinstance(entries, dict):
        raise ValueError("not a JSON object")
    return entries
