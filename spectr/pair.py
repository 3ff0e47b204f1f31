"""The engine's view of a draft/target pair: each HF model wrapped (eager, native-compilable, or a feature
draft bound to its target), and the checks that the two are one pair (vocabulary, device).

Not here: the cache pool and the rows (`spectr.batching`), the compiled forward itself (`spectr.native`).
"""

from __future__ import annotations

from collections.abc import Sequence

from spectr.feature_draft import FeatureDraftLM, FeatureTap
from spectr.hf import HFCausalLM
from spectr.native import NativeCausalLM, native_supported
from spectr.sequence import sequence_methods
from spectr.settings import AUTOREGRESSIVE, Settings


def known_methods() -> list[str]:
    """The concrete methods (`spectr.generate(method="auto")` picks among them per iteration)."""
    return [AUTOREGRESSIVE, *sequence_methods()]


def wrap_model(model, role: str, native: bool = False) -> HFCausalLM:
    """The engine's view of an HF model: `NativeCausalLM` (compilable) when `native` and the model is of
    the Llama / Qwen2 family (`spectr.native`), else `HFCausalLM` (eager HF forward); a feature draft's
    `FeatureDraftLM` (unbound: its vocabulary and limits only)."""
    if getattr(model, "is_feature_draft", False):
        return FeatureDraftLM(model, role=role)
    if native and native_supported(model) is None:
        return NativeCausalLM(model, role=role)
    return HFCausalLM(model, role=role)


def load_models(target, draft, settings: Settings, speculative: bool | None = None,
                native: bool = False) -> tuple[HFCausalLM, HFCausalLM | None]:
    """Wrap the pair and check that it is one: vocabulary, device. The draft is kept when some
    iteration may speculate (`speculative`, default: the settings' method is speculative).
    native: wrap Llama / Qwen2 models as `NativeCausalLM` (so that they may be compiled)."""
    feature = getattr(draft, "is_feature_draft", False)
    # a feature draft reads the target's hidden states from HF's forward (hooks): the target runs eagerly
    target_lm = wrap_model(target, "target", native and not feature)
    if not (settings.speculative if speculative is None else speculative):
        return target_lm, None
    if draft is None:
        raise ValueError(f"method {settings.method!r} needs a draft model; got draft=None")
    if feature:
        draft_lm = FeatureDraftLM(draft.bind(target))
        target_lm.tap = feature_tap(target, draft.config.feature_layers)
    else:
        draft_lm = wrap_model(draft, "draft", native)
    if draft_lm.vocab_size != target_lm.vocab_size:
        raise ValueError(
            f"target and draft must share a vocabulary: target vocab size {target_lm.vocab_size} "
            f"({target_lm.model_type}), draft vocab size {draft_lm.vocab_size} ({draft_lm.model_type})"
        )
    if draft_lm.device != target_lm.device:
        raise ValueError(
            f"target and draft must be on the same device: target on {target_lm.device}, draft on {draft_lm.device}"
        )
    return target_lm, draft_lm


def feature_tap(target, layers: list[int]) -> FeatureTap:
    """The target's feature tap for these layers, installed once per model (kept on the model, so that
    batchers over the same target share its hooks instead of stacking them)."""
    tap = getattr(target, "_spectr_feature_tap", None)
    if tap is not None and tap.layers == list(layers):
        return tap
    if tap is not None:
        tap.close()
    tap = FeatureTap(target, layers)
    target._spectr_feature_tap = tap
    return tap


def model_limit(models: Sequence[HFCausalLM]) -> int | None:
    """The longest sequence every model can take (positions, sliding window), None if unbounded."""
    limits = [limit for m in models for limit in (m.max_positions, m.sliding_window) if limit is not None]
    return min(limits) if limits else None
