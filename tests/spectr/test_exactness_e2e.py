"""End-to-end exactness of spectr.generate on real (tiny, random) HF Llama models with V = 8.

The exact law of the first 3 generated tokens is computed by enumerating the warped target
model over all 8^3 continuations (cache-free full forwards). The engine then generates 3
tokens for thousands of copies of the same prompt in ONE batched call (row i has seed i),
and a chi-square test compares the joint counts with the exact law. Cells with an expected
count below 5 are pooled; a sample in a cell of exact probability 0 fails outright.

The same test runs on bfloat16 copies of the models, against the bf16 target's own law
(enumerated with bf16 full forwards): the engine's selection math stays in float32/float64
and every draft token is drawn from the row the selection reads (spectr.tree), so the
output is the bf16 model's law; the skip-residual control is rejected there too.

Rows admitted mid-run: the same tests run with `batch_size` far below the number of rows and
budgets of 3 to 6 tokens, so rows finish at different iterations and the waiting copies take
their slots (prefilled alone, joining a batch already under way); the chi-square reads each
row's first 3 tokens. The negative controls are rejected in that mode too.

Negative controls, which the same test must reject:
- a selection rule that skips the residual (a rejected draft is replaced by a fresh sample
  from q instead of norm(max(0, q - p))), injected through the method registry;
- a commit that forgets to gather the accepted path in the KV caches (keep_path no-op);
- block verification with h_i = w_i at every i (token verification's stopping with block
  residuals), registered as a sequence-level rule.

Switching: one run whose iterations cycle through autoregressive, spectr, speculative, block
and specinfer with different K and L (rows admitted at every phase of the cycle, so a row's first
tokens come from every combination, and the draft cache catches up after autoregressive
iterations) follows the same law; a commit without path gather and a skip-residual rule inside
the cycle are rejected.

Compiled mode (`compile=True`: `spectr.native`'s forward under torch.compile, fullgraph, dynamic
shapes): rows admitted mid-run follow the same law, and the commit without path gather is rejected
there too; with `SELECTION_RULE = "all"` the K-draft selection itself runs compiled (K-SEQ follows the
target; K-SEQ with rho = 1 for every draft is rejected). In the default suite the graphs are traced by dynamo and run as traced (a counting
backend: the compiled path's shapes, slicing and cache writes, without inductor's minutes of
kernel compilation on this CPU); the slow variants compile with inductor.

The default suite runs a representative subset; the full grid (every method, K in {1, 3},
L in {1, 2, 4}, with and without temperature/top-k/top-p) is marked slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import exact_joint_distribution
from scipy.stats import chi2
from torch._dynamo.testing import CompileCounter

import spectr
import spectr.native as native
import spectr.selection as selection
from spectr.batching import ContinuousBatcher
from spectr.block import block_rule
from spectr.kv_cache import RowKVCache
from spectr.rng import sample_categorical
from spectr.sequence import SEQUENCE_RULES
from spectr.steps import StepConfig
from spectr.warps import SamplingWarp

VOCAB = 8
PROMPT = [1, 2, 3]
LENGTH = 3
ACCEPT_P = 1e-3  # a correct engine must not be rejected at this level (seeds are fixed: deterministic)
REJECT_P = 1e-6  # a broken engine must be rejected at least this strongly
WARPS = {"plain": (1.0, 0, 1.0), "warped": (0.8, 5, 0.85)}


@pytest.fixture(scope="module")
def pair(e2e_pair):
    """Peaked, context-dependent random models, so acceptance is far from 0 and from 1 (conftest)."""
    assert e2e_pair[0].config.vocab_size == VOCAB
    return e2e_pair


@pytest.fixture(scope="module")
def pair_bf16(pair):
    return tuple(copy.deepcopy(m).to(torch.bfloat16) for m in pair)


@pytest.fixture(scope="module")
def exact_law_bf16(pair_bf16):
    """The bf16 target's own law of the first 3 tokens (bf16 full forwards, warps in float32)."""
    return exact_joint_distribution(pair_bf16[0], PROMPT, LENGTH, SamplingWarp(*WARPS["warped"])).reshape(-1)


@pytest.fixture(scope="module")
def exact_laws(pair):
    target, _ = pair
    return {
        name: exact_joint_distribution(target, PROMPT, LENGTH, SamplingWarp(*w)).reshape(-1)
        for name, w in WARPS.items()
    }


def chi_square_pvalue(tokens: list[list[int]], exact: torch.Tensor) -> float:
    """p-value of the joint counts of the first 3 tokens against `exact` ([V^3] float64)."""
    samples = torch.tensor(tokens)  # [N, 3]
    assert samples.shape[1] == LENGTH
    codes = (samples[:, 0] * VOCAB + samples[:, 1]) * VOCAB + samples[:, 2]
    counts = torch.bincount(codes, minlength=VOCAB**LENGTH).to(torch.float64)
    if counts[exact == 0].sum() > 0:
        return 0.0  # a continuation the warped target can never produce
    expected = exact * samples.shape[0]
    large = expected >= 5
    observed = [counts[large]]
    expected_cells = [expected[large]]
    if expected[~large].sum() > 0:
        observed.append(counts[~large].sum().reshape(1))
        expected_cells.append(expected[~large].sum().reshape(1))
    observed, expected_cells = torch.cat(observed), torch.cat(expected_cells)
    statistic = float(((observed - expected_cells) ** 2 / expected_cells).sum())
    return float(chi2.sf(statistic, len(observed) - 1))


MID_RUN_BATCH = 400  # rows in flight when rows are admitted mid-run
MID_RUN_BUDGETS = (3, 5, 4, 6)


def run(pair, method, num_drafts, draft_length, warp_name, num_samples, batch_size=None, compile=False):
    """num_samples copies of PROMPT, row i seeded i; with batch_size, budgets cycle through
    MID_RUN_BUDGETS and the returned tokens are each row's first 3."""
    target, draft = pair
    temperature, top_k, top_p = WARPS[warp_name]
    budgets = LENGTH if batch_size is None else [MID_RUN_BUDGETS[i % 4] for i in range(num_samples)]
    out = spectr.generate(
        target,
        draft,
        [PROMPT] * num_samples,
        method=method,
        num_drafts=num_drafts,
        draft_length=draft_length,
        max_new_tokens=budgets,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=list(range(num_samples)),
        batch_size=batch_size,
        compile=compile,
    )
    assert out.stats.compiled == bool(compile)
    if batch_size is not None:
        assert out.stats.admissions > num_samples // batch_size  # slots were refilled mid-run
        assert [len(t) for t in out.tokens] == budgets
        out.tokens = [t[:LENGTH] for t in out.tokens]
    assert all(len(t) == LENGTH for t in out.tokens)
    return out


DEFAULT_CASES = [
    ("autoregressive", 1, 1, "warped"),
    ("speculative", 1, 2, "plain"),
    ("spectr", 3, 1, "plain"),
    ("spectr", 3, 4, "warped"),
    ("specinfer", 3, 2, "warped"),
    ("block", 1, 3, "warped"),
]
FULL_GRID = [
    (method, k, length, warp)
    for method, ks in (("speculative", (1,)), ("spectr", (1, 3)), ("specinfer", (1, 3)), ("block", (1,)))
    for k in ks
    for length in (1, 2, 4)
    for warp in WARPS
]


@pytest.mark.parametrize("method,num_drafts,draft_length,warp", DEFAULT_CASES)
def test_first_three_tokens_follow_the_target(pair, exact_laws, method, num_drafts, draft_length, warp):
    out = run(pair, method, num_drafts, draft_length, warp, 6000)
    if method != "autoregressive":  # the drafts really were tested and sometimes rejected
        assert 0.05 < out.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) > ACCEPT_P


@pytest.mark.slow
@pytest.mark.parametrize("method,num_drafts,draft_length,warp", FULL_GRID)
def test_full_grid_first_three_tokens_follow_the_target(
    pair, exact_laws, method, num_drafts, draft_length, warp
):
    out = run(pair, method, num_drafts, draft_length, warp, 20000)
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) > ACCEPT_P


MID_RUN_CASES = [
    ("autoregressive", 1, 1, "warped"),
    ("speculative", 1, 2, "plain"),
    ("spectr", 3, 4, "warped"),
    ("specinfer", 3, 2, "plain"),
    ("block", 1, 3, "warped"),
]


@pytest.mark.parametrize("method,num_drafts,draft_length,warp", MID_RUN_CASES)
def test_rows_admitted_mid_run_follow_the_target(pair, exact_laws, method, num_drafts, draft_length, warp):
    out = run(pair, method, num_drafts, draft_length, warp, 6000, batch_size=MID_RUN_BATCH)
    if method != "autoregressive":
        assert 0.05 < out.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) > ACCEPT_P


def _skip_residual(draft_tokens, alive, draft_probs, target_probs, uniforms):
    """Broken speculative sampling: on rejection sample q itself instead of the residual."""
    token, accepted = selection.select_speculative(draft_tokens, alive, draft_probs, target_probs, uniforms)
    from_q = sample_categorical(target_probs, uniforms[:, -1])
    return torch.where(accepted, token, from_q), accepted


@pytest.mark.parametrize("warp", ["plain", "warped"])
def test_negative_control_skipping_the_residual_is_rejected(pair, exact_laws, monkeypatch, warp):
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "skip_residual", _skip_residual)
    out = run(pair, "skip_residual", 1, 2, warp, 6000)
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) < REJECT_P


@pytest.mark.parametrize("warp", ["plain", "warped"])
def test_negative_control_block_with_token_stops_is_rejected(pair, exact_laws, monkeypatch, warp):
    monkeypatch.setitem(SEQUENCE_RULES, "block_token_stops", block_rule(lambda weights, excess: weights))
    out = run(pair, "block_token_stops", 1, 3, warp, 6000)
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) < REJECT_P


@pytest.mark.parametrize("batch_size", [None, MID_RUN_BATCH], ids=["all at once", "admitted mid-run"])
def test_negative_control_a_commit_without_path_gather_is_rejected(pair, exact_laws, monkeypatch, batch_size):
    # Without keep_path the caches keep draft 0's entries even when another draft was accepted.
    monkeypatch.setattr(RowKVCache, "keep_path", lambda self, source, dest, rows=None: None)
    out = run(pair, "spectr", 3, 1, "plain", 6000, batch_size=batch_size)
    assert chi_square_pvalue(out.tokens, exact_laws["plain"]) < REJECT_P


def test_negative_control_skipping_the_residual_is_rejected_mid_run(pair, exact_laws, monkeypatch):
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "skip_residual", _skip_residual)
    out = run(pair, "skip_residual", 1, 2, "warped", 6000, batch_size=MID_RUN_BATCH)
    assert chi_square_pvalue(out.tokens, exact_laws["warped"]) < REJECT_P


def test_negative_control_a_prefill_into_the_wrong_slot_is_rejected_mid_run(pair, exact_laws, monkeypatch):
    """Rows admitted mid-run must be prefilled into their own slot: writing the prompt's keys one
    slot off (into another row's cache) breaks the output law, and the test sees it."""
    import spectr.rows as rows_module

    prefill = rows_module.prefill

    def off_by_one(model, cache, prompts, device, rows=None, **kwargs):
        if rows is not None and cache.rows.batch_size > 1 and len(prompts) < cache.rows.batch_size:
            rows = (rows + 1) % cache.rows.batch_size
        return prefill(model, cache, prompts, device, rows, **kwargs)

    monkeypatch.setattr("spectr.batching.prefill", off_by_one)
    out = run(pair, "spectr", 3, 2, "plain", 6000, batch_size=MID_RUN_BATCH)
    assert chi_square_pvalue(out.tokens, exact_laws["plain"]) < REJECT_P


# --- per-iteration configurations: one run switches method, K and L every iteration or two -----------

SWITCHING = [StepConfig.of("autoregressive"), StepConfig.of("autoregressive"), StepConfig.of("spectr", 3, 2),
             StepConfig.of("speculative", 1, 1), StepConfig.of("autoregressive"), StepConfig.of("block", 1, 3),
             StepConfig.of("specinfer", 2, 2), StepConfig.of("spectr", 2, 4)]


def run_switching(pair, schedule, warp_name, num_samples, batch_size=MID_RUN_BATCH):
    """num_samples copies of PROMPT through one ContinuousBatcher (bounds K <= 3, L <= 4) whose iteration i
    runs schedule[i % len(schedule)]; budgets cycle through MID_RUN_BUDGETS, so rows are admitted mid-run
    at every phase of the schedule. Returns each row's first 3 tokens and the batcher."""
    target, draft = pair
    temperature, top_k, top_p = WARPS[warp_name]
    batcher = ContinuousBatcher(target, draft, batch_size=batch_size, max_length=len(PROMPT) + 6,
                                method="autoregressive", max_num_drafts=3, max_draft_length=4,
                                temperature=temperature, top_k=top_k, top_p=top_p)
    budgets = [MID_RUN_BUDGETS[i % 4] for i in range(num_samples)]
    batcher.admit([PROMPT] * num_samples, max_new_tokens=budgets, seed=list(range(num_samples)))
    rows, iteration = {}, 0
    while not batcher.idle:
        for row in batcher.step(schedule[iteration % len(schedule)]):
            rows[row.request] = row
        iteration += 1
    assert [len(rows[i].tokens) for i in range(num_samples)] == budgets
    assert batcher.stats.draft_catch_ups > 0 and batcher.stats.admissions > num_samples // batch_size
    for row in rows.values():
        batcher.stats.add_row(row)
    return [rows[i].tokens[:LENGTH] for i in range(num_samples)], batcher


@pytest.mark.parametrize("warp", ["plain", "warped"])
def test_a_run_switching_method_k_and_l_every_iteration_follows_the_target(pair, exact_laws, warp):
    tokens, batcher = run_switching(pair, SWITCHING, warp, 6000)
    assert 0.05 < batcher.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(tokens, exact_laws[warp]) > ACCEPT_P


def test_negative_control_switching_with_a_commit_without_path_gather_is_rejected(pair, exact_laws, monkeypatch):
    monkeypatch.setattr(RowKVCache, "keep_path", lambda self, source, dest, rows=None: None)
    several_drafts = [StepConfig.of("autoregressive"), StepConfig.of("spectr", 3, 1), StepConfig.of("specinfer", 3, 2),
                      StepConfig.of("autoregressive"), StepConfig.of("spectr", 2, 1)]  # the path gather matters
    tokens, _ = run_switching(pair, several_drafts, "plain", 6000)
    assert chi_square_pvalue(tokens, exact_laws["plain"]) < REJECT_P


def test_negative_control_switching_through_a_rule_that_skips_the_residual_is_rejected(pair, exact_laws,
                                                                                         monkeypatch):
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "skip_residual", _skip_residual)
    broken = [StepConfig.of("autoregressive"), StepConfig("skip_residual", 1, 2), StepConfig("skip_residual", 1, 1),
              StepConfig.of("autoregressive"), StepConfig("skip_residual", 1, 3)]
    tokens, _ = run_switching(pair, broken, "warped", 6000)
    assert chi_square_pvalue(tokens, exact_laws["warped"]) < REJECT_P


def test_bfloat16_models_follow_their_own_law(pair_bf16, exact_law_bf16):
    out = run(pair_bf16, "spectr", 3, 4, "warped", 6000)
    assert 0.05 < out.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(out.tokens, exact_law_bf16) > ACCEPT_P


def test_bfloat16_negative_control_skipping_the_residual_is_rejected(pair_bf16, exact_law_bf16, monkeypatch):
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "skip_residual", _skip_residual)
    out = run(pair_bf16, "skip_residual", 1, 2, "warped", 6000)
    assert chi_square_pvalue(out.tokens, exact_law_bf16) < REJECT_P


# --- compiled mode ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_graphs():
    """Compiled cores traced by dynamo (fullgraph, dynamic shapes) and run as traced, counting the graphs."""
    with pytest.MonkeyPatch.context() as patch:
        counter = CompileCounter()
        patch.setattr(native, "COMPILE_BACKEND", counter)
        yield counter
    torch._dynamo.reset()


@pytest.mark.slow  # 14 s; test_compiled_k_draft_selection_follows_the_target keeps a compiled chi-square in the default suite
def test_compiled_mode_rows_admitted_mid_run_follow_the_target(pair, exact_laws, traced_graphs):
    out = run(pair, "spectr", 3, 2, "warped", 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert traced_graphs.frame_count > 0
    assert 0.05 < out.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(out.tokens, exact_laws["warped"]) > ACCEPT_P


@pytest.mark.slow  # 9 s; the compiled K-draft chi-square and its control stay in the default suite
def test_compiled_mode_negative_control_a_commit_without_path_gather_is_rejected(pair, exact_laws, traced_graphs,
                                                                                  monkeypatch):
    monkeypatch.setattr(RowKVCache, "keep_path", lambda self, source, dest, rows=None: None)
    out = run(pair, "spectr", 3, 1, "plain", 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert chi_square_pvalue(out.tokens, exact_laws["plain"]) < REJECT_P


@pytest.mark.slow
@pytest.mark.parametrize("method,num_drafts,draft_length,warp", MID_RUN_CASES)
def test_inductor_compiled_rows_admitted_mid_run_follow_the_target(pair, exact_laws, monkeypatch, method, num_drafts,
                                                                   draft_length, warp):
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")  # whatever a module fixture set
    out = run(pair, method, num_drafts, draft_length, warp, 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert chi_square_pvalue(out.tokens, exact_laws[warp]) > ACCEPT_P


@pytest.mark.slow
def test_inductor_compiled_negative_control_skipping_the_residual_is_rejected(pair, exact_laws, monkeypatch):
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "skip_residual", _skip_residual)
    out = run(pair, "skip_residual", 1, 2, "warped", 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert chi_square_pvalue(out.tokens, exact_laws["warped"]) < REJECT_P


def _kseq_rho_one(draft_tokens, alive, draft_probs, target_probs, uniforms):
    """Broken K-SEQ: every alive draft tested with rho = 1 (each at min(1, q/p)), as if it were the only one."""
    rho = torch.ones(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)
    return selection._test_in_order_then_correct(draft_tokens, alive, draft_probs, target_probs, uniforms, rho)


def test_compiled_k_draft_selection_follows_the_target(pair, exact_laws, traced_graphs, monkeypatch):
    """SELECTION_RULE "all": K-SEQ's token rule itself runs compiled (on the CPU it stays eager by default)."""
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 0)  # every iteration's selection compiled
    out = run(pair, "spectr", 3, 2, "warped", 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert ("token", "spectr") in {key[:2] for key in native._SELECTION if key[-1] is traced_graphs}
    assert chi_square_pvalue(out.tokens, exact_laws["warped"]) > ACCEPT_P


def test_compiled_k_draft_selection_negative_control_rho_one_is_rejected(pair, exact_laws, traced_graphs,
                                                                         monkeypatch):
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 0)  # every iteration's selection compiled
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "kseq_rho_one", _kseq_rho_one)
    out = run(pair, "kseq_rho_one", 3, 2, "warped", 6000, batch_size=MID_RUN_BATCH, compile=True)
    assert ("token", "kseq_rho_one") in {key[:2] for key in native._SELECTION if key[-1] is traced_graphs}
    assert chi_square_pvalue(out.tokens, exact_laws["warped"]) < REJECT_P
