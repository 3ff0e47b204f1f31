"""vLLM's presence / frequency / repetition penalties and min_tokens (`spectr.penalties`), exact under every method.

- The definitions: `apply_penalties` equals vLLM's `apply_penalties` (written out below from vLLM's
  `vllm/model_executor/layers/utils.py`) on hand-made logits; min_tokens masks the stop tokens while fewer than
  min_tokens are generated; the settings' ranges are vLLM's. `tree_paths` gives each node of a hand-made tree
  its own draft ancestors.
- Greedy rows with penalties equal a slow reference loop (full forwards, vLLM's formulas) under every method.
- Exactness: rows with repetition, with frequency + presence, and with min_tokens (EOS inside the vocabulary,
  biased up so that its mask matters) follow the penalised target law: chi-square of the first 3 tokens against
  an enumeration that penalises every prefix with its own counts (as test_exactness_e2e), under autoregressive,
  speculative, block, spectr and traversal. Negative control: penalties counted on the committed tokens only
  (not the tree path) are rejected by the same test, for each of the three, under speculative, block and spectr.
- Cost: a pool without penalties builds no path; with penalties an iteration adds no host sync; a row without
  penalties gets the same tokens whether or not its neighbours have some.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model
from test_exactness_e2e import LENGTH, PROMPT, VOCAB, chi_square_pvalue

from spectr.api import generate
from spectr.batching import ContinuousBatcher
from spectr.diagnostics import HostSyncCounter
from spectr.generate import Generation
from spectr.penalties import NodePaths, RowPenalties, apply_penalties, min_tokens_mask, tree_paths
from spectr.tree import compact_nodes, prefix_leaders
from spectr.warps import SamplingWarp, dense_bias

ACCEPT_P = 1e-3
REJECT_P = 1e-6
SAMPLES = 3000
EOS = 5
WARPS = {
    "repetition": SamplingWarp(1.0, repetition_penalty=3.0),
    "frequency_presence": SamplingWarp(0.9, presence_penalty=1.5, frequency_penalty=1.0),
    "min_tokens": SamplingWarp(1.0, logit_bias=((EOS, 3.5),), min_tokens=2),
}
SLOW = pytest.mark.slow  # the default suite keeps speculative, block and spectr (and their controls), about 10 s
CASES = [pytest.param("autoregressive", 1, 1, marks=SLOW), ("speculative", 1, 2), ("block", 1, 3), ("spectr", 3, 2),
         pytest.param("traversal", 2, 2, marks=SLOW)]
CONTROLS = [("speculative", 1, 2), ("block", 1, 3), ("spectr", 3, 2)]


def vllm_apply_penalties(logits, prompt_tokens, output_tokens, presence, frequency, repetition):
    """vLLM's `apply_penalties` (bin counts over padded token tensors, then repetition, frequency, presence)."""
    num_seqs, vocab_size = logits.shape

    def bin_counts_and_mask(tokens):
        counts = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.long)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens))
        counts = counts[:, :vocab_size]
        return counts, counts > 0

    _, prompt_mask = bin_counts_and_mask(prompt_tokens)
    output_counts, output_mask = bin_counts_and_mask(output_tokens)
    penalties = torch.where(prompt_mask | output_mask, repetition.unsqueeze(1).repeat(1, vocab_size), 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * output_mask
    return logits


def test_apply_penalties_is_vllms_formula():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=generator) * 3  # [N, V]
    prompts = [[1, 2, 2], [0], [9, 9, 3], [4, 5]]
    outputs = [[2, 7, 7, 7], [], [3, 8], [5, 5, 1, 0]]
    presence = torch.tensor([0.5, 0.0, -1.0, 2.0])
    frequency = torch.tensor([0.3, 1.0, 0.0, -0.5])
    repetition = torch.tensor([1.7, 0.6, 1.0, 2.0])
    pad = 10  # vLLM pads with the vocabulary size
    padded = [torch.tensor([t + [pad] * (4 - len(t)) for t in rows]) for rows in (prompts, outputs)]
    expected = vllm_apply_penalties(logits, *padded, presence, frequency, repetition)
    counts = torch.stack([torch.bincount(torch.tensor(t, dtype=torch.int64), minlength=10) for t in outputs]).float()
    seen = torch.zeros(4, 10, dtype=torch.bool)
    for row, tokens in enumerate(prompts):
        seen[row, tokens] = True
    got = apply_penalties(logits, counts, seen, presence[:, None], frequency[:, None], repetition[:, None])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # by hand: token 7 of row 0 (3 times in the output) and token 1 (in the prompt only)
    x7, x1 = logits[0, 7].item(), logits[0, 1].item()
    assert got[0, 7].item() == pytest.approx((x7 / 1.7 if x7 > 0 else x7 * 1.7) - 0.3 * 3 - 0.5, abs=1e-6)
    assert got[0, 1].item() == pytest.approx(x1 / 1.7 if x1 > 0 else x1 * 1.7, abs=1e-6)
    assert got[1, 1:].tolist() == logits[1, 1:].tolist()  # row 1: no output, only token 0 (the prompt) changes
    x0 = logits[1, 0].item()
    assert got[1, 0].item() == pytest.approx(x0 / 0.6 if x0 > 0 else x0 * 0.6, abs=1e-6)
    # min_tokens: the stop tokens are -inf while fewer than min_tokens are generated
    stops = torch.zeros(10, dtype=torch.bool).index_fill_(0, torch.tensor([3, 9]), True)
    masked = min_tokens_mask(logits[0], stops, 1, 2)
    assert masked[[3, 9]].tolist() == [float("-inf")] * 2 and torch.equal(masked[:3], logits[0, :3])
    assert torch.equal(min_tokens_mask(logits[0], stops, 2, 2), logits[0])


def test_the_settings_ranges_are_vllms():
    for kwargs, name in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency"),
                         ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
                         ({"min_tokens": 1.5}, "min_tokens")):
        with pytest.raises(ValueError, match=name):
            SamplingWarp(**kwargs)
    assert not SamplingWarp(presence_penalty=0, repetition_penalty=1).path_dependent
    assert SamplingWarp(min_tokens=1).path_dependent
    with pytest.raises(ValueError, match="prompt 1: repetition_penalty"):
        generate(None, None, [[1], [2]], repetition_penalty=[1.0, -1.0])


def test_tree_paths_are_each_nodes_own_ancestors():
    tokens = torch.tensor([[[4, 1, 2], [4, 1, 3], [5, 6, 7]]])  # [1, K=3, L=3]: drafts 0 and 1 share "4 1"
    node_of, _ = compact_nodes(prefix_leaders(tokens))
    paths = tree_paths(tokens, node_of, 8)
    for k in range(3):
        for i in range(4):
            node = node_of[0, k, i].item()
            assert paths.depth[0, node].item() == i
            assert paths.tokens[0, node, :i].tolist() == tokens[0, k, :i].tolist()
    counts = RowPenalties(1, 8, "cpu")
    counts.set(torch.tensor([0]), [(0.0, 1.0, 1.0, 0)], [[0]], [[]])
    counts.commit(torch.tensor([0]), torch.tensor([[4, 4, 7]]), torch.tensor([2]))  # 2 of 3 kept: token 4 twice
    path_counts, generated = counts.path_state(paths, 1)  # [1, W, V], [1, W]
    node = node_of[0, 0, 2].item()  # "4 1"
    assert path_counts[0, node].tolist() == [0, 1, 0, 0, 3, 0, 0, 0] and generated[0, node].item() == 4


# --- exactness by enumeration ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5,
                        seed=1)
    draft = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5,
                       seed=2)
    return target, draft


@torch.inference_mode()
def penalised_joint_distribution(model, prompt, length, warp, stops=()) -> torch.Tensor:
    """P(first `length` tokens) by enumeration, every prefix penalised with its own counts: [V] * length, float64.

    vLLM's order: the logit bias, min_tokens (the stop tokens while fewer than min_tokens are generated), the
    penalties (the prompt and the prefix as the output), then temperature / min-p / top-k / top-p."""
    vocab = model.config.vocab_size
    plain = SamplingWarp(warp.temperature, warp.top_k, warp.top_p, warp.min_p)
    prompt_seen = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(prompt), True)
    stop_tokens = torch.zeros(vocab, dtype=torch.bool)
    stop_tokens[list(stops)] = True
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(length):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes])  # [V^depth, P + depth]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()  # [V^depth, V]
        logits = logits + dense_bias(warp.logit_bias, vocab, "cpu")
        logits = min_tokens_mask(logits, stop_tokens, depth, warp.min_tokens)
        counts = torch.stack([torch.bincount(torch.tensor(p, dtype=torch.int64), minlength=vocab)
                              for p in prefixes]).float()  # [V^depth, V] each prefix's own output counts
        logits = apply_penalties(logits, counts, prompt_seen, warp.presence_penalty, warp.frequency_penalty,
                                 warp.repetition_penalty)
        joint = joint.unsqueeze(-1) * plain.probs(logits).to(torch.float64).reshape([vocab] * (depth + 1))
    return joint


@pytest.fixture(scope="module")
def laws(pair):
    return {name: penalised_joint_distribution(pair[0], PROMPT, LENGTH, warp, (EOS,)).reshape(-1)
            for name, warp in WARPS.items()}


def sample(pair, method, num_drafts, draft_length, warp, samples=SAMPLES):
    """`samples` rows of PROMPT in one batcher, each with `warp`; their first LENGTH tokens. With min_tokens (= 2)
    EOS ends a row, so the third token may end it (never the first two)."""
    batcher = ContinuousBatcher(*pair, batch_size=samples, max_length=len(PROMPT) + LENGTH, method=method,
                                num_drafts=num_drafts, draft_length=draft_length,
                                eos_token_id=EOS if warp.min_tokens else None)
    batcher.admit([PROMPT] * samples, max_new_tokens=LENGTH, seed=list(range(samples)), warps=[warp] * samples)
    rows = sorted(batcher.finished(), key=lambda row: row.request)
    return [row.tokens for row in rows]


def test_the_enumeration_sees_the_penalties(laws, pair):
    """The laws differ from the unpenalised one, and min_tokens puts EOS (likely once allowed) third only."""
    plain = penalised_joint_distribution(pair[0], PROMPT, LENGTH, SamplingWarp(1.0, logit_bias=((EOS, 3.5),)))
    law = laws["min_tokens"].reshape([VOCAB] * LENGTH)
    assert law[EOS].sum() == 0 and law[:, EOS].sum() == 0 and law[:, :, EOS].sum() > 0.2
    assert plain[EOS].sum() > 0.2
    for name in ("repetition", "frequency_presence"):
        assert (laws[name] - penalised_joint_distribution(pair[0], PROMPT, LENGTH, SamplingWarp()).reshape(-1)
                ).abs().sum() > 0.3


@pytest.mark.parametrize("name", list(WARPS))
@pytest.mark.parametrize("method,num_drafts,draft_length", CASES)
def test_rows_with_penalties_follow_the_penalised_target_law(pair, laws, name, method, num_drafts, draft_length):
    tokens = sample(pair, method, num_drafts, draft_length, WARPS[name])
    assert chi_square_pvalue(tokens, laws[name]) > ACCEPT_P


@pytest.mark.parametrize("name", list(WARPS))
@pytest.mark.parametrize("method,num_drafts,draft_length", CONTROLS)
def test_negative_control_penalties_on_the_committed_tokens_only_are_rejected(pair, laws, name, method, num_drafts,
                                                                               draft_length, monkeypatch):
    """Every node counted as if it were the root (the committed tokens, depth 0): the draft and the verify agree,
    so the selection is still consistent, but the law is not the penalised one past the first token."""
    original = RowPenalties.path_state

    def committed_only(self, paths, rows):
        return original(self, NodePaths(paths.tokens[..., :0], 0), rows)

    monkeypatch.setattr(RowPenalties, "path_state", committed_only)
    samples = 2 * SAMPLES if method == "block" else SAMPLES  # block's miss is the smallest (repetition: p ~ 4e-5
    # at SAMPLES rows): twice the rows there, for a margin
    tokens = sample(pair, method, num_drafts, draft_length, WARPS[name], samples=samples)
    assert chi_square_pvalue(tokens, laws[name]) < REJECT_P


# --- greedy against a slow reference, cost --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair64():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11]]
ROW_SETTINGS = dict(repetition_penalty=[1.0, 2.0, 1.3], frequency_penalty=[0.5, 0.0, 0.8],
                    presence_penalty=[0.0, 0.5, 1.0], min_tokens=[0, 3, 6])


@torch.inference_mode()
def greedy_reference(target, prompt, steps, repetition, frequency, presence, min_tokens, stops):
    """Full forwards, one token at a time: argmax of vLLM's penalised logits (min_tokens masks the stops)."""
    output = []
    for _ in range(steps):
        logits = target(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0, -1:].float()
        if len(output) < min_tokens:
            logits[:, list(stops)] = float("-inf")
        pad = logits.shape[-1]
        logits = vllm_apply_penalties(logits, torch.tensor([prompt]), torch.tensor([output or [pad]]),
                                      torch.tensor([presence]), torch.tensor([frequency]), torch.tensor([repetition]))
        output.append(int(logits.argmax()))
        if output[-1] in stops:
            break
    return output


@pytest.mark.parametrize("method", ["autoregressive", pytest.param("speculative", marks=SLOW), "spectr",
                                    pytest.param("traversal", marks=SLOW)])
def test_greedy_rows_with_penalties_equal_a_slow_reference(pair64, method):
    out = generate(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3, max_new_tokens=10,
                          temperature=0.0, eos_token_id=[5, 6], seed=1, batch_size=2, **ROW_SETTINGS)
    for row, (prompt, tokens) in enumerate(zip(PROMPTS, out.tokens)):
        settings = [ROW_SETTINGS[key][row] for key in ("repetition_penalty", "frequency_penalty", "presence_penalty",
                                                       "min_tokens")]
        assert tokens == greedy_reference(pair64[0], prompt, 10, *settings, (5, 6)), row


@pytest.mark.parametrize("method", ["autoregressive", "spectr"])
def test_penalties_add_no_host_sync_and_leave_other_rows_alone(pair64, method):
    """A step reads the host at most as often as the engine's bound (+1 when rows retire); rows 0 and 2 without
    penalties get the same tokens as in a run where no row has any (neutral settings change no bit)."""
    bound = 1 if method == "autoregressive" else 2
    generation = Generation(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3, max_new_tokens=[12, 9, 14],
                            eos_token_id=[5, 6], seed=4, batch_size=2, repetition_penalty=[1.0, 1.5, 1.0],
                            frequency_penalty=[0.0, 0.5, 0.0], min_tokens=[0, 4, 0])
    per_step = []
    with torch.inference_mode():
        generation.start()
        while not generation.done:
            retired = len(generation.finished)
            with HostSyncCounter().inside_module(pair64[0]).inside_module(pair64[1]) as syncs:
                generation.step()
            per_step.append((syncs.total, len(generation.finished) - retired))
        generation.finish()
    assert all(syncs <= bound + (retired > 0) for syncs, retired in per_step), per_step
    assert generation.batcher.row_warps.penalties is not None
    plain = generate(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3, max_new_tokens=[12, 9, 14],
                            eos_token_id=[5, 6], seed=4, batch_size=2, top_p=[1.0] * 3)
    assert plain.tokens[0] == generation.tokens[0] and plain.tokens[2] == generation.tokens[2]
    assert plain.tokens[1] != generation.tokens[1]
