"""The compiled core under the real inductor backend (the other compiled tests count graphs with a stand-in
backend, which never runs inductor's code): tokens at two rows equal eager's.

Negative control: tracing with `backed_size_oblivious` (sizes of 1 traced like any other), which made
inductor (torch 2.13, CPU) compile the core into wrong code for two rows or more (the embedded pair's
tokens differed from eager's at the first position of every row); the same check rejects it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.fx.experimental import _config as fx_config

import spectr
from spectr import native

pytestmark = pytest.mark.slow  # inductor compiles for real: ~20-40 s per run on 2 cores


@pytest.fixture(scope="module")
def pair():
    """The embedded pair: tiny random models did not show the miscompilation."""
    import transformers

    models = Path(__file__).resolve().parents[2] / "assets" / "models"
    load = transformers.AutoModelForCausalLM.from_pretrained
    return (load(models / "target", dtype=torch.float32).eval(), load(models / "draft", dtype=torch.float32).eval())


def tokens(pair, compiled: bool, method: str = "autoregressive") -> list[list[int]]:
    target, draft = pair
    prompts = torch.randint(3, 8000, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    out = spectr.generate(target, draft, prompts, method=method, num_drafts=1, draft_length=3, max_new_tokens=8,
                          seed=[0, 1, 2], compile=compiled)
    return out.tokens


def fresh_graphs(monkeypatch):
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    native._CORES.clear()  # no graph compiled under another backend or config is reused
    monkeypatch.setattr(native, "_SELECTION", {})
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["autoregressive", "speculative"])
def test_inductor_tokens_equal_eager_at_three_rows(pair, monkeypatch, method):
    fresh_graphs(monkeypatch)
    assert tokens(pair, True, method) == tokens(pair, False, method)


def test_the_size_oblivious_trace_is_rejected(pair, monkeypatch):
    """The broken trace's wrong code is what the self-check catches (the model falls back to eager, loudly, and its
    tokens are right); with the self-check off, the same comparison with eager rejects its tokens."""
    fresh_graphs(monkeypatch)
    monkeypatch.setattr(native, "_shape_config",
                        lambda: fx_config.patch(backed_size_oblivious=True, use_duck_shape=False))
    eager = tokens(pair, False)
    with pytest.warns(RuntimeWarning, match="runs eager from now on"):
        assert tokens(pair, True) == eager  # caught: answered by the eager forward
    fresh_graphs(monkeypatch)
    monkeypatch.setattr(native, "SELF_CHECK", False)
    assert tokens(pair, True) != eager
