"""`model.device_map`: where the target's modules go when an actor holds several GPUs (a placement plan).

    plan = placement_plan(num_layers=32, devices=[0, 1])   # {"model.embed_tokens": 0, "model.layers.0": 0, ...}

The plan is a Hugging Face `device_map` dict over the actor's GPUs for a decoder-only model (Llama/Qwen/
Mistral module names): contiguous blocks of decoder layers, as even as possible, with the embedding (and
the rotary table) on the first GPU and the final norm and `lm_head` on the last; the embedding and the head
each weigh about one layer, so the first and last GPUs take one layer fewer when the layers do not split
evenly. A target with tied embeddings (`tied_head`: the head IS the embedding matrix) keeps its head on
the first GPU with the embedding; the hidden state then comes back there for the head. `model.device_map`:
null (default: the whole pair on the actor's first device) or "auto" (this plan over every GPU Ray gives
the actor, when it gives more than one; the draft stays on the first).

What uses it: `pipeline.models.target_plan` makes the plan from the target's config and the actor's GPU
count, `pipeline.models.load_model` loads the target on the host and places it with `spectr.split.dispatch`
(modules moved per the plan, forward hooks where the device changes; not accelerate), and the engine runs
it split: one KV-cache buffer per group of layers on its GPU (`spectr.kv_cache`), the hidden state moved at
group boundaries (`spectr.split`, `spectr.native`), logits, selection and sampling on the first GPU.

How it was tested: without GPUs. The plan and the loader's use of it are unit-tested on the tiny pair; the
split engine runs in tests with every group on the CPU (`tests/spectr/test_split.py`: the same tokens as
the unsplit target, one cache buffer and one commit per group). Not measured on several GPUs yet: the
prepared GPU checks (`scripts/gpu_exactness.py`, `scripts/gpu_speed.py`) run on one GPU. This module does
not load models.
"""

from __future__ import annotations

from collections.abc import Sequence

DEVICE_MAPS = (None, "auto")


def placement_plan(num_layers: int, devices: Sequence[int], head_weight: float = 1.0,
                   tied_head: bool = False) -> dict[str, int]:
    """A `device_map` dict putting `num_layers` decoder layers (and embedding / norm / head) on `devices`;
    with `tied_head` the head goes with the embedding on the first device (they are one matrix)."""
    if num_layers < 1 or not devices:
        raise ValueError(f"placement_plan needs >= 1 layer and >= 1 device, got {num_layers} and {list(devices)}")
    count = len(devices)
    # the embedding weighs on the first device and the head on the last: give them fewer layers
    total = num_layers + (1 if tied_head else 2) * head_weight
    bounds = [round(total * (k + 1) / count) for k in range(count)]
    plan: dict[str, int] = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    layer = 0
    for k, device in enumerate(devices):
        stop = num_layers if k == count - 1 else max(layer, min(num_layers, int(bounds[k] - head_weight)))
        for index in range(layer, stop):
            plan[f"model.layers.{index}"] = device
        layer = stop
    plan["model.norm"] = devices[-1]
    plan["lm_head"] = devices[0] if tied_head else devices[-1]
    return plan


def devices_used(plan: dict[str, int]) -> list[int]:
    return sorted(set(plan.values()))
