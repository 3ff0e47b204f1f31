"""Feature drafts (EAGLE-style): a one-layer draft head that reads the target's own hidden states.

An independent draft small enough to pay is too weak for a real target; a feature draft starts from what
the target already computed. For each committed token x_j the head takes the target's feature at the
position before it, f_{j-1} (the hidden state from which the target's law of x_j came), together with the
embedding of x_j, runs one decoder layer over its own per-row KV cache, and gives the law of x_{j+1} (and
its own hidden state, which stands in for the target's feature while drafting deeper than one token).

Two layouts, both loadable from published checkpoints (`load_feature_draft`):

- **eagle** (EAGLE-1 / EAGLE-2, Li et al. 2024): `fc(cat(embed(x), f))` (2H -> H, with bias), one Llama
  decoder layer without its input norm, no final norm; logits from the target's output layer (or, with a
  draft vocabulary, its rows for those tokens). The feature is the target's last hidden state after its
  final norm (HF's `hidden_states[-1]`), which the head is trained to predict for the next position.
- **eagle3** (EAGLE-3, Li et al. 2025): the target's features are the hidden states entering a few layers
  (`feature_layers`, HF `hidden_states` indices; EAGLE-3's default: 2, L/2, L-3) fused by `fc` (nH -> H);
  the "midlayer" normalises the embedding and the feature separately and attends over their concatenation
  (2H -> heads), then `norm` and its own `lm_head` over a draft vocabulary (`d2t`: draft id -> target id
  offset). While drafting, the head's own hidden state (H, not nH) is fed back without `fc`.

A frequency-ranked draft vocabulary (FR-Spec) covers only the draft vocabulary's tokens: the head's law is
zero on every other token, mapped to the target's vocabulary for verification, so the output stays exact.

Exactness does not depend on the features: the drafter stores, for every node, the law its children were
drawn from, and verification reads that law. Wrong or stale features only lower acceptance.

`FeatureTap` collects the target's features from its forwards (hooks on the HF modules, no extra pass);
`FeatureDraftLM` is the engine's view of a head (as `spectr.hf.HFCausalLM` is of a model);
`FeatureDrafter` is the drafter (`spectr.drafting.TreeDrafter`'s interface) that feeds the committed tokens
with the target's true features and drafts the K x L tree with the head's own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spectr import cpu_linear
from spectr.drafting import TreeDrafter, nonfinite_rows
from spectr.kv_cache import RowKVCache, tree_attention
from spectr.penalties import root_paths
from spectr.rng import sample_categorical_many
from spectr.tree import extend_same_prefix, leaders_of

EAGLE = "eagle"
EAGLE3 = "eagle3"
KINDS = (EAGLE, EAGLE3)


# --------------------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------------------
@dataclass
class FeatureDraftConfig:
    """The head's shape. `feature_layers`: HF `hidden_states` indices of the target's features (the input
    of layer i for i < L, the final normed state for i = L); `draft_vocab_size`: None (the whole vocabulary)
    or the number of draft tokens (`d2t` maps them)."""

    kind: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    feature_layers: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    draft_vocab_size: int | None = None
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The directory's config.json (EAGLE-3's names where it has them, so that other tools read it too)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        return {
            "architectures": ["LlamaForCausalLMEagle3" if self.kind == EAGLE3 else "LlamaForCausalLMEagle"],
            "model_type": "llama", "spectr_draft_kind": self.kind, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_parameters": rope, "hidden_act": self.hidden_act,
            "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.feature_layers},
            **self.extra,
        }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inverse_frequencies(config: FeatureDraftConfig) -> torch.Tensor:
    """RoPE inverse frequencies: the default rule, or Llama 3's scaling (the rope types published heads use)."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        wavelength = 2 * math.pi / inv
        smooth = (original / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inv / factor, inv)
        middle = (wavelength <= original / low) & (wavelength >= original / high)
        inv = torch.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"feature draft: rope type {kind!r} is not supported (default, llama3)")
    return inv.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class FeatureDraftModel(nn.Module):
    """The head's weights and its one forward; `embed` and (without its own `lm_head`) `head` are the
    target's, shared and frozen (not part of `state_dict`)."""

    is_feature_draft = True

    def __init__(self, config: FeatureDraftConfig, embed: nn.Embedding | None = None, head: nn.Linear | None = None):
        super().__init__()
        if config.kind not in KINDS:
            raise ValueError(f"feature draft kind must be one of {KINDS}, got {config.kind!r}")
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self._shared = {"embed": embed, "head": head}  # not registered: not trained, not saved
        self.own_embedding = False  # a published EAGLE-1 head that ships its copy of the target's embedding
        eagle3 = config.kind == EAGLE3
        feature_size = h * len(config.feature_layers)
        if eagle3:
            self.fc = nn.Linear(feature_size, h, bias=False)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            attention_in = 2 * h
        else:
            if feature_size != h:
                raise ValueError(f"an eagle (EAGLE-1) head reads one feature of size {h}, got layers "
                                 f"{config.feature_layers}")
            self.fc = nn.Linear(2 * h, h, bias=True)
            attention_in = h
        self.q_proj = nn.Linear(attention_in, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(attention_in, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(attention_in, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps) if eagle3 else None
        draft_vocab = config.draft_vocab_size
        own_head = eagle3 or draft_vocab is not None
        self.lm_head = nn.Linear(h, draft_vocab or config.vocab_size, bias=False) if own_head else None
        # draft id -> target id (d2t is EAGLE-3's offset form: target = draft + d2t[draft])
        self.register_buffer("d2t", torch.zeros(draft_vocab or 0, dtype=torch.int64))
        self.register_buffer("inv_freq", _inverse_frequencies(config), persistent=False)

    def bind(self, target) -> FeatureDraftModel:
        """Share `target`'s embedding (unless the head ships its own) and output layer; refuses a target whose
        hidden size, vocabulary or layers do not fit this head (ValueError naming what differs)."""
        embed, head, text = _target_parts(target)
        if int(text.hidden_size) != self.config.hidden_size:
            raise ValueError(f"the feature draft's hidden size {self.config.hidden_size} is not the target's "
                             f"{text.hidden_size}: it was made for another target")
        if int(head.weight.shape[0]) != self.config.vocab_size:
            raise ValueError(f"the feature draft's vocabulary ({self.config.vocab_size}) is not the target's "
                             f"({head.weight.shape[0]})")
        bad = [i for i in self.config.feature_layers if not 0 <= i <= int(text.num_hidden_layers)]
        if bad:
            raise ValueError(f"the feature draft reads layers {bad}, outside the target's hidden states "
                             f"[0, {text.num_hidden_layers}]")
        if not self.own_embedding:
            self._shared["embed"] = embed
        self._shared["head"] = head
        return self

    # -- what the engine asks ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size * len(self.config.feature_layers)

    def draft_ids(self) -> torch.Tensor | None:
        """[Vd] the target ids of the draft vocabulary (None: the whole vocabulary)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._shared["embed"](tokens)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] the head's logits over the draft vocabulary (the whole one without it)."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self._shared["head"](hidden)

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: the draft vocabulary's logits in place, -inf elsewhere (q = 0 there)."""
        logits = self.draft_logits(hidden)
        ids = self.draft_ids()
        if ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, ids, logits)

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor, from_target: bool) -> torch.Tensor:
        """What the decoder layer reads for tokens [B, T] with features [B, T, F]: the target's (F = nH,
        fused by `fc` in EAGLE-3) or the head's own (F = H) -> ([B, T, A] attention input, [B, T, H] residual)."""
        embedded = self.embed(tokens).to(features.dtype)
        if self.config.kind == EAGLE3:
            hidden = self.fc(features) if from_target else features
            mixed = torch.cat([self.input_layernorm(embedded), self.hidden_norm(hidden)], -1)
            return mixed, hidden
        hidden = self.fc(torch.cat([embedded, features], -1))
        return hidden, hidden

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, *,
                from_target: bool, attend=None) -> torch.Tensor:
        """The head's hidden state [B, T, H] for tokens [B, T] at positions [B, T] with features [B, T, F].

        attend: None (causal over these T tokens: training) or a callable (k, v) -> (k, v, mask) that writes the
        new keys/values to a cache and returns what to attend (the engine's `FeatureDraftLM.forward`)."""
        config = self.config
        batch, width = tokens.shape
        attention_in, residual = self.layer_input(tokens, features, from_target)
        d = config.head_dim
        q = self.q_proj(attention_in).view(batch, width, config.num_attention_heads, d).transpose(1, 2)
        k = self.k_proj(attention_in).view(batch, width, config.num_key_value_heads, d).transpose(1, 2)
        v = self.v_proj(attention_in).view(batch, width, config.num_key_value_heads, d).transpose(1, 2)
        angles = positions[:, None, :, None].to(torch.float32) * self.inv_freq  # [B, 1, T, D/2]
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(q.dtype), torch.cat([angles.sin()] * 2, -1).to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if attend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=config.num_attention_heads != config.num_key_value_heads)
        else:
            keys, values, mask = attend(k, v)
            out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None],
                                                 enable_gqa=config.num_attention_heads != config.num_key_value_heads)
        hidden = residual + self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
        normed = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))


# --------------------------------------------------------------------------------------------------------
# Directories: ours and the published EAGLE / EAGLE-3 layouts
# --------------------------------------------------------------------------------------------------------
_RENAMES = {  # published tensor names -> this module's
    "midlayer.self_attn.": "", "midlayer.mlp.": "", "midlayer.": "", "layers.0.self_attn.": "",
    "layers.0.mlp.": "", "layers.0.": "",
}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    tensors = {}
    for file in files:
        tensors.update(torch.load(str(file), map_location="cpu", weights_only=True))
    return tensors


def _tensor_names(folder: Path) -> list[str]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        names = []
        for file in files:
            with safe_open(str(file), "pt") as handle:
                names.extend(handle.keys())
        return names
    return []


def feature_draft_kind(folder) -> str | None:
    """The kind of feature draft in `folder` ("eagle" / "eagle3"), or None for an ordinary causal LM: from
    config.json (`spectr_draft_kind`, an EAGLE architecture name, `draft_vocab_size` / `eagle_config`) or
    the tensors (a `fc.weight` beside `midlayer.*` or a one-layer `layers.0.*`)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    kind = config.get("spectr_draft_kind")
    if kind in KINDS:
        return kind
    architectures = " ".join(config.get("architectures") or []).lower()
    if "eagle3" in architectures or "eagle_config" in config or "draft_vocab_size" in config:
        return EAGLE3
    if "eagle" in architectures:
        return EAGLE
    names = _tensor_names(folder)
    if "fc.weight" in names:
        return EAGLE3 if any(n.startswith("midlayer.") for n in names) else EAGLE
    if not names and list(folder.glob("pytorch_model*.bin")) and config.get("num_hidden_layers") == 1:
        tensors = _weights(folder)
        if "fc.weight" in tensors:
            return EAGLE3 if any(n.startswith("midlayer.") for n in tensors) else EAGLE
    return None


def _target_parts(target) -> tuple[nn.Embedding, nn.Linear, object]:
    text_config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return target.get_input_embeddings(), target.get_output_embeddings(), text_config


def _read_config(folder: Path, kind: str, raw: dict, has_d2t: bool, text) -> FeatureDraftConfig:
    """The head's config from its config.json (`text`: the target's config, for what the file leaves out)."""
    missing = [key for key in ("hidden_size", "num_attention_heads", "vocab_size") if key not in raw]
    if missing and text is None:
        raise ValueError(f"{folder}: config.json lacks {missing}")
    hidden = int(raw.get("hidden_size") or text.hidden_size)
    vocab = int(raw.get("vocab_size") or text.vocab_size)
    heads = int(raw.get("num_attention_heads") or text.num_attention_heads)
    if text is not None and hidden != int(text.hidden_size):
        raise ValueError(f"{folder}: the feature draft's hidden size {hidden} is not the target's "
                         f"{text.hidden_size}: it was made for another target")
    feature_layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if feature_layers is None:  # the published defaults, which need the target's depth
        layers = int(raw.get("target_num_hidden_layers") or (text.num_hidden_layers if text is not None else -1))
        if layers < 0:
            raise ValueError(f"{folder}: the head does not say which target layers it reads (eagle_config."
                             "eagle_aux_hidden_state_layer_ids); load it with its target")
        feature_layers = [2, layers // 2, layers - 3] if kind == EAGLE3 else [layers]
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) == vocab and not has_d2t:
        draft_vocab = None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return FeatureDraftConfig(
        kind=kind, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw.get("intermediate_size") or text.intermediate_size), vocab_size=vocab,
        feature_layers=[int(i) for i in feature_layers], rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None,
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
    )


def load_feature_draft(folder, target=None, dtype: torch.dtype | None = None, device=None) -> FeatureDraftModel:
    """The feature draft in `folder` (ours, EAGLE or EAGLE-3 layout), bound to `target` (an HF causal LM: its
    embedding and output layer are shared) when given, else bound by the engine to the target it is paired
    with (`bind`). Raises ValueError naming what does not fit."""
    folder = Path(folder)
    kind = feature_draft_kind(folder)
    if kind is None:
        raise ValueError(f"{folder} is not a feature draft (no EAGLE layout found)")
    tensors = _weights(folder)
    text = _target_parts(target)[2] if target is not None else None
    config = _read_config(folder, kind, json.loads((folder / "config.json").read_text()), "d2t" in tensors, text)
    renamed = {}
    for name, tensor in tensors.items():
        for prefix, new in _RENAMES.items():
            if name.startswith(prefix):
                name = new + name[len(prefix):]
                break
        renamed[name] = tensor
    own_embed = renamed.pop("embed_tokens.weight", None)
    renamed.pop("t2d", None)
    if "d2t" in renamed:
        renamed["d2t"] = renamed["d2t"].to(torch.int64)
    if kind == EAGLE and "norm.weight" in renamed:  # some EAGLE-1 exports carry an unused norm
        renamed.pop("norm.weight")
    model = FeatureDraftModel(config)
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if m != "d2t" or config.draft_vocab_size is not None]
    if missing or unexpected:
        raise ValueError(f"{folder}: the {kind} checkpoint does not fit its config: missing {missing}, "
                         f"unexpected {unexpected}")
    if target is not None:
        parameter = target.get_output_embeddings().weight
        device, dtype = device or parameter.device, dtype or parameter.dtype
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if own_embed is not None:  # published EAGLE-1 heads ship the target's embedding: use their copy
        model._shared["embed"] = nn.Embedding.from_pretrained(own_embed.to(device=model.fc.weight.device,
                                                                           dtype=model.fc.weight.dtype), freeze=True)
        model.own_embedding = True
    return model if target is None else model.bind(target)


def save_feature_draft(model: FeatureDraftModel, folder, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` in the EAGLE-3 layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) or EAGLE-1's
    (`fc`, `layers.0.*`), plus config.json saying its kind."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "midlayer." if model.config.kind == EAGLE3 else "layers.0."
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    mlp = {"gate_proj", "up_proj", "down_proj"}
    tensors = {}
    for name, tensor in model.state_dict().items():
        top = name.split(".")[0]
        if top in attention:
            out = f"{prefix}self_attn.{name}"
        elif top in mlp:
            out = f"{prefix}mlp.{name}"
        elif top in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            out = prefix + name
        else:
            out = name
        tensors[out] = tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    ids = model.draft_ids()
    if ids is not None:
        t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
        t2d[ids.cpu()] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------------------
# The target's features
# --------------------------------------------------------------------------------------------------------
class FeatureTap:
    """Collects the target's features (HF `hidden_states` indices `layers`) from each of its forwards, by
    hooks on its decoder layers and its base model: no extra pass. After a forward, `features` is
    [B, T, n*H] (float32), for every fed token, whatever `logits_to_keep` cut from the logits."""

    def __init__(self, model: nn.Module, layers: list[int]):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        blocks = decoder.layers
        self.layers = list(layers)
        self._seen: dict[int, torch.Tensor] = {}
        self.features: torch.Tensor | None = None
        self._handles = []
        for index in sorted(set(self.layers)):
            if index < len(blocks):
                self._handles.append(blocks[index].register_forward_pre_hook(self._pre(index), with_kwargs=True))
            elif index == len(blocks):
                self._handles.append(decoder.register_forward_hook(self._final(index), with_kwargs=True))
            else:
                raise ValueError(f"feature layer {index} is outside the target's hidden states [0, {len(blocks)}]")

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._seen[index] = hidden
            if index == self.layers[-1]:
                self._collect()
        return hook

    def _final(self, index: int):
        def hook(module, args, kwargs, output):
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            self._seen[index] = hidden
            self._collect()
        return hook

    def _collect(self) -> None:
        parts = [self._seen[i] for i in self.layers]
        self.features = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).float()
        self._seen = {}

    def take(self) -> torch.Tensor:
        """The last forward's features [B, T, F] (and forget them)."""
        if self.features is None:
            raise RuntimeError("the target ran no forward since its features were last taken")
        features, self.features = self.features, None
        return features

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class FeatureDraftLM:
    """The engine's view of a feature draft (as `spectr.hf.HFCausalLM` is of a model): vocabulary, device,
    a one-layer per-row cache, and `forward` over explicit slots, positions and attention."""

    is_feature_draft = True

    def __init__(self, model: FeatureDraftModel, role: str = "draft"):
        if not getattr(model, "is_feature_draft", False):
            raise ValueError(f"{role} must be a spectr.feature_draft.FeatureDraftModel")
        self.model = model
        self.role = role
        self.config = model.config
        self.model_type = f"feature draft ({model.config.kind})"
        self.vocab_size = model.vocab_size
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.max_positions = None
        self.sliding_window = None
        self.num_layers = 1
        self.name = f"{model.config.kind} head"
        if self.device.type == "cpu":  # float32 linears over a few rows: one pass over the weights
            cpu_linear.install(model)

    @property
    def description(self) -> str:
        return f"{self.role} model {self.name} ({self.model_type})"

    def new_cache(self, batch_size: int, capacity: int):
        from spectr.hf import HFRowCache

        return HFRowCache(RowKVCache(1, batch_size, capacity, self.device))

    @torch.no_grad()
    def forward(self, tokens, features, positions, allowed, cache, write_slots, *, from_target: bool):
        """(logits [B, T, V] over the target's vocabulary, hidden [B, T, H]) for tokens written at
        `write_slots`, attending the slots `allowed` marks ([B, T, S] bool)."""
        rows = cache.rows
        rows.begin_forward(write_slots, allowed.shape[-1])

        def attend(k, v):
            keys, values = rows.write(0, k, v)
            return keys, values, allowed

        with cpu_linear.active():
            hidden = self.model(tokens, features.to(self.dtype), positions, from_target=from_target, attend=attend)
            return self.model.full_logits(hidden), hidden


# --------------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------------
class FeatureDrafter(TreeDrafter):
    """`TreeDrafter`'s interface for a feature draft.

    Per row: the head's cache over the committed tokens it has read (each with the target's true feature),
    and the pending tokens it has not read yet with their features (`pending`, `pending_features`,
    `num_pending`): after a speculative iteration, the tokens it committed (the accepted ones and the
    correction or bonus, each with the target's feature at the node before it, from the verify forward);
    after an autoregressive one, one more. `propose` feeds the pending tokens in its first forward (their
    keys enter the cache for good: `commit` advances over them), then drafts the tree with the head's own
    hidden states as features, in scratch slots after them.

    Slot of the committed token at position j: j - 1 (the first prompt token has no feature before it and
    is never read); positions are the tokens' own.
    """

    observes = True  # the loop hands it the target's features instead of counting lag for `catch_up`

    def __init__(self, model: FeatureDraftLM, cache, warp, pending_tokens: torch.Tensor, capacity: int):
        super().__init__(model, cache, warp, pending_tokens)
        batch = pending_tokens.shape[0]
        device = pending_tokens.device
        self.capacity = int(capacity)  # pending tokens a row may hold (L + 1 + autoregressive steps)
        self.pending = torch.zeros(batch, self.capacity, dtype=torch.int64, device=device)
        self.pending_features = torch.zeros(batch, self.capacity, model.model.feature_size, dtype=torch.float32,
                                            device=device)
        self.num_pending = torch.zeros(batch, dtype=torch.int64, device=device)
        self.pending_bound = 1  # host bound of max(num_pending)
        self.prompt_features = torch.zeros(batch, model.model.feature_size, dtype=torch.float32, device=device)

    def row_tensors(self) -> list[torch.Tensor]:
        return [self.pending, self.num_pending, self.pending_features, self.prompt_features]

    def host_extent(self) -> torch.Tensor:
        return torch.stack([(self.cache.rows.lengths + self.num_pending).max(), self.num_pending.max()])

    # -- admission ----------------------------------------------------------------------------
    def prefill_rows(self, rows: torch.Tensor, prompts: list[list[int]], features: torch.Tensor | None,
                     copies: list[tuple[int, int, int]]) -> None:
        """Admitted rows: rows [U] prefilled with the target's prompt features [U, P, F] (P = longest prompt
        - 1: the target's prefill), and `copies` (source slot, dest slot, prompt length - 1) whose prompt
        another row holds. A row's cache takes prompt tokens 1 .. n-2 with features 0 .. n-3; token n-1
        becomes pending with feature n-2 (the first token, and for one-token prompts the pending one, has no
        feature before it: zeros)."""
        device = self.pending.device
        rows_cache = self.cache.rows
        if len(prompts):
            width = max(len(p) for p in prompts) - 2
            lengths = torch.tensor([max(len(p) - 2, 0) for p in prompts], dtype=torch.int64, device=device)
            view = self.cache.view(rows)
            if width > 0:
                tokens = torch.tensor([(p[1:-1] + [0] * width)[:width] for p in prompts], dtype=torch.int64,
                                      device=device)  # [U, W]
                slots = torch.arange(width, device=device).expand(len(prompts), width)  # [U, W]
                causal = slots[0][:, None] >= slots[0][None, :]
                allowed = tree_attention(torch.zeros_like(lengths), causal, width)
                self.model.forward(tokens, features[:, :width], slots + 1, allowed, view, slots, from_target=True)
            view.rows.lengths = lengths
            last = torch.tensor([len(p) - 2 for p in prompts], dtype=torch.int64, device=device)  # [U]
            if features is not None and features.shape[1] > 0:
                picked = features.gather(1, last.clamp(min=0)[:, None, None].expand(-1, 1, features.shape[-1]))[:, 0]
                picked = torch.where((last >= 0)[:, None], picked, 0.0)
            else:
                picked = torch.zeros(len(prompts), self.prompt_features.shape[1], device=device)
            self.prompt_features.index_copy_(0, rows, picked)
        if copies:
            source, dest, lengths = (torch.tensor(c, dtype=torch.int64, device=device) for c in zip(*copies))
            rows_cache.copy_rows(source, dest, max(c[2] for c in copies))
            rows_cache.lengths.index_copy_(0, dest, (lengths - 1).clamp(min=0))
            self.prompt_features.index_copy_(0, dest, self.prompt_features.index_select(0, source))

    def reset(self, rows: torch.Tensor, last_tokens: torch.Tensor) -> None:
        self.pending.index_fill_(0, rows, 0)
        self.pending[rows, 0] = last_tokens
        self.pending_features.index_fill_(0, rows, 0.0)
        self.pending_features[rows, 0] = self.prompt_features.index_select(0, rows)
        self.num_pending.index_fill_(0, rows, 1)

    # -- one iteration -------------------------------------------------------------------------
    def propose(self, uniforms: torch.Tensor, extent: tuple[int, int], running: torch.Tensor):
        batch, draft_length, num_drafts = uniforms.shape
        max_base, max_pending = extent
        max_pending = max(1, max_pending)
        lengths = self.cache.rows.lengths  # [B]
        device = lengths.device
        tokens = torch.empty(batch, num_drafts, draft_length, dtype=torch.int64, device=device)
        probs = torch.empty(batch, num_drafts, draft_length, self.model.vocab_size, dtype=torch.float32,
                            device=device)

        # step 0: the pending tokens with the target's features, one root law per row
        offsets = torch.arange(max_pending, device=device)
        slots = lengths[:, None] + offsets  # [B, W]
        causal = offsets[:, None] >= offsets[None, :]
        allowed = tree_attention(lengths, causal, max_base - 1 + max_pending)
        logits, hidden = self.model.forward(self.pending[:, :max_pending], self.pending_features[:, :max_pending],
                                            slots + 1, allowed, self.cache, slots, from_target=True)
        last = (self.num_pending - 1).clamp(min=0)[:, None, None]
        root_logits = logits.gather(1, last.expand(batch, 1, logits.shape[-1]))  # [B, 1, V]
        parent = hidden.gather(1, last.expand(batch, 1, hidden.shape[-1])).expand(batch, num_drafts, -1)  # [B, K, H]
        nonfinite = nonfinite_rows(root_logits)[:, 0]
        penalised = self.warp.path_dependent
        probs[:, 0, 0] = self.warp.probs(root_logits[:, 0], root_paths(batch, device) if penalised else None)
        tokens[:, :, 0] = sample_categorical_many(probs[:, 0, 0], uniforms[:, 0])
        same = extend_same_prefix(torch.ones(batch, num_drafts, num_drafts, dtype=torch.bool, device=device),
                                  tokens[:, :, 0])
        leaders = [torch.zeros(batch, num_drafts, dtype=torch.int64, device=device), leaders_of(same)]

        # steps 1..L-1: each draft's token with its parent's hidden state as feature, in scratch slots
        base = lengths + self.num_pending
        branch = torch.arange(num_drafts, device=device)
        for depth in range(1, draft_length):
            slots = base[:, None] + (depth - 1) * num_drafts + branch  # [B, K]
            positions = (base + depth)[:, None].expand(batch, num_drafts)
            allowed = tree_attention(base, self._visibility(num_drafts, depth), max_base + depth * num_drafts)
            logits, parent = self.model.forward(tokens[:, :, depth - 1], parent, positions, allowed, self.cache,
                                                slots, from_target=False)
            nonfinite |= nonfinite_rows(logits).any(1)
            same = self._draw(logits, depth, tokens, probs, uniforms, leaders, same)
        return self._tree(tokens, probs, leaders, nonfinite, running)

    def commit(self, tree, draft_index, num_accepted, next_tokens, running, *, emitted=None, features=None) -> None:
        """The pending tokens propose fed stay in the cache; the iteration's committed tokens (`emitted`
        [B, L+1], the first num_accepted + 1 real) become pending with the target's features at the nodes
        before them (`features` [B, W, F] from the verify forward, node 0 the root)."""
        draft_length = tree.tokens.shape[2]
        self.cache.rows.advance(torch.where(running, self.num_pending, 0))
        chosen = draft_index[:, None, None].expand(-1, 1, tree.node_of.shape[2])  # [B, 1, L + 1]
        nodes = tree.node_of.gather(1, chosen)[:, 0]  # [B, L + 1] node of the prefix of length i (0: the root)
        taken = features.gather(1, nodes[:, :, None].expand(-1, -1, features.shape[-1]))  # [B, L + 1, F]
        width = draft_length + 1
        self.pending[:, :width] = torch.where(running[:, None], emitted.clamp(min=0), self.pending[:, :width])
        self.pending_features[:, :width] = torch.where(running[:, None, None], taken,
                                                       self.pending_features[:, :width])
        self.num_pending = torch.where(running, num_accepted + 1, self.num_pending)
        self.pending_bound = width

    def observe(self, tokens: torch.Tensor, features: torch.Tensor, running: torch.Tensor, view_length: int) -> None:
        """An autoregressive iteration committed `tokens` [B] after the target's `features` [B, F]: they join
        the pending tokens (first fed into the cache when the buffer is full: one forward, no host read)."""
        if self.pending_bound + 1 > self.capacity:
            self.flush(view_length)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        at = self.num_pending.clamp(max=self.capacity - 1)
        self.pending[rows, at] = torch.where(running, tokens, self.pending[rows, at])
        self.pending_features[rows, at] = torch.where(running[:, None], features, self.pending_features[rows, at])
        self.num_pending = torch.where(running, self.num_pending + 1, self.num_pending)
        self.pending_bound += 1

    def flush(self, view_length: int) -> None:
        """Feed every row's pending tokens but its newest into the cache (one forward), keeping the newest
        pending: a row then holds one pending token, as after an admission."""
        width = self.pending_bound - 1
        lengths = self.cache.rows.lengths
        device = lengths.device
        fed = (self.num_pending - 1).clamp(min=0)  # [B]
        if width > 0:
            offsets = torch.arange(width, device=device)
            slots = (lengths[:, None] + offsets).clamp(max=self.cache.rows.capacity - 1)
            causal = offsets[:, None] >= offsets[None, :]
            allowed = tree_attention(lengths, causal, min(view_length + width, self.cache.rows.capacity))
            self.model.forward(self.pending[:, :width], self.pending_features[:, :width], lengths[:, None] + offsets + 1,
                               allowed, self.cache, slots, from_target=True)
        self.cache.rows.advance(fed)
        rows = torch.arange(lengths.shape[0], device=device)
        newest = self.pending[rows, fed]
        newest_feature = self.pending_features[rows, fed]
        self.pending[:, 0] = newest
        self.pending_features[:, 0] = newest_feature
        self.num_pending = torch.where(self.num_pending > 0, 1, 0)
        self.pending_bound = 1

    def catch_up(self, recent, lag, view_length) -> None:  # pragma: no cover - the loop calls `observe` instead
        raise RuntimeError("a feature drafter is fed by observe(), never caught up")

    def prefix(self, count: int, cache) -> FeatureDrafter:
        part = object.__new__(FeatureDrafter)
        part.__dict__.update(self.__dict__)
        part.cache = cache
        part.pending = self.pending[:count]
        part.pending_features = self.pending_features[:count]
        part.num_pending = self.num_pending[:count]
        part.prompt_features = self.prompt_features[:count]
        return part

    def put_prefix(self, count: int, part: FeatureDrafter) -> None:
        self.pending[:count] = part.pending
        self.pending_features[:count] = part.pending_features
        self.num_pending[:count] = part.num_pending
        self.pending_bound = part.pending_bound
