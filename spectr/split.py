"""A model split over several devices (`model.device_map`): placing its modules, and its groups of layers.

    dispatch(model, {"model.embed_tokens": 0, "model.layers.0": 0, ..., "model.norm": 1, "lm_head": 1})
    layer_groups(model, num_layers)   # ((0, 16, cuda:0), (16, 32, cuda:1))

A *group* is a contiguous run of decoder layers on one device. `layer_groups` reads them from the
model's `hf_device_map` (the attribute Hugging Face sets when it loads with `device_map=`, and that
`dispatch` sets): consecutive layers with the same map entry form a group, on the device of its
first layer's parameters. A model without a map (or with one entry) is one group: the engine then
runs exactly as on one device. The KV cache keeps one buffer per group on the group's device
(`spectr.kv_cache`); the engine's own tensors (lengths, selection, sampling, rng, the draft) stay on
the engine's device, the device of the first parameter (the embedding).

Who moves the activations (the decision): not accelerate. `dispatch` moves each module named in a
device_map (HF's format: {module name: device}; `pipeline.placement` writes one) to its device,
records the map as `hf_device_map`, and registers plain torch forward pre-hooks on the few modules
where the device changes (the first layer of each group; the norm or head when they sit elsewhere):
each moves the tensors among its module's arguments (hidden state, mask, position ids, rotary
cos/sin) to the module's device. So HF's own forward (`spectr.hf`'s eager path, any architecture)
runs across devices, and its logits are moved back to the engine's device by `HFCausalLM.forward`.
The native core (`spectr.native`) does not rely on the hooks: it moves its hidden state and masks
itself at group boundaries (a no-op `.to` on one device) and its logits back. Accelerate's
`from_pretrained(device_map=...)` was not used: it is one more dependency, and it hooks every
submodule (q_proj, ...), which the compiled native core would then trace through; torch's own
module hooks are one per boundary and dynamo traces them.

Not here: the placement plan (`pipeline.placement`), loading weights (`pipeline.models`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Group = tuple[int, int, torch.device]  # (first layer, stop, device)


def moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself when it is there (no `.to` call, so nothing a sync counter would see)."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def device_of(key: Any) -> torch.device:
    """The torch device of a device_map entry: an int is a CUDA index (as in HF's maps), else a device name."""
    return torch.device("cuda", key) if isinstance(key, int) else torch.device(key)


def dispatch(model: torch.nn.Module, device_map: Mapping[str, Any],
             devices: Mapping[Any, torch.device | str] | None = None) -> torch.nn.Module:
    """Place `model`'s modules per `device_map` ({module name: device key}, in forward order) and hook the
    boundaries (see the module docstring). devices: device key -> device (default `device_of`); tests map
    two keys to the CPU to run the split path without GPUs. Returns `model`, with `hf_device_map` set."""
    modules = dict(model.named_modules())
    unknown = [name for name in device_map if name not in modules]
    if unknown:
        raise ValueError(f"device_map names modules the model does not have: {unknown[:3]}")
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    uncovered = [name for name, _ in tensors if _entry(device_map, name) is None]
    if uncovered:
        raise ValueError(f"device_map leaves parameters without a device: {uncovered[:3]}")
    placed: dict[int, tuple[str, str]] = {}  # a tensor shared by two modules (tied embeddings) has one device
    for name, tensor in tensors:
        key = str(_entry(device_map, name))
        if placed.setdefault(id(tensor), (name, key))[1] != key:
            raise ValueError(f"{name} is shared with {placed[id(tensor)][0]} (tied weights) but the device_map "
                             f"puts them on {key} and {placed[id(tensor)][1]}: give them one device")

    def resolve(key: Any) -> torch.device:
        return torch.device(devices[key]) if devices is not None else device_of(key)

    previous = None
    for name, key in device_map.items():
        modules[name].to(resolve(key))
        if previous is not None and key != previous:
            modules[name].register_forward_pre_hook(_mover(resolve(key)), with_kwargs=True)
        previous = key
    model.hf_device_map = dict(device_map)
    return model


def layer_groups(model: torch.nn.Module, num_layers: int) -> tuple[Group, ...]:
    """((start, stop, device), ...): the contiguous runs of decoder layers with one `hf_device_map` entry and
    one device; ((0, num_layers, device of the first parameter),) for a model on one device."""
    device = next(model.parameters()).device
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(set(map(str, device_map.values()))) < 2:
        return ((0, num_layers, device),)  # one device: nothing else is looked at
    layers = _decoder_layers(model)
    if layers is None or len(layers) != num_layers:
        raise ValueError(f"a model split by its device_map must expose its {num_layers} decoder layers as "
                         "get_decoder().layers (as HF's Llama / Qwen / Mistral / GPT-NeoX do)")
    names = {id(module): name for name, module in model.named_modules()}
    groups: list[list] = []
    previous = None
    for index, layer in enumerate(layers):
        parameter = next(layer.parameters(), None)
        here = device if parameter is None else parameter.device
        if here.type == "meta":
            raise ValueError(f"decoder layer {index} is offloaded (device_map entry "
                             f"{_entry(device_map, names[id(layer)])!r}); a split model must be on devices")
        key = (str(_entry(device_map, names[id(layer)])), here)
        if key != previous:
            groups.append([index, index + 1, here])
        else:
            groups[-1][1] = index + 1
        previous = key
    return tuple((start, stop, where) for start, stop, where in groups)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder's layers (`get_decoder().layers`, as in HF's Llama/Qwen/Mistral/GPT-NeoX), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def _entry(device_map: Mapping[str, Any], name: str) -> Any:
    """The device_map entry that covers module/parameter `name` (the longest matching prefix), or None."""
    best = None
    for key in device_map:
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return None if best is None else device_map[best]


def _mover(device: torch.device):
    """A forward pre-hook (with kwargs) moving the tensors among a module's arguments to `device`."""

    def hook(module, args, kwargs):
        return _to(args, device), _to(kwargs, device)

    return hook


def _to(value: Any, device: torch.device) -> Any:
    """`value` with its tensors (also inside plain tuples, lists and dicts) on `device`; other objects as is."""
    if isinstance(value, torch.Tensor):
        return moved(value, device)
    if type(value) in (tuple, list):
        return type(value)(_to(v, device) for v in value)
    if type(value) is dict:
        return {k: _to(v, device) for k, v in value.items()}
    return value
