"""Adapter from Hugging Face causal LMs to the engine: the only `spectr` module that imports transformers.

`HFCausalLM` wraps an `AutoModelForCausalLM` and offers one operation, `forward`: run the
model on new tokens with *explicit* position ids and an explicit boolean attention pattern
over the row's cache slots, writing the new keys/values into a `spectr.kv_cache.RowKVCache`
at explicit slots. That is enough for a prefill, a plain decoding step, a draft-tree step and
the target's tree verification: the caller decides the positions and the mask, the model
just runs. The boolean pattern is turned into the additive 4D mask `[B, 1, T, S]` that HF
returns as-is from `create_causal_mask` (custom 4D masks bypass HF's own mask building).

Grouped-query attention: under "sdpa" with a mask, transformers repeats K/V to every query
head in every layer. The engine's forwards instead run `grouped_query_attention`
(registered with transformers' `AttentionInterface` as "spectr_sdpa" and switched on only
for the duration of each `forward` of a model loaded with "sdpa"): the query heads that share
a KV head are folded into the query axis, `[B, Hkv * G, T, D] -> [B, Hkv, G * T, D]`, with the
mask repeated G times along T, so each K/V head is read once and never copied. Models loaded
with "eager" run their own eager attention.

The adapter checks what it relies on and raises ValueError naming the model type otherwise:
a decoder-only model whose forward takes `position_ids`, a 4D `attention_mask` and a cache
object (`cache=` in transformers >= 5.x, `past_key_values=` before), with attention
implemented by "sdpa" or "eager" (flash/flex attention cannot take an arbitrary 4D mask),
and only full or sliding-window softmax attention layers (no SSM / linear-attention layers).

A model split over several devices (`spectr.split`: `hf_device_map` with several entries) runs the
same way: HF's forward crosses the devices through `spectr.split.dispatch`'s hooks, the cache keeps
one buffer per group of layers on its device, and the logits come back on the engine's device.

It is not a generation loop and holds no sampling logic.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from spectr import cpu_linear
from spectr.kv_cache import RowKVCache, RowView
from spectr.split import layer_groups, moved

MASKABLE_ATTENTION = ("sdpa", "eager")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


GROUPED_ATTENTION = "spectr_sdpa"


def grouped_query_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA for grouped-query attention without repeating K/V (HF attention-interface signature).

    query [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B, 1, T, S] additive (or None);
    returns (output [B, T, Hq, D], None), like `sdpa_attention_forward`. Falls back to it when
    there is nothing to fold (Hq == Hkv) or a feature it does not cover is asked for.
    """
    groups = query.shape[1] // key.shape[1]
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    unsupported = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    if groups == 1 or per_head_mask or unsupported or kwargs.get("output_attentions", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, query_heads, new, head_dim = query.shape
    kv_heads = key.shape[1]
    # Query head h * G + g uses KV head h (HF's repeat_kv order): fold g into the query axis.
    folded = query.reshape(batch, kv_heads, groups * new, head_dim)  # [B, Hkv, G*T, D]
    mask = None
    if attention_mask is not None:
        mask_batch, _, _, slots = attention_mask.shape
        mask = attention_mask[:, :, None].expand(mask_batch, 1, groups, new, slots).reshape(
            mask_batch, 1, groups * new, slots
        )  # [B, 1, G*T, S]
    output = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, Hkv, G*T, Dv]
    output = output.reshape(batch, query_heads, new, value.shape[-1])  # [B, Hq, T, Dv]
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_ATTENTION, grouped_query_attention)


class _RowSlotLayer(CacheLayerMixin):
    """One HF cache layer that stores into a shared `RowKVCache` at the declared slots."""

    is_sliding = False

    def __init__(self, rows: RowKVCache, layer_idx: int):
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):  # pragma: no cover - never lazy
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.rows.write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows._view_length, 0

    def get_seq_length(self) -> int:
        return self.rows._view_length

    def get_max_length(self) -> int:
        return self.rows.capacity


class HFRowCache(Cache):
    """An HF `Cache` whose layers live in `self.rows` (a `RowKVCache`); see spectr.kv_cache."""

    def __init__(self, rows: RowKVCache | RowView):
        super().__init__(layers=[_RowSlotLayer(rows, i) for i in range(rows.num_layers)])
        self.rows = rows

    def view(self, rows: torch.Tensor) -> HFRowCache:
        """The buffer rows `rows` ([R] int64) of this cache as an HF cache of R rows (no copy)."""
        return HFRowCache(self.rows.view(rows))

    def prefix(self, count: int) -> HFRowCache:
        """Rows [0, count) of this cache as an HF cache of their own over the same storage (no copy)."""
        return HFRowCache(self.rows.prefix(count))


class HFCausalLM:
    """A Hugging Face causal LM as the engine sees it: vocabulary, device, positions, `forward`."""

    def __init__(self, model: torch.nn.Module, role: str = "model"):
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{role} must be a Hugging Face PreTrainedModel (AutoModelForCausalLM), got {type(model).__name__}")
        self.model = model
        self.role = role
        self.config = config
        self.model_type = getattr(config, "model_type", type(model).__name__)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._check_supported(model, text_config)
        self.num_layers = int(text_config.num_hidden_layers)
        # contiguous runs of layers on one device (one group unless the model is split: spectr.split)
        self.groups = layer_groups(model, self.num_layers)
        output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if output_embeddings is not None and getattr(output_embeddings, "weight", None) is not None:
            self.vocab_size = int(output_embeddings.weight.shape[0])
        else:
            self.vocab_size = int(text_config.vocab_size)
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        self.sliding_window = None
        layer_types = getattr(text_config, "layer_types", None)
        window = getattr(text_config, "sliding_window", None)
        if window is not None and (layer_types is None or "sliding_attention" in layer_types):
            self.sliding_window = int(window)
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        self.name = getattr(config, "_name_or_path", "") or type(model).__name__
        if self.device.type == "cpu":  # float32 linears over a few rows: one pass over the weights
            cpu_linear.install(model)
        self.tap = None  # a feature draft's `spectr.feature_draft.FeatureTap` on this model's forwards
        # The configs whose attention implementation the engine's forwards switch to the grouped one.
        self._attention_configs = [c for c in {id(config): config, id(text_config): text_config}.values()
                                   if getattr(c, "_attn_implementation", None) == "sdpa"]

    @property
    def description(self) -> str:
        """'<role> model <name> (<model type>)', for error messages."""
        return f"{self.role} model {self.name} ({self.model_type})"

    def _check_supported(self, model: torch.nn.Module, text_config) -> None:
        what = f"{self.role} model type '{self.model_type}'"
        if getattr(self.config, "is_encoder_decoder", False):
            raise ValueError(f"{what} is an encoder-decoder model; spectr.generate needs a decoder-only causal LM")
        parameters = inspect.signature(model.forward).parameters
        missing = [name for name in ("attention_mask", "position_ids") if name not in parameters]
        if "cache" not in parameters and "past_key_values" not in parameters:
            missing.append("cache/past_key_values")
        if missing:
            raise ValueError(
                f"{what} cannot take the engine's tree attention: its forward has no {', '.join(missing)} "
                "argument (a 4D attention mask with explicit position ids over a KV cache is required)"
            )
        attention = getattr(self.config, "_attn_implementation", None) or "eager"
        if attention not in MASKABLE_ATTENTION:
            raise ValueError(
                f"{what} uses attention implementation '{attention}', which cannot take the custom 4D tree "
                f"attention mask; load it with attn_implementation='sdpa' or 'eager'"
            )
        layer_types = getattr(text_config, "layer_types", None) or []
        unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ValueError(
                f"{what} has layer types {unsupported}; only softmax attention layers "
                f"{list(SUPPORTED_LAYER_TYPES)} can take the custom 4D tree attention mask"
            )
        if not hasattr(text_config, "num_hidden_layers"):
            raise ValueError(f"{what}: config has no num_hidden_layers, cannot size its KV cache")

    def new_cache(self, batch_size: int, capacity: int) -> HFRowCache:
        """An empty per-row KV cache for this model with room for `capacity` slots per row."""
        return HFRowCache(RowKVCache(self.num_layers, batch_size, capacity, self.device, self.groups))

    def additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """[B, T, S] bool (True = may attend) -> [B, 1, T, S] additive mask in the model's dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.unsqueeze(1)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        cache: HFRowCache,
        write_slots: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for new tokens written at `write_slots`, attending the slots `allowed` marks.

        input_ids, position_ids, write_slots: [B, T] int64; allowed: [B, T, S] bool where S is the
        attended prefix of the cache (it must include each token's own slot).
        Returns logits [B, T, V] (or [B, 1, V] for the last token only with `last_only`).
        """
        cache.rows.begin_forward(write_slots, allowed.shape[-1])
        if self.max_positions is not None:
            # Positions past the model's range only ever belong to tokens that are discarded
            # (beyond max_new_tokens; prompt + max_new_tokens <= max positions is validated).
            position_ids = position_ids.clamp(max=self.max_positions - 1)
        kwargs = {self._cache_kwarg: cache}
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        saved = [c._attn_implementation_internal for c in self._attention_configs]
        try:
            for c in self._attention_configs:
                c._attn_implementation_internal = GROUPED_ATTENTION
            with cpu_linear.active():
                output = self.model(
                    input_ids=input_ids,
                    attention_mask=self.additive_mask(allowed),
                    position_ids=position_ids,
                    use_cache=True,
                    **kwargs,
                )
        finally:
            for c, implementation in zip(self._attention_configs, saved):
                c._attn_implementation_internal = implementation
        logits = moved(output.logits, self.device)  # a split model's head may sit on another device
        if last_only:
            logits = logits[:, -1:]
        return logits

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain HF forward without any cache over unpadded rows [B, T] -> logits [B, T, V] (for tests)."""
        return self.model(input_ids=input_ids, use_cache=False).logits
