"""The pair's byte-level BPE tokenizer, trained on the training modules, and document tokenization.

Not here: the models (`model`).
"""

from __future__ import annotations

import torch

from pipeline.train_pair.spec import TokenizerSpec

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(texts: list[str], spec: TokenizerSpec):
    """Byte-level BPE without normalization, so that any text round-trips exactly.

    Returns a ``PreTrainedTokenizerFast`` that prepends BOS when ``add_special_tokens`` is true.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def tokenize_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate ``BOS doc EOS`` for every document into one flat stream. # [N] int32"""
    encoded = tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for enc in encoded:
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int32)
