"""Feature drafts (EAGLE-style heads over the target's hidden states): exact under every method.

The exact law of the first 3 generated tokens is enumerated from the warped target (as in
test_exactness_e2e.py); the engine generates thousands of seeded copies of one prompt with a feature draft
in one batched call and a chi-square test compares the counts with that law. Heads are random and peaked
(acceptance far from 0 and 1): one EAGLE-1 head over the target's last normed state with the whole
vocabulary, one EAGLE-3 head over three fused layers with a draft vocabulary of 5 of the 8 tokens (the
frequency-ranked vocabulary: q = 0 on the other 3, mapped to the target's vocabulary).

Negative controls, which the same test rejects:
- the law stored for a node is another node's (its parent's) instead of the one its children were drawn from;
- the law stored is recomputed after the head's features changed, instead of the law the token was drawn from.

Wrong or stale features alone only lower acceptance (the selection reads the law each token was drawn
from), so exactness tests cannot see them: `test_the_drafters_laws_are_the_heads_laws_over_the_true_features`
checks instead that every root law the drafter drafts from equals the head's law computed from scratch over
the committed tokens and the target's own hidden states (prefill, speculative and autoregressive iterations,
rows admitted mid-run); feeding stale features makes it fail.

Published layouts: a tiny EAGLE-3 checkpoint (safetensors: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`, config `draft_vocab_size` / `eagle_config`) and a tiny EAGLE-1 checkpoint (`pytorch_model.bin`:
`fc` with bias, `layers.0.*`, `embed_tokens`) written with the published names load and run exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import exact_joint_distribution
from test_exactness_e2e import ACCEPT_P, LENGTH, MID_RUN_BUDGETS, PROMPT, REJECT_P, WARPS, chi_square_pvalue

import spectr
from spectr.batching import ContinuousBatcher
from spectr.feature_draft import (
    EAGLE,
    EAGLE3,
    FeatureDraftConfig,
    FeatureDrafter,
    FeatureDraftModel,
    feature_draft_kind,
    load_feature_draft,
    save_feature_draft,
)
from spectr.steps import StepConfig
from spectr.warps import SamplingWarp

SAMPLES = 5000
DRAFT_IDS = [0, 1, 3, 4, 6]  # the EAGLE-3 head's draft vocabulary: tokens 2, 5 and 7 are never drafted


def make_head(target, kind: str, seed: int = 5, std: float = 1.0) -> FeatureDraftModel:
    hidden = target.config.hidden_size
    layers = [target.config.num_hidden_layers] if kind == EAGLE else [0, 1, 2]
    config = FeatureDraftConfig(kind=kind, hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=hidden // 2, intermediate_size=2 * hidden, vocab_size=8,
                                feature_layers=layers, draft_vocab_size=None if kind == EAGLE else len(DRAFT_IDS))
    head = FeatureDraftModel(config, target.get_input_embeddings(), target.get_output_embeddings())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
        if kind == EAGLE3:
            head.d2t.copy_(torch.tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS)))
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target(e2e_pair):
    return e2e_pair[0]


@pytest.fixture(scope="module")
def heads(target):
    return {EAGLE: make_head(target, EAGLE), EAGLE3: make_head(target, EAGLE3)}


@pytest.fixture(scope="module")
def exact_laws(target):
    return {name: exact_joint_distribution(target, PROMPT, LENGTH, SamplingWarp(*w)).reshape(-1)
            for name, w in WARPS.items()}


def run(target, head, method, num_drafts, draft_length, warp_name="plain", samples=SAMPLES, batch_size=None):
    temperature, top_k, top_p = WARPS[warp_name]
    budgets = LENGTH if batch_size is None else [MID_RUN_BUDGETS[i % 4] for i in range(samples)]
    out = spectr.generate(target, head, [PROMPT] * samples, method=method, num_drafts=num_drafts,
                          draft_length=draft_length, max_new_tokens=budgets, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=list(range(samples)), batch_size=batch_size)
    return [t[:LENGTH] for t in out.tokens], out.stats


CASES = [("speculative", 1, 3), ("block", 1, 3), ("spectr", 3, 2), ("specinfer", 2, 2), ("traversal", 2, 3)]


@pytest.mark.parametrize("method,num_drafts,draft_length", CASES)
@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_first_three_tokens_follow_the_target_with_a_feature_draft(target, heads, exact_laws, kind, method,
                                                                   num_drafts, draft_length):
    warp = "warped" if method in ("spectr", "traversal") else "plain"
    tokens, stats = run(target, heads[kind], method, num_drafts, draft_length, warp)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(tokens, exact_laws[warp]) > ACCEPT_P


def test_the_draft_vocabulary_is_all_the_draft_proposes(target, heads, monkeypatch):
    """q is zero outside the draft vocabulary: no drafted token is outside it (the target still emits them)."""
    drafted = []
    propose = FeatureDrafter.propose

    def spy(self, *args, **kwargs):
        tree = propose(self, *args, **kwargs)
        drafted.append(tree.tokens.unique())
        outside = tree.draft_probs[..., [2, 5, 7]]  # [B, K, L, 3]; depth 0 is read from draft 0's row only
        assert float(outside[:, 0, 0].abs().max()) == 0.0 and float(outside[:, :, 1:].abs().sum()) == 0.0
        return tree

    monkeypatch.setattr(FeatureDrafter, "propose", spy)
    tokens, _ = run(target, heads[EAGLE3], "spectr", 3, 2, samples=300)
    assert set(torch.cat(drafted).tolist()) <= set(DRAFT_IDS)
    assert {t for row in tokens for t in row} & {2, 5, 7}  # the target's law still reaches them


def test_rows_admitted_mid_run_follow_the_target_with_a_feature_draft(target, heads, exact_laws):
    tokens, stats = run(target, heads[EAGLE3], "spectr", 3, 2, "warped", batch_size=400)
    assert stats.admissions > 1
    assert chi_square_pvalue(tokens, exact_laws["warped"]) > ACCEPT_P


SWITCHING = [StepConfig.of("autoregressive"), StepConfig.of("autoregressive"), StepConfig.of("spectr", 3, 2),
             StepConfig.of("speculative", 1, 1), StepConfig.of("autoregressive"), StepConfig.of("block", 1, 3),
             StepConfig.of("autoregressive"), StepConfig.of("autoregressive"), StepConfig.of("autoregressive"),
             StepConfig.of("autoregressive"), StepConfig.of("autoregressive"), StepConfig.of("traversal", 2, 3)]


def run_switching(target, head, samples=SAMPLES, batch_size=400, record=None):
    """One ContinuousBatcher (K <= 3, L <= 3) cycling through SWITCHING (runs of autoregressive iterations
    longer than the pending buffer: the drafter flushes), rows admitted at every phase."""
    batcher = ContinuousBatcher(target, head, batch_size=batch_size, max_length=len(PROMPT) + 8,
                                method="autoregressive", max_num_drafts=3, max_draft_length=3)
    budgets = [MID_RUN_BUDGETS[i % 4] for i in range(samples)]
    batcher.admit([PROMPT] * samples, max_new_tokens=budgets, seed=list(range(samples)))
    rows, iteration = {}, 0
    while not batcher.idle:
        for row in batcher.step(SWITCHING[iteration % len(SWITCHING)]):
            rows[row.request] = row
        iteration += 1
    for row in rows.values():
        batcher.stats.add_row(row)
    return [rows[i].tokens[:LENGTH] for i in range(samples)], batcher


def test_a_run_switching_methods_with_a_feature_draft_follows_the_target(target, heads, exact_laws):
    tokens, batcher = run_switching(target, heads[EAGLE3])
    assert 0.05 < batcher.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(tokens, exact_laws["plain"]) > ACCEPT_P


def _parent_law_stored(monkeypatch):
    """Negative control: each node stores its parent's law (another node's) instead of its own."""
    tree_of = FeatureDrafter._tree

    def wrong(self, tokens, probs, leaders, nonfinite, running):
        shifted = probs.clone()
        shifted[:, :, 1:] = probs[:, :, :-1]
        return tree_of(self, tokens, shifted, leaders, nonfinite, running)

    monkeypatch.setattr(FeatureDrafter, "_tree", wrong)


def _law_recomputed_after_the_features_changed(monkeypatch):
    """Negative control: the tokens are drawn from the head's laws, but the laws stored are the head's laws
    recomputed with changed features (the parents' hidden states reversed): not the laws drawn from."""
    propose = FeatureDrafter.propose
    forward = FeatureDraftModel.forward

    def perturbed(self, tokens, features, positions, *, from_target, attend=None):
        if not from_target:
            features = features.flip(-1)
        return forward(self, tokens, features, positions, from_target=from_target, attend=attend)

    def wrong(self, uniforms, extent, running):
        pending = (self.pending.clone(), self.pending_features.clone(), self.num_pending.clone())
        drawn = propose(self, uniforms, extent, running)
        self.pending, self.pending_features, self.num_pending = pending
        monkeypatch.setattr(FeatureDraftModel, "forward", perturbed)
        try:
            recomputed = propose(self, uniforms, extent, running)
        finally:
            monkeypatch.setattr(FeatureDraftModel, "forward", forward)
        drawn.draft_probs[:, :, 1:] = recomputed.draft_probs[:, :, 1:]
        return drawn

    monkeypatch.setattr(FeatureDrafter, "propose", wrong)


@pytest.mark.parametrize("control", [_parent_law_stored, _law_recomputed_after_the_features_changed],
                         ids=["parent law stored", "law recomputed after the features changed"])
@pytest.mark.parametrize("method,num_drafts,draft_length", [("speculative", 1, 3), ("spectr", 3, 2)])
def test_negative_controls_a_stored_law_other_than_the_drawn_one_is_rejected(target, heads, exact_laws, monkeypatch,
                                                                             control, method, num_drafts,
                                                                             draft_length):
    control(monkeypatch)
    tokens, _ = run(target, heads[EAGLE3], method, num_drafts, draft_length)
    assert chi_square_pvalue(tokens, exact_laws["plain"]) < REJECT_P


# --- the head reads the target's true features --------------------------------------------------------------
def _reference_root_law(target, head, sequence: list[int]) -> torch.Tensor:
    """The head's law of the token after `sequence`, from scratch: the target's full forward gives the
    features, the head reads tokens 1.. with the features of the positions before them (causal, no cache)."""
    with torch.no_grad():
        states = target(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in head.config.feature_layers], -1)[:, :-1]  # [1, n-1, F]
        tokens = torch.tensor([sequence[1:]])
        positions = torch.arange(1, len(sequence))[None]
        hidden = head(tokens, features.float(), positions, from_target=True)
        return torch.softmax(head.full_logits(hidden[:, -1]).float(), -1)[0]


def _reference_depth2_law(target, head, sequence: list[int], drafted: int) -> torch.Tensor:
    """The head's law at drafting depth 2 after `sequence` and its drafted token, as the training's
    `feature.unrolled` computes it for every position at once (EAGLE-3's training-time test)."""
    from pipeline.train_draft.feature import unrolled

    with torch.no_grad():
        states = target(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in head.config.feature_layers], -1).float()  # [1, n, F]
        tokens = torch.tensor([sequence[1:] + [drafted]])
        positions = torch.arange(1, len(sequence) + 1)[None]
        _, depth2 = unrolled(head, tokens, features, positions, 2)  # the last feature is never read at depth 2
        return torch.softmax(head.full_logits(depth2[:, -1]).float(), -1)[0]


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_the_drafters_laws_are_the_heads_laws_over_the_true_features(target, heads, monkeypatch, kind):
    """The root law is the head's over the target's true features; the law at depth 2 is the one the training
    unrolls (`feature.unrolled`), so the head is trained on what the engine asks of it."""
    head = heads[kind]
    seen = []  # (root law, running, depth-1 token of draft 0, its depth-2 law or None)
    propose = FeatureDrafter.propose

    def spy(self, uniforms, extent, running):
        tree = propose(self, uniforms, extent, running)
        deeper = tree.draft_probs.shape[2] > 1
        seen.append((tree.draft_probs[:, 0, 0].clone(), running.clone(), tree.tokens[:, 0, 0].clone(),
                     tree.draft_probs[:, 0, 1].clone() if deeper else None))
        return tree

    monkeypatch.setattr(FeatureDrafter, "propose", spy)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1, 2], [2, 6]]
    batcher = ContinuousBatcher(target, head, batch_size=2, max_length=24, method="autoregressive",
                                max_num_drafts=3, max_draft_length=3)
    batcher.admit(prompts, max_new_tokens=[14, 16, 12], seed=[1, 2, 3])
    batcher.watch_tokens = True
    history = {i: list(p) for i, p in enumerate(prompts)}
    checked = deep = 0
    for iteration in range(200):
        if batcher.idle:
            break
        in_slot = [None if r is None else r.request for r in batcher._in_slot]
        before = len(seen)
        finished = batcher.step(SWITCHING[iteration % len(SWITCHING)])
        if len(seen) > before:  # a speculative iteration: each running row's root law vs the reference
            laws, running, drafted, deeper = seen[-1]
            for slot, request in enumerate(in_slot):
                if request is not None and slot < len(running) and bool(running[slot]):
                    expected = _reference_root_law(target, head, history[request])
                    torch.testing.assert_close(laws[slot], expected, atol=2e-5, rtol=1e-4)
                    checked += 1
                    if deeper is not None:
                        expected = _reference_depth2_law(target, head, history[request], int(drafted[slot]))
                        torch.testing.assert_close(deeper[slot], expected, atol=2e-5, rtol=1e-4)
                        deep += 1
        for request, tokens in batcher.recent_tokens.items():
            history[request].extend(tokens)
        for row in finished:
            history[row.request] = list(prompts[row.request]) + list(row.tokens)
    assert batcher.idle and checked >= 10 and deep >= 4


# --- published layouts --------------------------------------------------------------------------------------
def _eagle3_checkpoint(folder, head: FeatureDraftModel) -> None:
    """Write `head` as a published EAGLE-3 checkpoint would be (names, d2t / t2d, config keys), by hand."""
    from safetensors.torch import save_file

    names = {"q_proj": "midlayer.self_attn.q_proj", "k_proj": "midlayer.self_attn.k_proj",
             "v_proj": "midlayer.self_attn.v_proj", "o_proj": "midlayer.self_attn.o_proj",
             "gate_proj": "midlayer.mlp.gate_proj", "up_proj": "midlayer.mlp.up_proj",
             "down_proj": "midlayer.mlp.down_proj", "hidden_norm": "midlayer.hidden_norm",
             "input_layernorm": "midlayer.input_layernorm",
             "post_attention_layernorm": "midlayer.post_attention_layernorm"}
    tensors = {}
    for name, tensor in head.state_dict().items():
        top, _, rest = name.partition(".")
        tensors[f"{names.get(top, top)}.{rest}" if rest else name] = tensor.clone()
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 16,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32,
              "vocab_size": 8, "draft_vocab_size": 5, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_eagle3_layout_checkpoint_loads_and_runs_exactly(target, heads, exact_laws, tmp_path):
    _eagle3_checkpoint(tmp_path, heads[EAGLE3])
    assert feature_draft_kind(tmp_path) == EAGLE3
    loaded = load_feature_draft(tmp_path, target)
    for name, tensor in heads[EAGLE3].state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    tokens, stats = run(target, loaded, "spectr", 3, 2)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(tokens, exact_laws["plain"]) > ACCEPT_P


def test_an_eagle1_layout_checkpoint_loads_with_its_own_embedding(target, heads, tmp_path):
    """EAGLE-1's published layout: pytorch_model.bin with `fc` (bias), `layers.0.*` and the target's
    embedding copied in; its config is a one-layer LlamaConfig (nothing says EAGLE but the tensors)."""
    head = heads[EAGLE]
    tensors = {}
    for name, tensor in head.state_dict().items():
        top = name.split(".")[0]
        prefix = ("layers.0.self_attn." if top in ("q_proj", "k_proj", "v_proj", "o_proj") else
                  "layers.0.mlp." if top.endswith("_proj") else
                  "layers.0." if top == "post_attention_layernorm" else "")
        if top != "d2t":
            tensors[prefix + name] = tensor.clone()
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 8, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6}))
    assert feature_draft_kind(tmp_path) == EAGLE
    loaded = load_feature_draft(tmp_path, target)
    same = spectr.generate(target, loaded, [PROMPT] * 50, method="spectr", num_drafts=2, draft_length=2,
                           max_new_tokens=6, seed=list(range(50)))
    ours = spectr.generate(target, head, [PROMPT] * 50, method="spectr", num_drafts=2, draft_length=2,
                           max_new_tokens=6, seed=list(range(50)))
    assert same.tokens == ours.tokens and same.stats.accepted_per_position == ours.stats.accepted_per_position


def test_our_saved_heads_load_back_identical(target, heads, tmp_path):
    for kind, head in heads.items():
        save_feature_draft(head, tmp_path / kind, dtype=torch.float32)
        assert feature_draft_kind(tmp_path / kind) == kind
        loaded = load_feature_draft(tmp_path / kind, target)
        for name, tensor in head.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_a_head_made_for_another_target_is_refused_naming_the_size(target, heads, tmp_path):
    save_feature_draft(heads[EAGLE3], tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden size 32 is not the target's 16"):
        load_feature_draft(tmp_path, target)
