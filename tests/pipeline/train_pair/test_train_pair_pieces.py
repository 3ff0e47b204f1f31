"""Pieces of pair training: the corpus split, the learning-rate schedule, the draft's loss, the prompt builder."""

from __future__ import annotations

import pytest
import torch

from pipeline.train_pair.corpus import default_stdlib_dir, list_corpus_files
from pipeline.train_pair.prompts import _function_prompts
from pipeline.train_pair.spec import CorpusSpec
from pipeline.train_pair.training import draft_loss_fn, learning_rate


def test_split_is_deterministic_and_disjoint():
    corpus = CorpusSpec(heldout_every=12)
    root, train, heldout = list_corpus_files(corpus)
    assert root == default_stdlib_dir()
    assert not set(train) & set(heldout)
    assert len(heldout) > 20 and len(train) > 10 * len(heldout) // 2
    assert not any(part in ("test", "tests", "site-packages") for p in train + heldout for part in p.split("/")[:-1])
    assert list_corpus_files(corpus)[2] == heldout


def test_learning_rate_warms_up_then_anneals_to_the_floor():
    peak = 1e-3
    assert learning_rate(peak, 0, 0.0, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(1e-4)
    assert learning_rate(peak, 10, 0.0, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(peak)
    assert learning_rate(peak, 500, 1.0, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(0.1 * peak)
    assert learning_rate(peak, 500, 2.0, warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(0.1 * peak)


def test_draft_distillation_term_vanishes_only_when_the_draft_matches_the_target():
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(2, 3, 11, generator=generator)  # [B, T, V]
    labels = torch.randint(0, 11, (2, 3), generator=generator)  # [B, T]
    matched, _ = draft_loss_fn(target_logits.clone(), target_logits, labels, distill_weight=1.0)
    assert matched.item() == pytest.approx(0.0, abs=1e-6)
    other, data_ce = draft_loss_fn(torch.randn(2, 3, 11, generator=generator), target_logits, labels, 1.0)
    assert other.item() > 1e-3
    mixed, data_ce_again = draft_loss_fn(target_logits.clone(), target_logits, labels, distill_weight=0.5)
    assert mixed.item() == pytest.approx(0.5 * data_ce_again.item(), rel=1e-5)


def test_prompt_builder_takes_signatures_with_docstrings_and_simple_first_statements():
    source = '''
import os

def top(a, b=1):
    """Add things.

    More words.
    """  # trailing comment
    return a + b

class Box:
    @property
    def size(self):
        """The size."""
        return 3

    def plain(self):
        self.x = 1
        return self.x

def branchy(x):
    if x:
        return 1
    return 2
'''
    prompts = dict(_function_prompts("mod.py", source))
    assert prompts == {
        "mod.py:top:4": 'def top(a, b=1):\n    """Add things.\n\n    More words.\n    """',
        "mod.py:Box.size:13": 'def size(self):\n    """The size."""',
        "mod.py:Box.plain:17": "def plain(self):\n    self.x = 1",
    }
