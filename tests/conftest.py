"""Shared fixtures: a tiny random Llama draft/target pair with a tiny tokenizer, and one local Ray.

The pair is built here (no hub, no embedded assets): a WordLevel tokenizer over a few dozen words,
wrapped in `PreTrainedTokenizerFast` and saved with `save_pretrained`, and two random `LlamaForCausalLM`
models (hidden size 32 and 16) saved as safetensors next to it. `max_position_embeddings` is small
(64) so that a long prompt is an easy per-row failure.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# This checkout's code first, for every process the tests start (job drivers, Ray's raylet and workers),
# even where an installed copy of the package (e.g. another worktree's editable install) would come first.
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# method=auto's plan cache: the tests' own folder, never the user's ~/.cache/spectr
os.environ["SPECTR_CACHE_DIR"] = tempfile.mkdtemp(prefix="spectr-test-cache-")

from tiny_pair_support import WORDS, build_llama, build_tokenizer, job_config  # noqa: E402, F401


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """{'target': dir, 'draft': dir, 'root': dir}: a random Llama pair sharing one tiny tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target, draft = root / "target", root / "draft"
    chat = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    tokenizer = build_tokenizer(WORDS + ["user", "assistant", ":"], target, chat_template=chat)
    build_tokenizer(WORDS + ["user", "assistant", ":"], draft, chat_template=chat)
    build_llama(target, len(tokenizer), hidden=32, layers=2, seed=1)
    build_llama(draft, len(tokenizer), hidden=16, layers=1, seed=2)
    return {"root": root, "target": target, "draft": draft}


@pytest.fixture(scope="session")
def prompts_jsonl(tmp_path_factory) -> Path:
    """40 prompts with string ids, as JSONL."""
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
            f.write(json.dumps({"id": f"p{i:03d}", "prompt": words}) + "\n")
    return path


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (2 CPUs), shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024 * 1024, log_to_driver=False
        )
    yield ray
    ray.shutdown()
