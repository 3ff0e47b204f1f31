"""Planning the generation job: every input check, the shards, and what is already done. Writes nothing.

    plan = prepare(config)   # reads and tokenizes prompts, checks the pair, opens the output dir's manifest

Not here: running anything (`pipeline.generate.job`), the file layout (`pipeline.generate.output`,
`pipeline.generate.manifest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import models, prompts
from pipeline.config import ModelConfig
from pipeline.errors import JobInputError
from pipeline.generate.config import GenerateConfig, generation_settings
from pipeline.generate.manifest import Manifest, finished_shards, open_output_dir
from pipeline.generate.shards import Shard, cut_shards, num_shards
from pipeline.hashing import stable_hash


@dataclass
class JobPlan:
    """Everything decided before any actor starts."""

    config: GenerateConfig
    output_dir: Path
    config_hash: str
    settings: dict[str, Any]
    shards: list[Shard]
    todo: list[Shard]
    manifest: Manifest
    id_kind: str
    num_rows: int


def check_pair(model: ModelConfig) -> Any:
    """The draft/target pair shares a vocabulary and a tokenizer; returns the target's tokenizer."""
    target_dir = models.check_model_dir(model.target, "model.target", model.allow_pickle)
    draft_dir = models.check_model_dir(model.draft, "model.draft", model.allow_pickle)
    target_vocab = models.vocab_size_of(target_dir, model.trust_remote_code)
    draft_vocab = models.vocab_size_of(draft_dir, model.trust_remote_code)
    if target_vocab != draft_vocab:
        raise JobInputError(
            f"model.draft: vocabulary sizes differ: target {target_dir} has {target_vocab}, draft {draft_dir} has {draft_vocab}"
        )
    target_tok = models.load_tokenizer(target_dir, "model.target", model.trust_remote_code)
    draft_tok = models.load_tokenizer(draft_dir, "model.draft", model.trust_remote_code)
    models.check_same_tokenizer(target_tok, draft_tok, target_dir, draft_dir)
    return target_tok


def prepare(config: GenerateConfig) -> JobPlan:
    """All input checks, cheapest first. Raises JobInputError; writes nothing."""
    table = prompts.read_prompts(config.data)
    target_tok = check_pair(config.model)

    texts = models.render_prompts(target_tok, config.data, table.prompts, table.messages)
    # a chat template writes its own special tokens (as apply_chat_template(tokenize=True) does)
    add_special_tokens = config.data.add_special_tokens and not config.data.chat
    token_ids = models.tokenize(target_tok, texts, add_special_tokens)
    shards = cut_shards(table.ids, texts, token_ids, config.shard_size, config.spectr.seed)

    settings = generation_settings(config)
    # the prompts themselves are part of what the output depends on
    settings["prompts_sha256"] = stable_hash([table.ids, token_ids])
    settings["num_prompts"] = len(table)
    config_hash = stable_hash(settings)
    output_dir = Path(config.output_dir or f"runs/generate-{config_hash[:12]}").expanduser().resolve()
    manifest = open_output_dir(
        output_dir, config_hash, settings, len(table), num_shards(len(table), config.shard_size)
    )
    done = finished_shards(output_dir, manifest) if output_dir.exists() else set()
    todo = [shard for shard in shards if shard.index not in done]
    return JobPlan(
        config, output_dir, config_hash, settings, shards, todo, manifest, table.id_kind, len(table)
    )
