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


TENSOR_SAMPLE_BYTES = 4096  # of each tensor's bytes, its first and its last
WHOLE_BYTES = 64 << 20  # a file this small is hashed whole
STRIDE_BYTES = 16 << 20  # other large files (pickled weights): 4 KiB every this many bytes


def tensor_fingerprint(model_dir: Any) -> dict[str, str]:
    """{file name: sha256} of a model directory's files (not its subfolders), covering every tensor: a
    `.safetensors` file by its header (names, dtypes, shapes, offsets) and the first and last
    `TENSOR_SAMPLE_BYTES` of each tensor's data; another file whole when at most `WHOLE_BYTES`, else by its
    size and 4 KiB every `STRIDE_BYTES`. What the actors check their loaded pair against
    (`pipeline.generate.worker`): a fine-tune written into the same path, or another copy on another node,
    changes the weights of its tensors, and so the fingerprint."""
    from pathlib import Path

    found = {}
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and not path.name.startswith("."):
            found[path.name] = _file_fingerprint(path)
    return found


def _file_fingerprint(path: Any) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            length = int.from_bytes(f.read(8), "little")
            header = f.read(length)
            digest.update(header)
            try:
                tensors = json.loads(header)
            except ValueError:
                tensors = {}
            start = 8 + length
            for name in sorted(k for k in tensors if k != "__metadata__"):
                begin, end = tensors[name].get("data_offsets", (0, 0))
                for at in sorted({start + begin, max(start + begin, start + end - TENSOR_SAMPLE_BYTES)}):
                    f.seek(at)
                    digest.update(f.read(min(TENSOR_SAMPLE_BYTES, start + end - at)))
        elif size <= WHOLE_BYTES:
            digest.update(f.read())
        else:
            for at in range(0, size, STRIDE_BYTES):
                f.seek(at)
                digest.update(f.read(TENSOR_SAMPLE_BYTES))
    return digest.hexdigest()
