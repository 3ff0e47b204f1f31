"""The training corpus: the running Python's stdlib `.py` files, split by path into training and held-out.

The split is deterministic (a hash of each relative path), so the default prompts always come from
modules the pair never saw. Not here: tokenizing (`tokenizer`).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from pipeline.train_pair.spec import CorpusSpec


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str, heldout_every: int) -> bool:
    """Deterministic, interpreter-independent split: sha1 of the POSIX relative path, modulo N."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % heldout_every == 0


def list_corpus_files(corpus: CorpusSpec) -> tuple[Path, list[str], list[str]]:
    """Return (root, training relative paths, held-out relative paths), both sorted.

    Raises ValueError when the directory is missing or holds no usable ``.py`` file.
    """
    root = Path(corpus.stdlib_dir) if corpus.stdlib_dir else default_stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"train.corpus.stdlib_dir: corpus directory {str(root)!r} does not exist")
    excluded = set(corpus.excluded_dirs)
    relative_paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in excluded for part in rel.parts[:-1]):
            continue
        if path.is_file() and path.stat().st_size > 0:
            relative_paths.append(rel.as_posix())
    relative_paths.sort()
    if not relative_paths:
        raise ValueError(
            f"train.corpus.stdlib_dir: no non-empty .py files under {str(root)!r} "
            f"(excluding directories named {sorted(excluded)})"
        )
    heldout = [p for p in relative_paths if is_heldout(p, corpus.heldout_every)]
    train = [p for p in relative_paths if not is_heldout(p, corpus.heldout_every)]
    if not heldout:  # tiny corpora: hold out the last file so that evaluation has something to read
        heldout, train = train[-1:], train[:-1]
    if not train:
        raise ValueError(
            f"train.corpus: only {len(relative_paths)} .py file(s) under {str(root)!r}; "
            "need at least one training and one held-out module"
        )
    if corpus.max_files is not None:
        train = train[: corpus.max_files]
    return root, train, heldout


def read_sources(root: Path, relative_paths: list[str]) -> list[str]:
    texts = []
    for rel in relative_paths:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue  # a handful of stdlib files are latin-1 test data; they are simply skipped
    return texts
