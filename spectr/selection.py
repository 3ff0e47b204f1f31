"""Token-level draft selection: choose one token at one node of the draft tree.

A *node* is one prompt at one draft position: all drafts still alive there share the same
prefix, so they share one draft distribution p (`draft_probs`) and one target distribution
q (`target_probs`), and their next tokens are i.i.d. samples from p. A selection rule turns
those k draft tokens into one output token whose law is exactly q:

- an **accepted** token is one of the draft tokens, kept by a randomized test;
- a **correction** (recovered) token is drawn from a residual distribution when every
  draft at the node was rejected.

Methods share one signature and are looked up by name in `TOKEN_SELECTORS`:

- ``"speculative"``: speculative sampling, K = 1. Accept X ~ p with probability
  min(1, q(X)/p(X)), else sample norm(max(0, q - p)).
- ``"spectr"``: K-SEQ from SpecTr (Sun et al. 2023). rho* is the root in
  [1, k] of 1 - (1 - beta(rho))^k = rho * beta(rho) with beta(rho) = sum_x min(p(x), q(x)/rho),
  found by bisection keeping the upper (valid) end. Drafts are tested in sampling order, each
  accepted with probability min(1, q(X_i) / (rho* p(X_i))); if all are rejected the output is
  drawn from norm(max(0, q - rho* p)).
- ``"specinfer"``: SpecInfer's multi-round recursive rejection sampling with replacement:
  round i tests X_i against the current residual r (initially q) with probability
  min(1, r(X_i)/p(X_i)); a rejection replaces r by norm(max(0, r - p)).

Uniforms are float64, one row per node, `[N, K + 1]`: column j decides the test of draft j
(whether or not that draft is alive, so that a node's randomness does not depend on which
drafts died), column K drives the inverse-CDF draw of the correction token. A draft token
with p = 0 is accepted exactly when q > 0 (the ratio q/p is infinite) and never yields NaN.
A node with no alive draft samples straight from q.

The selectors read no device value on the host: every node runs the same fixed sequence of
tensor ops (rho* by a fixed number of bisection steps, the correction computed for every
node and kept where no draft passed), so they never stall an accelerator. Probabilities may
be float32 or float64; the tests against them are done in float64.

This module also holds the analysis functions of the contract: `kseq_rho`,
`kseq_acceptance`, `optimal_acceptance`. It is not the sequence-level loop over draft
positions (see `spectr.sequence`) and it does not draw drafts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from spectr.rng import sample_categorical
from spectr.validation import check_probabilities, check_shape, check_token_ids, check_uniforms

# Upper bound on the bisection steps for rho* (float64 inputs reach adjacent floats first).
_BISECTION_STEPS = 64

TokenSelector = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


# ---------------------------------------------------------------------------------------
# rho* and the acceptance functions (unchecked internals on [N, V])
# ---------------------------------------------------------------------------------------


def _beta(draft_probs: torch.Tensor, target_probs: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta(rho) = sum_x min(p(x), q(x)/rho); p, q [N, V], rho [N] -> [N] float64.

    Computed as (sum q - sum max(0, q - rho p)) / rho: one fused multiply-add, an in-place
    clamp and a sum over V, in the dtype of the inputs.
    """
    scale = rho.to(draft_probs.dtype).unsqueeze(-1)  # [N, 1]
    excess = torch.addcmul(target_probs, draft_probs, scale, value=-1.0).clamp_(min=0)  # [N, V]
    target_mass = target_probs.sum(-1).to(torch.float64)  # [N]
    return (target_mass - excess.sum(-1).to(torch.float64)) / rho


def _kseq_gap(beta: torch.Tensor, rho: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """f(rho) = 1 - (1 - beta)^k - rho * beta; >= 0 at rho = 1, <= 0 at rho = k, decreasing."""
    return 1.0 - (1.0 - beta).clamp(min=0.0).pow(num_drafts) - rho * beta


def bisection_steps(max_drafts: int, dtype: torch.dtype) -> int:
    """Fixed number of bisection halvings of [1, k] for rho*, from host ints only (no device read).

    The bracket starts k - 1 wide and must end as narrow as the input dtype resolves beta
    (relative 2 * eps, with hi >= 1): ceil(log2((k - 1) / (2 * eps))) steps.
    """
    if max_drafts <= 1:
        return 0
    resolution = 2.0 * torch.finfo(dtype).eps
    return min(_BISECTION_STEPS, math.ceil(math.log2((max_drafts - 1) / resolution)))


def _kseq_rho(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: torch.Tensor, max_drafts: int
) -> torch.Tensor:
    """rho* per node. draft_probs, target_probs [N, V]; num_drafts [N] int (<= max_drafts) -> [N] float64.

    Bisection on [1, k] keeping the upper end, where 1 - (1 - beta)^k <= rho * beta: there
    the accepted mass of every token stays below q, so the residual is a distribution. A fixed
    number of steps (`bisection_steps`), so no step reads a device value. Nodes with k <= 1 get
    rho* = 1 (K-SEQ is speculative sampling there).
    """
    k = num_drafts.to(torch.float64)  # [N]
    steps = bisection_steps(max_drafts, draft_probs.dtype)
    lo = torch.ones_like(k)  # [N] f(lo) >= 0
    hi = k.clamp(min=1.0)  # [N] f(hi) <= 0: the valid side
    if steps == 0:
        return torch.ones_like(k)
    # beta(mid) as in `_beta`, with one [N, V] buffer reused by every step.
    excess = torch.empty_like(target_probs)  # [N, V]
    target_mass = target_probs.sum(-1).to(torch.float64)  # [N]
    for _ in range(steps):
        mid = 0.5 * (lo + hi)  # [N]
        torch.addcmul(target_probs, draft_probs, mid.to(draft_probs.dtype).unsqueeze(-1), value=-1.0,
                      out=excess).clamp_(min=0)
        beta = (target_mass - excess.sum(-1).to(torch.float64)) / mid  # [N]
        above = _kseq_gap(beta, mid, k) > 0  # [N]
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return torch.where(num_drafts > 1, hi, 1.0)


def _max_count(num_drafts: torch.Tensor) -> int:
    """Largest draft count, read on the host (analysis functions only; the selectors know K)."""
    return int(num_drafts.max()) if num_drafts.numel() else 1


def _kseq_acceptance(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor:
    rho = _kseq_rho(draft_probs, target_probs, num_drafts, _max_count(num_drafts))  # [N]
    beta = _beta(draft_probs, target_probs, rho)  # [N]
    return 1.0 - (1.0 - beta).clamp(min=0.0).pow(num_drafts.to(torch.float64))


def _optimal_acceptance(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor:
    """alpha_K = min over prefixes A of the tokens sorted by q/p ascending of q(A) + 1 - p(A)^K."""
    p = draft_probs.to(torch.float64)  # [N, V]
    q = target_probs.to(torch.float64)  # [N, V]
    ratio = torch.where(p > 0, q / p.clamp(min=torch.finfo(torch.float64).tiny), torch.inf)  # [N, V]
    order = ratio.argsort(dim=-1, stable=True)  # [N, V]
    zero = torch.zeros_like(p[:, :1])  # [N, 1]
    p_prefix = torch.cat([zero, p.gather(-1, order).cumsum(-1)], -1).clamp(max=1.0)  # [N, V + 1]
    q_prefix = torch.cat([zero, q.gather(-1, order).cumsum(-1)], -1)  # [N, V + 1]
    k = num_drafts.to(torch.float64).unsqueeze(-1)  # [N, 1]
    value = q_prefix + 1.0 - p_prefix.pow(k)  # [N, V + 1]
    return value.min(-1).values.clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------
# Token selectors (unchecked internals; one shared signature)
# ---------------------------------------------------------------------------------------


def _sample_residual(
    draft_probs: torch.Tensor,  # [N, V]
    target_probs: torch.Tensor,  # [N, V]
    draft_scale: torch.Tensor,  # [N] float64: rho (0 for nodes with no alive draft)
    uniforms: torch.Tensor,  # [N] float64
) -> torch.Tensor:
    """Correction token from norm(max(0, q - scale * p)); from q where that mass is zero.

    (Zero residual mass has probability 0 when drafts really come from p, e.g. p == q.)
    """
    scale = draft_scale.to(target_probs.dtype).unsqueeze(-1)  # [N, 1]
    residual = torch.addcmul(target_probs, draft_probs, scale, value=-1.0).clamp_(min=0)  # [N, V]
    empty = residual.sum(-1, keepdim=True) <= 0  # [N, 1]
    return sample_categorical(torch.where(empty, target_probs, residual), uniforms)


def _test_in_order_then_correct(
    draft_tokens: torch.Tensor,  # [N, K]
    alive: torch.Tensor,  # [N, K] bool
    draft_probs: torch.Tensor,  # [N, V]
    target_probs: torch.Tensor,  # [N, V]
    uniforms: torch.Tensor,  # [N, K + 1] float64
    rho: torch.Tensor,  # [N] float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept alive draft j when u_j * rho * p(X_j) < q(X_j); the first accepted one wins."""
    num_drafts = draft_tokens.shape[1]
    draft_p = draft_probs.gather(1, draft_tokens).to(torch.float64)  # [N, K]
    draft_q = target_probs.gather(1, draft_tokens).to(torch.float64)  # [N, K]
    passes = alive & (uniforms[:, :num_drafts] * rho.unsqueeze(1) * draft_p < draft_q)  # [N, K]
    accepted = passes.any(1)  # [N]
    first = passes.to(torch.int8).argmax(1, keepdim=True)  # [N, 1] first passing draft
    scale = torch.where(alive.any(1), rho, 0.0)  # [N] no alive draft: sample q itself
    correction = _sample_residual(draft_probs, target_probs, scale, uniforms[:, num_drafts])  # [N]
    return torch.where(accepted, draft_tokens.gather(1, first).squeeze(1), correction), accepted


def select_speculative(draft_tokens, alive, draft_probs, target_probs, uniforms):
    """Speculative sampling (K = 1): K-SEQ with rho = 1 on the single draft."""
    if draft_tokens.shape[1] != 1:
        raise ValueError(
            f"method 'speculative' needs exactly one draft per node, got K = {draft_tokens.shape[1]}"
        )
    rho = torch.ones(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)  # [N]
    return _test_in_order_then_correct(draft_tokens, alive, draft_probs, target_probs, uniforms, rho)


def select_kseq(draft_tokens, alive, draft_probs, target_probs, uniforms):
    """K-SEQ: rho* per node for its alive count k (duplicates counted), drafts in sampling order."""
    rho = _kseq_rho(draft_probs, target_probs, alive.sum(1), draft_tokens.shape[1])  # [N]
    return _test_in_order_then_correct(draft_tokens, alive, draft_probs, target_probs, uniforms, rho)


def _specinfer_update(residual: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - p)) per node [N, V]; r itself where that is zero (r == p: a rejection of probability 0)."""
    leftover = (residual - draft_probs).clamp_(min=0)  # [N, V]
    mass = leftover.sum(-1, keepdim=True)  # [N, 1]
    return torch.where(mass > 0, leftover / mass.clamp(min=torch.finfo(mass.dtype).tiny), residual)


def select_specinfer(draft_tokens, alive, draft_probs, target_probs, uniforms):
    """SpecInfer recursive rejection sampling with replacement, drafts in sampling order.

    Every round updates every node's residual, kept only where that node's draft was tested
    and rejected, so the rounds run the same ops whatever the outcomes.
    """
    num_nodes, num_drafts = draft_tokens.shape
    residual = target_probs  # [N, V] current target of the next round (replaced, never written)
    accepted = torch.zeros(num_nodes, dtype=torch.bool, device=draft_tokens.device)  # [N]
    token = torch.zeros(num_nodes, dtype=torch.int64, device=draft_tokens.device)  # [N]
    for j in range(num_drafts):
        candidate = draft_tokens[:, j : j + 1]  # [N, 1]
        tested = alive[:, j] & ~accepted  # [N]
        draft_mass = draft_probs.gather(1, candidate).squeeze(1).to(torch.float64)  # [N]
        residual_mass = residual.gather(1, candidate).squeeze(1).to(torch.float64)  # [N]
        passes = tested & (uniforms[:, j] * draft_mass < residual_mass)  # [N]
        token = torch.where(passes, candidate.squeeze(1), token)
        accepted = accepted | passes
        rejected = (tested & ~passes).unsqueeze(1)  # [N, 1]
        residual = torch.where(rejected, _specinfer_update(residual, draft_probs), residual)
    correction = sample_categorical(residual, uniforms[:, num_drafts])  # [N]
    return torch.where(accepted, token, correction), accepted


TOKEN_SELECTORS: dict[str, TokenSelector] = {
    "speculative": select_speculative,
    "spectr": select_kseq,
    "specinfer": select_specinfer,
}


def get_token_selector(method: str) -> TokenSelector:
    """The selection rule registered under `method`; ValueError for an unknown name."""
    try:
        return TOKEN_SELECTORS[method]
    except (KeyError, TypeError):
        raise ValueError(f"unknown selection method {method!r}; known: {sorted(TOKEN_SELECTORS)}") from None


# ---------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------


def select_tokens(
    method: str,
    draft_tokens: torch.Tensor,  # [N, K] int64, in sampling order
    alive: torch.Tensor,  # [N, K] bool
    draft_probs: torch.Tensor,  # [N, V]
    target_probs: torch.Tensor,  # [N, V]
    uniforms: torch.Tensor,  # [N, K + 1] float64
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One output token per node and whether it is an accepted draft token.

    Returns (token [N] int64, accepted [N] bool). The token's law is exactly `target_probs`
    when the alive drafts of a node are i.i.d. samples from `draft_probs`.
    """
    selector = get_token_selector(method)
    if validate:
        _check_token_inputs(draft_tokens, alive, draft_probs, target_probs, uniforms)
    return selector(draft_tokens, alive, draft_probs, target_probs, uniforms)


def _check_token_inputs(draft_tokens, alive, draft_probs, target_probs, uniforms) -> None:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(
            f"draft_tokens must be a [N, K] tensor, got {getattr(draft_tokens, 'shape', type(draft_tokens))}"
        )
    num_nodes, num_drafts = draft_tokens.shape
    if num_drafts < 1:
        raise ValueError(f"draft_tokens must hold K >= 1 drafts per node, got K = {num_drafts}")
    if not isinstance(draft_probs, torch.Tensor) or draft_probs.dim() != 2:
        raise ValueError(
            f"draft_probs must be a [N, V] tensor, got {getattr(draft_probs, 'shape', type(draft_probs))}"
        )
    vocab_size = draft_probs.shape[1]
    check_shape("draft_probs", draft_probs, (num_nodes, vocab_size), "[N, V]")
    check_shape("target_probs", target_probs, (num_nodes, vocab_size), "[N, V] (same as draft_probs)")
    check_shape("alive", alive, (num_nodes, num_drafts), "[N, K]")
    if alive.dtype != torch.bool:
        raise ValueError(f"alive must be a bool tensor, got {alive.dtype}")
    check_shape("uniforms", uniforms, (num_nodes, num_drafts + 1), "[N, K + 1]")
    check_token_ids("draft_tokens", draft_tokens, vocab_size)
    check_probabilities("draft_probs", draft_probs)
    check_probabilities("target_probs", target_probs)
    check_uniforms("uniforms", uniforms)


def _flatten_analysis_inputs(draft_probs, target_probs, num_drafts):
    """Check the [..., V] pair and the draft count; return [N, V], [N, V], [N] and the batch shape."""
    check_probabilities("draft_probs", draft_probs)
    check_probabilities("target_probs", target_probs)
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)} but target_probs has {tuple(target_probs.shape)}; they must match"
        )
    batch_shape = draft_probs.shape[:-1]
    counts = torch.as_tensor(num_drafts, device=draft_probs.device)
    whole_floats = counts.is_floating_point() and bool((counts == counts.round()).all())
    if counts.dtype == torch.bool or counts.is_complex() or (counts.is_floating_point() and not whole_floats):
        raise ValueError(f"num_drafts must be integer, got {num_drafts!r}")
    counts = counts.to(torch.int64)
    if bool((counts < 1).any()):
        raise ValueError(f"num_drafts must be >= 1, got {counts.min().item()}")
    try:
        counts = torch.broadcast_to(counts, batch_shape)
    except RuntimeError:
        raise ValueError(
            f"num_drafts of shape {tuple(counts.shape)} does not broadcast to the batch shape {tuple(batch_shape)}"
        ) from None
    vocab_size = draft_probs.shape[-1]
    return (
        draft_probs.reshape(-1, vocab_size).to(torch.float64),
        target_probs.reshape(-1, vocab_size).to(torch.float64),
        counts.reshape(-1),
        batch_shape,
    )


def kseq_rho(draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts) -> torch.Tensor:
    """rho* of K-SEQ for [..., V] distributions and K drafts (int or tensor) -> [...] float64."""
    p, q, k, batch_shape = _flatten_analysis_inputs(draft_probs, target_probs, num_drafts)
    return _kseq_rho(p, q, k, _max_count(k)).reshape(batch_shape)


def kseq_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts) -> torch.Tensor:
    """Probability that K-SEQ accepts some draft: 1 - (1 - beta(rho*))^K -> [...] float64."""
    p, q, k, batch_shape = _flatten_analysis_inputs(draft_probs, target_probs, num_drafts)
    return _kseq_acceptance(p, q, k).reshape(batch_shape)


def optimal_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts) -> torch.Tensor:
    """alpha_K(p, q) = min over token subsets A of q(A) + 1 - p(A)^K -> [...] float64.

    The best acceptance any valid selection of one token from K i.i.d. drafts can reach.
    """
    p, q, k, batch_shape = _flatten_analysis_inputs(draft_probs, target_probs, num_drafts)
    return _optimal_acceptance(p, q, k).reshape(batch_shape)
