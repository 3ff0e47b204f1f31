"""Builders shared by the pipeline and job tests: a tiny tokenizer, tiny random Llamas, job configs.

Plain functions (not fixtures), imported by tests as `from tiny_pair_support import ...`; the
fixtures that use them live in tests/conftest.py. (A module of its own, because `from conftest
import ...` resolves to whichever conftest.py pytest loaded last.)
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "def return if else for in while import from class self print the a of to and is not none true false "
    "x y z value name list dict data result item key index len range open file line"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TINY_MAX_POSITIONS = 64


def build_tokenizer(words: list[str], directory: Path, chat_template: str | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(words)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def build_llama(
    directory: Path,
    vocab_size: int,
    hidden: int,
    layers: int,
    seed: int,
    max_positions: int = TINY_MAX_POSITIONS,
):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    return model



def job_config(tiny_pair: dict[str, Path], data_path: Path, output_dir: Path, /, **overrides) -> dict:
    """A plain config dict for the tiny pair (what the YAML would give), with dotted overrides."""
    raw = {
        "model": {"target": str(tiny_pair["target"]), "draft": str(tiny_pair["draft"]), "dtype": "float32"},
        "data": {"path": str(data_path)},
        "spectr": {
            "method": "spectr",
            "num_drafts": 2,
            "draft_length": 3,
            "max_new_tokens": 8,
            "batch_size": 4,
        },
        "ray": {"num_actors": 2, "cpus_per_actor": 1},
        "mlflow": {"enabled": False},
        "output_dir": str(output_dir),
        "shard_size": 8,
        "progress": False,
    }
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return raw
