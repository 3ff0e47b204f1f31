"""The compiled engine's model: a native forward of the Llama / Qwen2 family over the engine's KV cache.

`NativeCausalLM` is an `spectr.hf.HFCausalLM` (same vocabulary, device, cache, checks) whose
`forward` has the same contract (explicit position ids, a boolean pattern over the cache slots,
the new keys/values written into the `spectr.kv_cache.RowKVCache` at explicit slots, logits
back) but runs `NativeCore`: a compact functional decoder over the HF model's own modules (its
embedding, norms, projections, MLPs and head: the same parameters, no copy), with attention
written out for the engine's layout. The core is a pure function of its inputs:

    core(slots [3, B, T] (input ids, positions, write slots), pools (per group of layers, the cache
         buffer [layers in g, 2, P, Hkv, C, D]; rows [0, B) and slots [0, S) are attended),
         allowed [B, T, S] bool) -> logits [B, T, V], new_kv (per group [layers in g, 2, B, Hkv, T, D])

A model on one device is one group: one pool, one new_kv, exactly the single-buffer core. A model
split over devices (`spectr.split`) has one group per contiguous run of layers on a device: the
core itself moves the hidden state, rotary cos/sin and masks to the next group's device at each
group boundary (one `.to` per group, a no-op on one device; the split's forward hooks sit on the
decoder layers themselves, which the core does not call), runs the head on its own device and
returns the logits on the engine's device (the embedding's). The new keys/values of a group stay on
its device and are scattered into its buffer there.

The new tokens' own keys attend through a [B, T, T] pattern read from `allowed` at their write
slots (those slots of the view are stale this forward and masked); per layer the scores over the
cache view and over the new tokens are joined before one float32 softmax, so nothing is copied
or concatenated along the cache. The wrapper then scatters `new_kv` into the buffer in one op for
every layer of a group (one op per device). Compiled, the attention may instead be FlexAttention over a
block mask of the same pattern (`ATTENTION = "flex"`; refused on the CPU under inductor, see there). Grouped-query attention folds the G query heads of a KV head into the query axis, as
`spectr.hf.grouped_query_attention` does: each K/V head is read once.

Compilation (`compiled=True`): the core goes through `torch.compile(fullgraph=True)` (no graph
breaks, no host sync inside). On the CPU the rows B, the new tokens T and the view length S are
marked dynamic on every call, and so are the pool's slots and capacity (batchers of other sizes over
the same model share the graphs; nothing else is dynamic), traced without duck sizing, so every
configuration, batch size and cache length shares a handful of graphs per model (the planner's
candidates included; a size of 1, one row or one new token, gets graphs of its own: see `_shape_config`
for why sizes of 1 are not traced like the others). Its inputs have
one layout whatever the call: the pool's whole buffer (rows and view are sliced inside the graph,
so a narrower iteration changes no stride) and fresh contiguous tensors (no aliasing, no expanded
strides). Its KV pool is the model's *static pool* (`StaticPool`, `ModelState`: one per model for the process,
sized by `reserve_pool` or grown to the larger of what batchers need, lent to one cache at a time), so every
batcher, `generate` call and shard calls the core with the same pool tensors. On CUDA it uses
`mode="reduce-overhead"` (CUDA graphs, recorded per concrete shape), marks the pool a static address (read in
place, never copied into the graph), and pads the view length to `view_bucket` (masked columns), the new tokens
to `width_bucket` widths (pads in front, writing nowhere) and the batcher pads the rows to powers of 2, so that
the number of recordings per pool is bounded: |row buckets| x |width buckets| x |view buckets| (`CUDA_SHAPE_RULES`); its outputs are cloned (a later replay
overwrites the graph's output memory). On the CPU, inductor's options are `CPU_VARIANTS[CPU_VARIANT]`:
frozen weights (constants of the graph, prepacked; the engine runs in inference mode, where freezing
applies) and, per the measurements, inductor's own GEMM template for the linears over a few tokens. On
the CPU the compiled core multiplies by copies of its own (`LINEAR_LAYOUT`: fused q|k|v and gate|up, [K, N]
contiguous, and oneDNN-packed over 2..32 rows: a verify that reads the weights about once). Compiled calls are guarded (`NativeCausalLM`): one that raises, or a shape class's first call or first
replay whose logits or written keys/values disagree with HF's eager forward (`SELF_CHECK`), falls back to eager
for good, loudly; a CUDA-side fault raises `DeviceFault` instead (nothing runs on a poisoned context).
Prefill (a forward over a `RowView`: newly admitted rows)
always runs eager, so a new prompt length never compiles a graph. `compiled=False` runs the HF
model itself (`HFCausalLM.forward`), bit for bit the engine's eager path.

Not here: which models are native (`native_supported`, `spectr.batching.load_models` decides),
when to compile (`spectr.batching`, `compile="auto"`), sampling and selection.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import warnings
import weakref

import torch

from spectr.cpu_linear import onednn_packs
from spectr.hf import HFCausalLM
from spectr.kv_cache import RowView
from spectr.outcome import SequenceSelection
from spectr.selection import get_token_selector
from spectr.sequence import SEQUENCE_RULES, select_tree
from spectr.split import layer_groups, moved

LOG = logging.getLogger(__name__)
NATIVE_MODEL_TYPES = ("llama", "qwen2")
NATIVE_ROPE_TYPES = ("default", "linear", "llama3")  # a fixed inv_freq (dynamic / yarn-style ones: HF's path)
CUDA_VIEW_BUCKET = 64  # on CUDA the attended view is padded to `view_bucket`: this many slots x a width bucket
RECOMPILE_LIMIT = 64  # graphs per core; dynamo's limit is per code object (every core's NativeCore.forward): scaled
COMPILE_BACKEND = "inductor"  # tests set a counting backend here (spectr's tests: graphs, not kernels)
COMPILE_CHOICES = (False, True, "auto")

# compile="auto" on the CPU: compile when the queued work is at least this many iterations of the pool
# (sum of the queued rows' budgets / batch size: autoregressive iterations, an upper bound for speculative
# ones). Compiling pays when iterations x (eager - compiled seconds per iteration) > compile seconds; the threshold
# sits above the break-evens measured on the CPU (docs/performance.md#compiled-against-eager), and the loss this
# rule risks is bounded by one compile (docs/compile.md#cpu_min_iterations).
CPU_MIN_ITERATIONS = 20000

# How inductor compiles on the CPU. "frozen" (inference mode only): parameters become constants of the graph, which
# inductor prepacks (a frozen graph does not see later in-place changes to the weights: `set_compiled` rebuilds on
# a changed version counter); "frozen_cpp" adds inductor's own register-blocked GEMM template (max_autotune over the
# CPP backend). Same model, same arithmetic up to float summation order. `CPU_VARIANT` is what `compile=True` uses;
# "plain" is the default because the others were measured faster for one row only (docs/compile.md#cpu_variants).
CPU_VARIANTS = {
    "plain": {},
    "frozen": {"freezing": True},
    "frozen_cpp": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
}
CPU_VARIANT = "plain"

# Attention of the compiled core. "masked": the scores over the cache view and over the new tokens joined before
# one float32 softmax (`NativeCore._attend`); "flex": FlexAttention with a block mask built from the same pattern
# once per forward and group (on CUDA a fused, flash-style kernel, which sdpa cannot use with an arbitrary mask).
# Compiled calls only: eager ones (prefill, compile=False) always run "masked". On the CPU flex measured slower and
# inductor's CPU flex template does not compile under the core's dynamic shapes, so the CPU refuses it; on CUDA it
# is not measured yet, and the GPU speed check times both (docs/compile.md#attention).
ATTENTIONS = ("masked", "flex")
ATTENTION = "masked"
# Prefill (eager, a row subset: newly admitted prompts) attends through `scaled_dot_product_attention` with the
# pattern as a boolean mask: the masked form materialises a [B, H, T, S] float32 score matrix, O(T^2) per head,
# where a long prompt runs out of memory that HF's sdpa path would not. "masked" keeps the old form.
PREFILL_ATTENTION = "sdpa"

# How the compiled core multiplies by its linear weights. "module": the HF modules themselves (`F.linear`, weight
# [N, K]). "kmajor": the core's own copies, made when it first compiles, transposed to [K, N] contiguous and fused
# per layer (q|k|v and gate|up: one product each), multiplied as `x @ w`: on the CPU MKL's GEMM over a transposed
# operand grows with the tokens of the call where one over [K, N] stays near one token's. "auto": kmajor on the CPU;
# on CUDA the modules (cuBLAS takes either layout, and the copies would cost GPU memory). The copies cost the
# linear weights once more in host memory and follow in-place weight changes through `set_compiled`'s version
# check (docs/compile.md#linear_layout).
LINEAR_LAYOUTS = ("auto", "module", "kmajor")
LINEAR_LAYOUT = "auto"
# ...and over 2 to ONEDNN_MAX_ROWS rows (tokens of the batch) the kmajor layout multiplies float32 by a third copy,
# oneDNN's packed one (`torch.ops.mkldnn`), which reads the weights once per call where MKL reads them again every
# few rows; past ONEDNN_MAX_ROWS rows MKL is faster again (docs/compile.md#onednn_max_rows).
ONEDNN_MAX_ROWS = 32


@torch.library.custom_op("spectr::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] @ a weight [N, K] that `torch.ops.mkldnn._reorder_linear_weight` packed -> [..., N]: an opaque
    call under torch.compile (inductor lowers oneDNN's linear only for frozen constants)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_fake(x, packed, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def linear_layout(device: torch.device) -> str:
    """The layout (`LINEAR_LAYOUT`, resolved for `device`) a core compiled there multiplies with."""
    if LINEAR_LAYOUT not in LINEAR_LAYOUTS:
        raise ValueError(f"LINEAR_LAYOUT must be one of {LINEAR_LAYOUTS}, got {LINEAR_LAYOUT!r}")
    if LINEAR_LAYOUT != "auto":
        return LINEAR_LAYOUT
    return "module" if device.type == "cuda" else "kmajor"


def compile_seconds_so_far() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's `_compile.compile_inner` timer:
    tracing, inductor and its C++ or Triton builds; CUDA graph recording at a first replay is not in it).
    Process-wide (every compile, whoever asked), and `torch._dynamo.reset()` clears it."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def check_compile(compile) -> bool | str:
    """`compile` as given (False, True or "auto"), or ValueError naming it."""
    if not any(compile is choice or (isinstance(choice, str) and compile == choice) for choice in COMPILE_CHOICES):
        raise ValueError(f"compile must be False, True or 'auto', got {compile!r}")
    return compile


def auto_compile(device: torch.device, queued_tokens: int, batch_size: int) -> bool:
    """compile="auto": always on CUDA (CUDA graphs pay within a few iterations: an iteration is hundreds
    of kernel launches); on the CPU when the queued work (`queued_tokens` over `batch_size` slots) is at
    least `CPU_MIN_ITERATIONS` iterations (see there)."""
    if device.type == "cuda":
        return True
    return queued_tokens / max(batch_size, 1) >= CPU_MIN_ITERATIONS


def native_supported(model) -> str | None:
    """None when `model` can run the native forward, else why not (it then keeps HF's eager path)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in NATIVE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {NATIVE_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in NATIVE_ROPE_TYPES:
        return f"rotary embedding {getattr(rotary, 'rope_type', None)!r} is not one of {NATIVE_ROPE_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


class NativeCore(torch.nn.Module):
    """The decoder as one function over the HF model's own modules; see the module docstring."""

    def __init__(self, model):
        super().__init__()
        config = model.config
        inner = model.model
        # (first layer, stop) of each group of layers on one device (one group unless split: spectr.split)
        self.spans = tuple((start, stop) for start, stop, _ in layer_groups(model, len(inner.layers)))
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.head = model.lm_head
        self.rotary = inner.rotary_emb  # inv_freq [D/2] (already scaled for linear / llama3), attention_scaling
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.scaling = self.head_dim ** -0.5
        self.max_position = getattr(config, "max_position_embeddings", None)
        self.packed = None  # "kmajor" layout: per layer (q|k|v, o, gate|up, down), and the head; each (w, bias, oneDNN w)

    @torch.no_grad()
    def pack(self) -> None:
        """Build the "kmajor" copies of the linear weights (see `LINEAR_LAYOUT`); the layers then multiply by
        them. Idempotent. Each copy lives on its layer's device."""
        if self.packed is not None:
            return

        def kmajor(*linears):  # [K, sum N] contiguous, the fused bias (None when no part has one), oneDNN's copy
            fused = torch.cat([linear.weight for linear in linears], 0)  # [sum N, K]
            onednn = torch.ops.mkldnn._reorder_linear_weight(fused, None) if onednn_packs(fused) else None
            if all(linear.bias is None for linear in linears):
                return fused.t().contiguous(), None, onednn
            bias = torch.cat([linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                              for linear in linears])
            return fused.t().contiguous(), bias, onednn

        layers = []
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if getattr(mlp, "up_proj", None) is None or getattr(mlp, "gate_proj", None) is None:
                return  # not the gated MLP this layout fuses: keep the modules
            qkv = kmajor(attention.q_proj, attention.k_proj, attention.v_proj)
            out, gate_up, down = kmajor(attention.o_proj), kmajor(mlp.gate_proj, mlp.up_proj), kmajor(mlp.down_proj)
            layers.append((qkv, out, gate_up, down))
        self.packed = (tuple(layers), kmajor(self.head))

    def _linear(self, x, weight, bias, onednn=None):
        """x [..., K] times a "kmajor" weight [K, N] (+ bias [N]); over 2..`ONEDNN_MAX_ROWS` rows of x, by its
        oneDNN-packed copy `onednn` where there is one (see `LINEAR_LAYOUT`)."""
        rows = x.numel() // x.shape[-1]
        if onednn is not None and 2 <= rows <= ONEDNN_MAX_ROWS:
            out = torch.ops.spectr.onednn_linear(x, onednn, weight.shape[1])
            return out if bias is None else out + bias
        return x @ weight if bias is None else torch.addmm(bias, x.flatten(0, -2), weight).view(*x.shape[:-1], -1)

    def forward(self, slots, pools, allowed, last_only: bool = False, attention: str = "masked"):
        """slots [3, B, T] (input ids, positions, write slots); pools: per group of layers [n, 2, P >= B, Hkv,
        C >= S, D] (the cache rows [0, B) and slots [0, S) are attended); allowed [B, T, S] bool; attention:
        one of `ATTENTIONS`, or "sdpa" (eager prefill, `PREFILL_ATTENTION`). Returns logits [B, T, V] ([B, 1, V] with last_only) on the slots' device and the
        new keys/values, per group [n, 2, B, Hkv, T, D] on the group's device."""
        _, batch, _ = slots.shape
        input_ids, positions, write_slots = slots[0], slots[1], slots[2]  # [B, T] each
        if self.max_position is not None:
            positions = positions.clamp(max=self.max_position - 1)
        cache_allowed, new_allowed = split_pattern(allowed, write_slots)  # [B, T, S], [B, T, T]
        hidden = self.embed(input_ids)  # [B, T, E]
        cos, sin = self._rope(positions, hidden.dtype)  # [B, 1, T, D] each
        stored = []
        for (start, stop), pool in zip(self.spans, pools):  # one pass per device; unrolled under compile
            device = pool.device  # the group's: activations cross here (nothing to move on one device)
            hidden, cos, sin = moved(hidden, device), moved(cos, device), moved(sin, device)
            cache_allowed, new_allowed = moved(cache_allowed, device), moved(new_allowed, device)
            kv = pool[:, :, :batch, :, : allowed.shape[-1]]  # [n, 2, B, Hkv, S, D] a view
            block = _block_mask(cache_allowed, new_allowed) if attention == "flex" else \
                ("sdpa" if attention == "sdpa" else None)
            hidden, new_kv = self._group(start, stop, hidden, kv, cos, sin, cache_allowed, new_allowed, block)
            stored.append(new_kv)
        if last_only:
            hidden = hidden[:, -1:]
        hidden = self.norm(moved(hidden, self.norm.weight.device))
        hidden = moved(hidden, self.head.weight.device)
        logits = self.head(hidden) if self.packed is None else self._linear(hidden, *self.packed[1])  # [B, T, V]
        return moved(logits, slots.device), tuple(stored)  # [B, T, V], per group [n, 2, B, Hkv, T, D]

    def _group(self, start, stop, hidden, kv, cos, sin, cache_allowed, new_allowed, block=None):
        """Layers [start, stop) (one group, on one device) over hidden [B, T, E] and their cache view kv [n, 2,
        B, Hkv, S, D]: returns the hidden state [B, T, E] and the layers' new keys/values [n, 2, B, Hkv, T, D].
        block: FlexAttention's block mask of the pattern (attention "flex"), or None (masked attention)."""
        batch, new, _ = hidden.shape
        stored = []
        for index in range(start, stop):
            layer = self.layers[index]
            attention = layer.self_attn
            packed = None if self.packed is None else self.packed[0][index]
            normed = layer.input_layernorm(hidden)
            if packed is None:
                query, key, value = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
            else:  # one product for q|k|v
                width = self.kv_heads * self.head_dim
                query, key, value = self._linear(normed, *packed[0]).split(
                    [self.heads * self.head_dim, width, width], -1)
            query = query.view(batch, new, self.heads, self.head_dim).transpose(1, 2)
            key = key.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
            value = value.view(batch, new, self.kv_heads, self.head_dim).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin  # [B, Hq, T, D]
            key = (key * cos + _rotate_half(key) * sin).to(kv.dtype)  # [B, Hkv, T, D]
            value = value.to(kv.dtype)
            stored.append(torch.stack([key, value]))  # [2, B, Hkv, T, D]
            local = index - start
            if block == "sdpa":
                mixed = self._attend_sdpa(query, kv[local, 0], kv[local, 1], key, value, cache_allowed, new_allowed)
            elif block is None:
                mixed = self._attend(query, kv[local, 0], kv[local, 1], key, value, cache_allowed, new_allowed)
            else:
                mixed = self._attend_flex(query, kv[local, 0], kv[local, 1], key, value, block)
            if packed is None:
                hidden = hidden + attention.o_proj(mixed)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            else:  # o, then one product for gate|up, then down: HF's gated MLP, down(act(gate) * up)
                hidden = hidden + self._linear(mixed, *packed[1])
                gate, up = self._linear(layer.post_attention_layernorm(hidden), *packed[2]).chunk(2, -1)
                hidden = hidden + self._linear(layer.mlp.act_fn(gate) * up, *packed[3])
        return hidden, torch.stack(stored)  # [B, T, E], [n, 2, B, Hkv, T, D]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] of the rotary embedding at `positions` [B, T] (as HF computes them)."""
        freqs = positions[..., None].float() * self.rotary.inv_freq.float()  # [B, T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        scale = self.rotary.attention_scaling
        return (angles.cos() * scale).to(dtype)[:, None], (angles.sin() * scale).to(dtype)[:, None]

    def _attend(self, query, cache_keys, cache_values, keys, values, cache_allowed, new_allowed):
        """Softmax attention of query [B, Hq, T, D] over the cache view (cache_keys/values [B, Hkv, S, D],
        cache_allowed [B, T, S]) and the new tokens (keys/values [B, Hkv, T, D], new_allowed [B, T, T])
        -> [B, T, Hq * D]. The G query heads of a KV head are folded into the query axis."""
        batch, _, new, dim = query.shape
        groups = self.heads // self.kv_heads
        folded = query.reshape(batch, self.kv_heads, groups * new, dim).to(cache_keys.dtype)  # [B, Hkv, G*T, D]
        mask = torch.cat([cache_allowed, new_allowed], -1)[:, None, None]  # [B, 1, 1, T, S+T]
        mask = mask.expand(batch, 1, groups, new, mask.shape[-1]).reshape(batch, 1, groups * new, -1)
        scores = torch.cat([folded @ cache_keys.transpose(2, 3), folded @ keys.transpose(2, 3)], -1)  # [B, Hkv, GT, S+T]
        scores = (scores * self.scaling).masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(cache_values.dtype)
        view = cache_keys.shape[2]
        mixed = weights[..., :view] @ cache_values + weights[..., view:] @ values  # [B, Hkv, G*T, D]
        mixed = mixed.reshape(batch, self.heads, new, dim).transpose(1, 2)  # [B, T, Hq, D]
        return mixed.reshape(batch, new, self.heads * dim).to(query.dtype)


    def _attend_sdpa(self, query, cache_keys, cache_values, keys, values, cache_allowed, new_allowed):
        """`_attend` by `scaled_dot_product_attention` over the cache view joined with the new tokens, the pattern
        as a boolean mask [B, 1, T, S+T] (prefill: no [B, H, T, S] score matrix is materialised; on CUDA a fused
        kernel) -> [B, T, Hq * D]."""
        batch, _, new, dim = query.shape
        all_keys = torch.cat([cache_keys, keys], 2)  # [B, Hkv, S+T, D]
        all_values = torch.cat([cache_values, values], 2)
        mask = torch.cat([cache_allowed, new_allowed], -1)[:, None]  # [B, 1, T, S+T]
        mixed = torch.nn.functional.scaled_dot_product_attention(
            query.to(all_keys.dtype), all_keys, all_values, attn_mask=mask, scale=self.scaling,
            enable_gqa=self.heads != self.kv_heads)  # [B, Hq, T, D]
        return mixed.transpose(1, 2).reshape(batch, new, self.heads * dim).to(query.dtype)

    def _attend_flex(self, query, cache_keys, cache_values, keys, values, block):
        """`_attend` by FlexAttention over the cache view joined with the new tokens (one copy of the view's
        keys/values per layer, which the masked form avoids) under `block` (`_block_mask`) -> [B, T, Hq * D]."""
        from torch.nn.attention.flex_attention import flex_attention

        batch, _, new, dim = query.shape
        all_keys = torch.cat([cache_keys, keys], 2)  # [B, Hkv, S+T, D]
        all_values = torch.cat([cache_values, values], 2)
        mixed = flex_attention(query.to(all_keys.dtype), all_keys, all_values, block_mask=block,
                               scale=self.scaling, enable_gqa=self.heads != self.kv_heads)  # [B, Hq, T, D]
        return mixed.transpose(1, 2).reshape(batch, new, self.heads * dim).to(query.dtype)


def _block_mask(cache_allowed: torch.Tensor, new_allowed: torch.Tensor):
    """FlexAttention's block mask of the core's pattern: query t of row b attends key j of [cache view, new
    tokens] iff cat(cache_allowed [B, T, S], new_allowed [B, T, T])[b, t, j]; the same for every head."""
    from torch.nn.attention.flex_attention import create_block_mask

    pattern = torch.cat([cache_allowed, new_allowed], -1)  # [B, T, S+T]
    batch, new, keys = pattern.shape

    def mask_mod(b, h, q, kv):
        return pattern[b, q, kv]

    return create_block_mask(mask_mod, batch, None, new, keys, device=pattern.device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def split_pattern(allowed: torch.Tensor, write_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's pattern over cache slots, split for the core: allowed [B, T, S] bool, write_slots [B, T].

    Returns (cache part [B, T, S]: `allowed` without the slots this forward writes, whose cache
    entries are stale; new part [B, T, T]: token t attends new token t' iff `allowed` marks t''s
    slot). A write slot past the view (padding the caller clamped) is never attended.
    """
    batch, new, view = allowed.shape
    inside = write_slots < view  # [B, T]
    slots = write_slots.clamp(max=view - 1)  # [B, T]
    written = torch.zeros(batch, view, dtype=torch.int32, device=allowed.device)
    written = written.scatter_add(1, slots, inside.to(torch.int32)) > 0  # [B, S]
    cache_part = allowed & ~written[:, None, :]  # [B, T, S]
    new_part = allowed.gather(2, slots[:, None, :].expand(batch, new, new)) & inside[:, None, :]  # [B, T, T]
    return cache_part, new_part


class StaticPool:
    """A model's KV pool under compile: per group of layers one buffer [layers in g, 2, rows, Hkv, capacity, D],
    allocated once and lent to one cache at a time (`RowKVCache.adopt`: the cache's buffers become views of its
    first rows and slots). The compiled core always reads the whole buffers, so every batcher, `generate` call,
    shard or Ray Data batch over the model calls it with the same tensors: one address (CUDA graphs replay
    instead of re-recording) and one shape (no new graph). `generation` counts the pools the model has had."""

    def __init__(self, key: tuple, buffers: tuple, rows: int, capacity: int, generation: int):
        self.key, self.buffers, self.rows, self.capacity, self.generation = key, buffers, rows, capacity, generation
        self.holder = None  # a weak reference to the cache that holds the pool now
        self.graph_bound: int | None = None  # under the CUDA shape rules: the graph shapes it can record (logged)

    def fits(self, key: tuple, rows: int, capacity: int) -> bool:
        return self.key == key and rows <= self.rows and capacity <= self.capacity

    def free(self) -> bool:
        return self.holder is None or self.holder() is None


class ModelState:
    """What every `NativeCausalLM` over one HF model shares (so that a new batcher over the model, a second
    `generate` call, a worker rebuilding its batcher, reuses it): the core and its compiled function, the static
    pool, the self-check's record of the shape classes it compared (a class is checked once per model and
    compiled function, not once per batcher), and the concrete shapes the compiled core ran."""

    def __init__(self, core: NativeCore):
        self.core = core
        self.compiled: tuple | None = None  # (backend, variant, attention, kmajor, versions, compiled function)
        self.pool: StaticPool | None = None
        self.pools_allocated = 0  # pools this model has had (a pool grows only when a batcher needs more)
        self.reserved = (0, 0)  # (rows, capacity) that `reserve_pool` asked for
        self.calls: dict = {}  # (compiled key, shape class) -> compiled calls so far (the self-check's counter)
        self.graph_shapes: set = set()  # (pool generation, B, T, S, last_only) the compiled core ran with

    def key(self) -> tuple | None:
        return None if self.compiled is None else self.compiled[:5]


# Per HF model: its `ModelState`, shared by every NativeCausalLM over it.
_CORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The static pool's sizes: rows rounded up to a power of 2, slots to `POOL_SLOT_BUCKET` x a width bucket (at most
# 1.5x the slots asked for), so that a handful of sizes serves a job of varied prompts and budgets; a pool is
# replaced only by a larger one (in each dimension the larger of the two), so a process has a few pools at most.
POOL_SLOT_BUCKET = 64


def pool_size(rows: int, capacity: int) -> tuple[int, int]:
    """The (rows, slots) a static pool for `rows` rows of `capacity` slots is allocated with."""
    return 1 << max(rows - 1, 0).bit_length(), POOL_SLOT_BUCKET * width_bucket(-(-capacity // POOL_SLOT_BUCKET))


def reserve_pool(model, rows: int, capacity: int) -> None:
    """Size `model`'s static pool (compiled mode) for at least `rows` rows of `capacity` slots, before any batcher
    needs it: an actor that knows its configuration (batch size, the longest prompt + budget it allows, the widest
    tree: a batcher's capacity is max_length + 2 + K x L) reserves once, and every batcher after takes the same
    pool. Allocated at the next compiled forward that needs a pool."""
    if rows < 1 or capacity < 1:
        raise ValueError(f"reserve_pool needs rows and capacity >= 1, got {rows}, {capacity}")
    state = _CORES.get(model)
    if state is None:
        state = _CORES[model] = ModelState(NativeCore(model))
    state.reserved = (max(state.reserved[0], rows), max(state.reserved[1], capacity))


def model_state(model) -> ModelState | None:
    """`model`'s shared state (None before a `NativeCausalLM` or `reserve_pool` saw it): its pool, its graphs."""
    return _CORES.get(model)


# The CUDA shape rules (rows padded to a power of 2 by the batcher, new tokens to `width_bucket`, the view to
# `view_bucket`): "auto" applies them on CUDA; True everywhere (tests count the shapes a CUDA run would record on
# the CPU).
CUDA_SHAPE_RULES = "auto"

# The self-check of the compiled core: per model and compiled function, each shape class (a new graph, or on CUDA
# a new recorded shape) is compared with HF's eager forward on the same inputs twice: at its first compiled call
# and at its first replay (`REPLAY_CALL`: under CUDA graph trees the first call runs eagerly to warm up and the
# second records, so the third is the first replay of the recorded graph). Compared: the logits and the new
# keys/values the forward writes; further apart than atol + rtol * max |eager| (by dtype) sends the model back to
# eager (`compile_fallbacks`). Costs two eager forwards per shape class and model: a handful per process.
SELF_CHECK = True
SELF_CHECK_TOLERANCE = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-3, 1e-3)}
SELF_CHECK_LOW_PRECISION = (0.1, 0.05)  # bfloat16 / float16 (docs/compile.md#the-self-check)
REPLAY_CALL = {"cuda": 3}  # by device type; 2 elsewhere (the second call runs the compiled code once more)
# Test-only: a function (logits, new_kv) -> (logits, new_kv) applied to the compiled core's outputs on every
# call of a shape class from its first replay on: a recorded graph that replays wrong (tests/spectr/test_static_pool.py).
REPLAY_HOOK = None

# CUDA-side faults: after one the CUDA context is poisoned (every later call fails too), so the compiled core's
# guard does not answer it eagerly: it raises `DeviceFault` and the caller (the job's actor) is sick.
DEVICE_FAULT_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "an illegal instruction",
                        "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address")


class DeviceFault(RuntimeError):
    """A CUDA-side fault (device assert, illegal address) inside the compiled core: the device is unusable."""


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is a CUDA-side fault (the context is poisoned: nothing on the device may run after it)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if isinstance(error, DeviceFault) or (accelerator_error is not None and isinstance(error, accelerator_error)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in DEVICE_FAULT_MARKERS)


def shape_rules(device: torch.device) -> bool:
    """Whether the CUDA shape rules (`CUDA_SHAPE_RULES`) apply to compiled calls on `device`."""
    return device.type == "cuda" if CUDA_SHAPE_RULES == "auto" else bool(CUDA_SHAPE_RULES)


def width_bucket(new: int) -> int:
    """The padded number of new tokens under the CUDA shape rules: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of 2
    and 1.5 x powers of 2: at most 1.5x the tokens, 2 log2(W) widths up to W)."""
    if new <= 4:
        return max(new, 1)
    power = 1 << (new - 1).bit_length()  # the next power of 2 >= new
    return power * 3 // 4 if new <= power * 3 // 4 else power


def view_bucket(view: int, capacity: int) -> int:
    """The padded view length under the CUDA shape rules: `CUDA_VIEW_BUCKET` x `width_bucket` of the view in
    units of CUDA_VIEW_BUCKET (64, 128, 192, 256, 384, 512, ...: at most 1.5x the slots, 2 log2 sizes), at most the
    pool's `capacity`."""
    return min(CUDA_VIEW_BUCKET * width_bucket(-(-view // CUDA_VIEW_BUCKET)), capacity)


def graph_classes(batch_size: int, max_new: int, capacity: int) -> tuple[int, int, int]:
    """The shape classes (rows x new tokens x view) a compiled core can record under the CUDA shape rules for a
    batcher of `batch_size` rows whose forwards take at most `max_new` new tokens, over a pool of `capacity` slots:
    (row classes, width classes, view classes); their product (x 2: a last-only call is a class of its own) bounds
    the graphs of the process per pool. Enumerated up front, so a job's compile and recording cost is known."""
    rows = {min(batch_size, 1 << (top - 1).bit_length()) for top in range(1, batch_size + 1)}
    widths = {width_bucket(new) for new in range(1, max_new + 1)}
    views = {view_bucket(view, capacity) for view in range(1, capacity + 1)}
    return len(rows), len(widths), len(views)


def tensor_mismatch(what: str, compiled: torch.Tensor, eager: torch.Tensor) -> str | None:
    """None when `compiled` agrees with `eager` within the dtype's tolerance, else what differs (one host read)."""
    atol, rtol = SELF_CHECK_TOLERANCE.get(eager.dtype, SELF_CHECK_LOW_PRECISION)
    if compiled.shape != eager.shape:
        return f"{what} of shape {tuple(compiled.shape)} against eager {tuple(eager.shape)}"
    finite = torch.isfinite(eager)
    if not torch.equal(finite, torch.isfinite(compiled)):
        return f"non-finite {what} where eager's are finite (or the reverse)"
    if not bool(finite.any()):
        return None
    a, b = compiled.float()[finite], eager.float()[finite]
    worst, scale = float((a - b).abs().max()), float(b.abs().max())  # one read, twice per shape class
    if worst > atol + rtol * scale:
        return f"{what} differ from eager by up to {worst:.3g} (tolerance {atol + rtol * scale:.3g} for {eager.dtype})"
    return None


def logits_mismatch(compiled: torch.Tensor, eager: torch.Tensor) -> str | None:
    """None when the compiled logits agree with the eager ones within the dtype's tolerance, else what differs."""
    return tensor_mismatch("logits", compiled, eager)


def written_kv(buffers, write_slots: torch.Tensor, like) -> tuple[torch.Tensor, ...]:
    """The keys/values a forward wrote at write_slots [B, T]: per group [n, 2, B, Hkv, T, D] read from `buffers`
    (per group [n, 2, B, Hkv, C, D]), shaped as `like` (the compiled core's new_kv)."""
    out = []
    for buffer, kv in zip(buffers, like):
        slots = moved(write_slots, buffer.device)
        index = slots[None, None, :, None, :, None].expand(kv.shape)
        out.append(buffer[:, :, : kv.shape[2]].gather(4, index))
    return tuple(out)


def weight_versions(model) -> tuple[int, ...]:
    """The version counters of `model`'s parameters (an in-place change bumps them): read when a batcher
    decides to compile, never per iteration."""
    return tuple(0 if p.is_inference() else p._version for p in model.parameters())


class NativeCausalLM(HFCausalLM):
    """An `HFCausalLM` whose forward runs `NativeCore` (compiled or not); see the module docstring.

    Compiled, a call that raises or that the self-check (`SELF_CHECK`: a shape class's first call and first
    replay) finds apart from the eager forward is answered by HF's eager forward, and the model stays eager from
    then on: one warning naming the error, `compile_fallbacks` += 1 (the batcher adds it to
    `GenerationStats.compile_fallbacks`). A CUDA-side fault raises `DeviceFault` instead (no eager answer on a
    poisoned context)."""

    def __init__(self, model, role: str = "model", compiled: bool = False):
        super().__init__(model, role)
        reason = native_supported(model)
        if reason is not None:
            raise ValueError(f"{self.description} cannot run the native forward: {reason}")
        self.state = _CORES.get(model)
        if self.state is None:
            self.state = _CORES[model] = ModelState(NativeCore(model))
        self.core = self.state.core
        self.cuda = self.device.type == "cuda"
        self.compile_fallbacks = 0  # compiled calls answered by the eager forward (the model is eager since)
        self.fallback_error: str | None = None
        self.shapes: set = set()  # concrete (B, T, S) the compiled core was called with (by this wrapper)
        self.compiled = False
        self.set_compiled(compiled)

    @property
    def _compiled_core(self) -> tuple | None:
        return self.state.compiled

    def set_compiled(self, compiled: bool, variant: str | None = None) -> None:
        """Switch between the compiled core (built on first use) and HF's eager forward. `variant`: on the
        CPU, a key of `CPU_VARIANTS` (default `CPU_VARIANT`); ignored on CUDA and by non-inductor backends.
        A weight changed in place since the core was built (its version counter moved) rebuilds the core's
        weight copies and its compiled function: the compiled core never samples an old law."""
        variant = CPU_VARIANT if variant is None else variant
        if variant not in CPU_VARIANTS:
            raise ValueError(f"variant must be one of {sorted(CPU_VARIANTS)}, got {variant!r}")
        if ATTENTION not in ATTENTIONS:
            raise ValueError(f"ATTENTION must be one of {ATTENTIONS}, got {ATTENTION!r}")
        if compiled and ATTENTION == "flex" and not self.cuda and COMPILE_BACKEND == "inductor":
            raise ValueError("ATTENTION='flex' compiles on CUDA only: inductor's CPU FlexAttention template "
                             "does not compile under the core's dynamic shapes (C++ error, torch 2.13), and with "
                             "static shapes it measured slower than 'masked' (docs/compile.md)")
        layout = linear_layout(self.device)
        self.compiled = bool(compiled)  # after the checks: a refused call changes nothing
        if not self.compiled:
            return
        state = self.state
        versions = weight_versions(self.model)
        if state.compiled is not None and state.compiled[4] != versions:
            self.core.packed = None  # copies of the old weights: rebuilt below, and the graphs with them
            state.compiled = None
        if layout == "kmajor":
            self.core.pack()
        else:
            self.core.packed = None
        key = (COMPILE_BACKEND, "cuda" if self.cuda else variant, ATTENTION, self.core.packed is not None, versions)
        if state.compiled is None or state.compiled[:5] != key:
            compiled = torch.compile(self.core, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND,
                                     **compile_options(self.cuda, variant))
            state.compiled = (*key, compiled)  # (backend, variant, attention, kmajor, versions, compiled)

    def forward(self, input_ids, position_ids, allowed, cache, write_slots, last_only: bool = False):
        """Same contract as `HFCausalLM.forward`; compiled: the native core (eager for row subsets: prefill),
        guarded (the class docstring)."""
        args = (input_ids, position_ids, allowed, cache, write_slots, last_only)
        if not self.compiled:
            return super().forward(*args)
        if isinstance(cache.rows, RowView):  # prefill of newly admitted rows: always eager
            return self.native_forward(*args)
        try:
            logits, new_kv, check = self._run_compiled(*args)
        except Exception as error:  # noqa: BLE001 - any failure of the compiler or its code: eager, loudly
            if is_device_fault(error):  # the context is poisoned: no eager answer, the caller is sick
                raise DeviceFault(f"the compiled {self.description} hit a CUDA-side fault; the device is unusable "
                                  f"until the process restarts ({type(error).__name__}: {error})") from error
            self._fall_back(f"{type(error).__name__}: {error}")
            return super().forward(*args)
        if check and SELF_CHECK:
            eager = super().forward(*args)  # writes its own keys/values at the same slots
            problem = logits_mismatch(logits, eager) or next(
                (p for p in map(functools.partial(tensor_mismatch, "keys/values"), new_kv,
                                written_kv(cache.rows.buffers, write_slots, new_kv)) if p is not None), None)
            if problem is not None:
                self._fall_back(f"self-check failed: {problem}")
                return eager
        for buffer, group_kv in zip(cache.rows.buffers, new_kv):  # one scatter per group (per device)
            _store(buffer, group_kv, moved(write_slots, buffer.device), None)
        return logits

    def _fall_back(self, error: str) -> None:
        self.compiled = False
        self.compile_fallbacks += 1
        self.fallback_error = error
        warnings.warn(f"spectr: the compiled {self.description} failed and runs eager from now on ({error})",
                      RuntimeWarning, stacklevel=3)

    def _prepare(self, rows, write_slots, view: int):
        """Declare the forward to the cache and give it buffers on first use: compiled, the model's static pool."""
        rows.begin_forward(write_slots, view)
        base = rows.cache if isinstance(rows, RowView) else rows
        if base.buffers[0] is None:
            sample = torch.empty(1, self.core.kv_heads, 1, self.core.head_dim, dtype=self.dtype, device=self.device)
            if self.compiled:
                self._adopt_static_pool(base.root, sample)
            else:
                base._allocate(sample)
        return base

    def _adopt_static_pool(self, cache, sample) -> None:
        """Lend the model's static pool to `cache` (its buffers become views of the pool's first rows and slots,
        zeroed there). A new pool is allocated only when there is none, or the held one is too small (then the
        larger of the two in each dimension, and of `reserve_pool`'s sizes), or a live cache still holds it."""
        state = self.state
        key = (cache.groups, sample.dtype, sample.shape[1], sample.shape[3])
        pool = state.pool
        if pool is not None and pool.fits(key, cache.batch_size, cache.capacity) and not pool.free():
            gc.collect()  # only when a dropped cache sits in someone's reference cycle (the engine's hold none)
        if pool is None or not pool.fits(key, cache.batch_size, cache.capacity) or not pool.free():
            rows, capacity = pool_size(max(cache.batch_size, state.reserved[0]), max(cache.capacity, state.reserved[1]))
            if pool is not None and pool.key == key and pool.free():  # grow: never below the held one
                rows, capacity = max(rows, pool.rows), max(capacity, pool.capacity)
            buffers = []
            for start, stop, device in cache.groups:
                shape = (stop - start, 2, rows, sample.shape[1], capacity, sample.shape[3])
                buffer = torch.zeros(shape, dtype=sample.dtype, device=device)
                if shape_rules(self.device):
                    torch._dynamo.mark_static_address(buffer)  # CUDA graphs read it in place, never copy it
                buffers.append(buffer)
            state.pools_allocated += 1
            pool = state.pool = StaticPool(key, tuple(buffers), rows, capacity, state.pools_allocated)
            if shape_rules(self.device):
                classes = graph_classes(cache.batch_size, cache.capacity, capacity)
                bound = 2 * classes[0] * classes[1] * classes[2]
                pool.graph_bound = bound
                LOG.info("spectr: %s: static pool %d of %d rows x %d slots; at most %d CUDA graph shapes (%d row x %d "
                         "width x %d view classes x last-only)", self.description, pool.generation, rows, capacity,
                         bound, *classes)
        cache.adopt(pool.buffers)
        pool.holder = weakref.ref(cache)

    def take_pool(self, cache) -> None:
        """Compiled: move `cache` (a `RowKVCache`, root of its rows) onto the model's static pool now, its content
        so far (rows prefilled before the compile decision) copied over; a no-op when it is already there, or
        eager. The batcher calls it once, when it decides to compile, before any view of the cache is taken."""
        if not self.compiled or (self.state.pool is not None and cache.pool is self.state.pool.buffers):
            return
        held = None if cache.buffers[0] is None else list(cache.buffers)
        with torch.inference_mode():  # as every forward of the engine (the pool's buffers are inference tensors)
            sample = torch.empty(1, self.core.kv_heads, 1, self.core.head_dim, dtype=self.dtype, device=self.device)
            self._adopt_static_pool(cache, sample)
            if held is not None:
                for buffer, old in zip(cache.buffers, held):
                    buffer.copy_(old)

    def native_forward(self, input_ids, position_ids, allowed, cache, write_slots, last_only: bool = False):
        """The native core over `cache`, eager (a row subset: a gathered copy of its slots), then one scatter of
        K/V per group."""
        rows = cache.rows
        subset = isinstance(rows, RowView)
        view = allowed.shape[-1]
        base = self._prepare(rows, write_slots, view)
        buffers = base.buffers  # per group [n, 2, B, Hkv, C, D] (one: [N, 2, B, Hkv, C, D])
        slots = torch.stack([input_ids, position_ids.expand_as(write_slots), write_slots])  # [3, B, T] fresh
        pools = tuple(b[:, :, :, :, :view].index_select(2, moved(rows.rows, b.device)) for b in buffers) \
            if subset else tuple(buffers)
        logits, new_kv = self.core(slots, pools, allowed, last_only, PREFILL_ATTENTION if subset else "masked")
        for buffer, group_kv in zip(buffers, new_kv):  # one scatter per group (per device)
            rows_here = moved(rows.rows, buffer.device) if subset else None
            _store(buffer, group_kv, moved(write_slots, buffer.device), rows_here)
        return logits

    def _run_compiled(self, input_ids, position_ids, allowed, cache, write_slots, last_only):
        """The compiled core over the whole static pool (the same tensors for the model's life; the rows are its
        first B) -> (logits [B, T, V], new keys/values per group [n, 2, B, Hkv, T, D], whether the self-check
        compares this call: its shape class's first call or first replay). Under the CUDA rules the new tokens are
        padded in front to `width_bucket` (the pads write nowhere, attend slot 0 and are attended by nobody) and
        the view to `view_bucket`."""
        base = self._prepare(cache.rows, write_slots, allowed.shape[-1])
        pools = tuple(base.root.pool)  # per group [n, 2, P, Hkv, C, D]: the static pool's buffers
        slots = torch.stack([input_ids, position_ids.expand_as(write_slots), write_slots])  # [3, B, T] fresh
        allowed = allowed.contiguous()
        batch, new, view = allowed.shape
        padded_new = new
        rules = shape_rules(self.device)
        if rules:
            padded_new = width_bucket(new)
            padded_view = view_bucket(view, pools[0].shape[4])
            pad = padded_new - new
            if pad:  # pads first: the last new token stays last (last_only)
                filler = torch.stack([torch.zeros_like(write_slots[:, :1]), torch.zeros_like(write_slots[:, :1]),
                                      torch.full_like(write_slots[:, :1], padded_view)])  # [3, B, 1]
                slots = torch.cat([filler.expand(3, batch, pad), slots], 2)  # [3, B, T']
                first_slot = torch.zeros(batch, pad, padded_view, dtype=torch.bool, device=allowed.device)
                first_slot[:, :, 0] = True  # a finite softmax for the pads
                allowed = torch.nn.functional.pad(allowed, (0, padded_view - view))
                allowed = torch.cat([first_slot, allowed], 1)  # [B, T', S']
            else:
                allowed = torch.nn.functional.pad(allowed, (0, padded_view - view))  # [B, T, S']: masked columns
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
            shape_class = (batch, padded_new, allowed.shape[-1], last_only)
        else:
            shape_class = (batch == 1, new == 1, last_only)  # the graphs the dynamic dims specialise
        self.shapes.add((batch, padded_new, allowed.shape[-1]))
        for dim in (1, 2):
            torch._dynamo.mark_dynamic(slots, dim)  # B, T
        for dim in (0, 1, 2):
            torch._dynamo.mark_dynamic(allowed, dim)  # B, T, S
        for pool in pools:
            for dim in (2, 4):
                torch._dynamo.mark_dynamic(pool, dim)  # P, C: pools of other sizes share the graphs
        state = self.state
        compiled_before = compile_seconds_so_far()
        with _shape_config():
            logits, new_kv = state.compiled[-1](slots, pools, allowed, last_only, state.compiled[2])
        if self.cuda:  # the graph's output memory is reused by the next replay
            logits, new_kv = logits.clone(), tuple(kv.clone() for kv in new_kv)
        if padded_new != new:
            logits = logits if last_only else logits[:, padded_new - new:]
            new_kv = tuple(kv[:, :, :, :, padded_new - new:] for kv in new_kv)
        generation = 0 if state.pool is None or pools[0] is not state.pool.buffers[0] else state.pool.generation
        counted = (state.key(), generation if rules else 0, shape_class)
        calls = state.calls[counted] = 1 if compile_seconds_so_far() != compiled_before else \
            state.calls.get(counted, 0) + 1  # a new graph: its first call again
        state.graph_shapes.add((generation, batch, padded_new, allowed.shape[-1], last_only))
        replay = REPLAY_CALL.get(self.device.type, 2)
        if REPLAY_HOOK is not None and calls >= replay:
            logits, new_kv = REPLAY_HOOK(logits, new_kv)
        return logits, new_kv, calls in (1, replay)


def compile_options(cuda: bool, variant: str) -> dict:
    """torch.compile's keyword options: CUDA graphs on CUDA, `CPU_VARIANTS[variant]` on the CPU (inductor only)."""
    if COMPILE_BACKEND != "inductor":
        return {}
    if cuda:
        return {"mode": "reduce-overhead"}
    options = CPU_VARIANTS[variant]
    return {"options": dict(options)} if options else {}


@contextlib.contextmanager
def _shape_config():
    """For the duration of one compiled call: trace without duck sizing (two dims equal at the first trace are not
    assumed equal forever), and dynamo's per-code-object recompile limit at `RECOMPILE_LIMIT` per live core.

    Not `backed_size_oblivious` (sizes of 1 traced like any other, which saved the graphs specialised for
    one row or one new token): with it, inductor (torch 2.13, CPU) compiled the core into wrong code for
    two rows or more (`tests/spectr/test_native_inductor.py`; docs/compile.md).

    The limit: every core's graphs are graphs of one code object (`NativeCore.forward`), so the limit is scaled by
    the number of live cores; and it is patched here, around every compiled call, not set once, because torch's
    config values are per thread and the thread that calls a compiled core need not be the one that built it (a Ray
    actor's generation thread; `test_the_recompile_limit_holds_in_any_thread`). The thread's own config is left as
    it was."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental import _config as fx_config

    limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT * max(1, len(_CORES)))
    with dynamo_config.patch(recompile_limit=limit), fx_config.patch(use_duck_shape=False):
        yield


# -- the step's selection under compile ---------------------------------------------------------------------------
# Compiled mode may also compile the selection: inductor fuses each bisection step's multiply, clamp and sum into one
# kernel (eager: several ops and an [N, V] buffer per step). On a GPU that removes launches (a K-SEQ position alone
# is ~25 bisection steps x ~8 kernel launches), so `SELECTION_RULE = "auto"` compiles it on CUDA; on the CPU it
# stays eager: each (method, K, L) compiles graphs of its own (seconds each), `auto` explores several, and the
# selection is a small share of a CPU iteration (docs/compile.md#selection_rule-and-selection_compile_after). The rows are a
# dynamic dimension (traced as in the core: without duck sizing, one row specialised); plain inductor on every
# device (no CUDA graphs for the selection). A sort-based exact rho* was slower than the bisection (not kept).
SELECTION_RULE = "auto"  # "auto" (the rule above: CUDA), "all" (every device), "none" (eager everywhere)
# Exploration and compilation must not fight: the planner tries a candidate for a handful of iterations, and each
# (method, K, L) compiles graphs of its own. So a configuration's selection compiles only once it has run this many
# iterations of one batcher eagerly: the trials stay eager, the configuration the chooser keeps (or a fixed
# method's) compiles.
SELECTION_COMPILE_AFTER = 64
SELECTION_RULES = ("auto", "all", "none")
_SELECTION: dict = {}


def selection_compiles(device: torch.device) -> bool:
    """Whether compiled mode compiles the selection on `device` (above)."""
    if SELECTION_RULE not in SELECTION_RULES:
        raise ValueError(f"SELECTION_RULE must be one of {SELECTION_RULES}, got {SELECTION_RULE!r}")
    if SELECTION_RULE != "auto":
        return SELECTION_RULE == "all"
    return device.type == "cuda"


def compiled_select_tree(draft_tokens, draft_probs, node_target_probs, node_of, uniforms, *,
                         method: str) -> SequenceSelection:
    """`spectr.sequence.select_tree` of the compiled engine: the same rule on the same inputs, every row
    through the K-draft rule (no row splits: their counts would be dynamic shapes), compiled (above): a
    single-draft or sequence-level walk whole, a K-draft token rule once per call shape (the walk between
    its positions eager)."""
    tensors = (draft_tokens, draft_probs, node_target_probs, node_of, uniforms)
    if draft_tokens.shape[1] == 1 or method in SEQUENCE_RULES:
        rule = SEQUENCE_RULES.get(method) or get_token_selector(method)  # in the key: a replaced rule recompiles
        whole = _compiled(("tree", method, rule), functools.partial(_select_tree_fields, method=method))
        return SequenceSelection(*_run_rows_dynamic(whole, tensors))
    selector = get_token_selector(method)
    rule = _compiled(("token", method, selector), selector)
    return select_tree(*tensors, method=method, selector=lambda *args: _run_rows_dynamic(rule, args))


def _select_tree_fields(*tensors, method: str) -> tuple:
    out = select_tree(*tensors, method=method)
    return out.tokens, out.num_tokens, out.num_accepted, out.draft_index, out.accepted_per_position


def _compiled(key: tuple, function):
    """`function` under torch.compile(fullgraph=True), built once per key and backend."""
    key = (*key, COMPILE_BACKEND)
    if key not in _SELECTION:
        _SELECTION[key] = torch.compile(function, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)
    return _SELECTION[key]


def _run_rows_dynamic(compiled, tensors: tuple):
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, 0)  # the rows
    with _shape_config():
        return compiled(*tensors)


def _store(buffer: torch.Tensor, new_kv: torch.Tensor, write_slots: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Write new_kv [N, 2, R, Hkv, T, D] into buffer [N, 2, B, Hkv, C, D] at write_slots [R, T] (of rows [R])."""
    layers, _, count, heads, new, dim = new_kv.shape
    if rows is None:
        index = write_slots[None, None, :, None, :, None].expand(layers, 2, count, heads, new, dim)
        buffer.scatter_(4, index, new_kv)
        return
    head_index = torch.arange(heads, device=rows.device)
    buffer[:, :, rows[:, None, None], head_index[None, :, None], write_slots[:, None, :]] = new_kv
