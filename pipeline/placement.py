"""`model.device_map`: where the target's modules go when an actor holds several GPUs (a placement plan).

    plan = placement_plan(num_layers=32, devices=[0, 1])   # {"model.embed_tokens": 0, "model.layers.0": 0, ...}

The plan is a Hugging Face `device_map` dict over the actor's GPUs for a decoder-only model (Llama/Qwen/
Mistral module names): contiguous blocks of decoder layers, as even as possible, with the embedding (and
the rotary table) on the first GPU and the final norm and `lm_head` on the last; the embedding and the head
each weigh about one layer, so the first and last GPUs take one layer fewer when the layers do not split
evenly. `model.device_map`: null (default: the whole pair on the actor's first device) or "auto" (this
plan over every GPU Ray gives the actor).

Status: the plan is computed and checked here (tests run without GPUs); the engine's KV cache is one
buffer on one device (`spectr.kv_cache`), so loading a split target is not wired yet (see the README).
This module does not load models.
"""

from __future__ import annotations

from collections.abc import Sequence

DEVICE_MAPS = (None, "auto")


def placement_plan(num_layers: int, devices: Sequence[int], head_weight: float = 1.0) -> dict[str, int]:
    """A `device_map` dict putting `num_layers` decoder layers (and embedding / norm / head) on `devices`."""
    if num_layers < 1 or not devices:
        raise ValueError(f"placement_plan needs >= 1 layer and >= 1 device, got {num_layers} and {list(devices)}")
    count = len(devices)
    # the embedding weighs on the first device and the head on the last: give them fewer layers
    total = num_layers + 2 * head_weight
    bounds = [round(total * (k + 1) / count) for k in range(count)]
    plan: dict[str, int] = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    layer = 0
    for k, device in enumerate(devices):
        stop = num_layers if k == count - 1 else max(layer, min(num_layers, int(bounds[k] - head_weight)))
        for index in range(layer, stop):
            plan[f"model.layers.{index}"] = device
        layer = stop
    plan["model.norm"] = devices[-1]
    plan["lm_head"] = devices[-1]
    return plan


def devices_used(plan: dict[str, int]) -> list[int]:
    return sorted(set(plan.values()))
