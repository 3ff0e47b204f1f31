"""Feature heads compared on a real target at equal steps: one layout or loss setting per process.

Reads the completions a `jobs.train_draft` run kept (`OUT/_train_draft/completions.pt`), keeps the target's
features at every layer either layout reads and its top-`--collect-k` laws in one pass (cached in `--cache`), then trains
one head with the job's own code (`pipeline.train_draft.feature`: `build_head`, `make_batch`, `head_loss`) for
`--minutes`, printing the held-out acceptance (first drafted token, second) every `--eval-every` minutes.
Several processes with `--threads 1` side by side compare settings at equal steps (the table in
benchmarks/results/real_model/README.md):

    python scripts/compare_feature_heads.py --completions OUT/_train_draft/completions.pt --kind eagle --tag A
    python scripts/compare_feature_heads.py --completions ... --kind eagle3 --tag B
    python scripts/compare_feature_heads.py --completions ... --kind eagle3 --unroll 2 --tag F

Not the job: batches are drawn at random (the job draws seeded passes), and there is no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.train_draft import feature  # noqa: E402
from pipeline.train_draft.completions import Sequences  # noqa: E402


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", required=True, help="a jobs.train_draft run's completions.pt")
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--kind", default="eagle3", choices=["eagle", "eagle3"])
    parser.add_argument("--minutes", type=float, default=12)
    parser.add_argument("--eval-every", type=float, default=4.0, help="minutes")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--unroll", type=int, default=1)
    parser.add_argument("--reg", type=float, default=1.0, help="regression weight (eagle)")
    parser.add_argument("--prompt-pos", action="store_true", help="the loss also reads the prompts' positions")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default="/tmp/feature_heads_cache.pt")
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--bf16", action="store_true", help="the head's steps under CPU autocast to bfloat16")
    parser.add_argument("--top-k", type=int, default=32, help="the target's top-k law the loss reads (train.top_k)")
    parser.add_argument("--collect-k", type=int, default=256, help="the top-k kept in --cache (>= every --top-k)")
    parser.add_argument("--freeze-head", action="store_true", help="the output rows stay the target's "
                        "(draft.train_lm_head=false)")
    parser.add_argument("--tag", default="x")
    return parser.parse_args()


def features(target, train_set: Sequences, kind: str, cache: Path, collect_k: int, top_k: int) -> feature.FeatureSet:
    """The target's features at the layers of both layouts and its top-`collect_k` laws (one pass, cached), cut
    to `kind`'s features and the top `top_k`."""
    layers = feature.feature_layers(target.config, "eagle3") + feature.feature_layers(target.config, "eagle")
    if cache.exists():
        data = feature.FeatureSet(**torch.load(cache, weights_only=True))
    else:
        start = time.monotonic()
        data = feature.collect(target, train_set, layers, 1.0, collect_k, "cpu")
        print("collect", round(time.monotonic() - start), "s", flush=True)
        torch.save(vars(data), cache)
    size = target.config.hidden_size
    if top_k > data.top_ids[0].shape[-1]:
        raise SystemExit(f"--top-k {top_k} is more than the {data.top_ids[0].shape[-1]} kept in {cache}")
    data.top_ids = [t[:, :top_k].contiguous() for t in data.top_ids]  # torch.topk: sorted, so a prefix
    data.top_log_probs = [t[:, :top_k].contiguous() for t in data.top_log_probs]
    data.features = [f[:, -size:].contiguous() if kind == "eagle" else f[:, :3 * size].contiguous()
                     for f in data.features]
    return data


def main() -> None:
    a = options()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval().requires_grad_(False)
    saved = torch.load(a.completions, weights_only=True)
    train_set, heldout = Sequences(**saved["train"]), Sequences(**saved["heldout"])
    data = features(target, train_set, a.kind, Path(a.cache), a.collect_k, a.top_k)
    eos = target.config.eos_token_id
    ids = feature.frequent_tokens(train_set, a.vocab, target.config.vocab_size, [eos] if isinstance(eos, int) else eos)
    head = feature.build_head(target, a.kind, ids, "target", 0)
    index = feature.draft_index(head)
    if a.freeze_head and head.lm_head is not None:
        head.lm_head.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)

    def evaluate():
        head.eval()
        result = feature.heldout_acceptance(target, head, heldout, 1.0, "cpu")
        head.train()
        return result

    budget, start, next_eval, step, log = a.minutes * 60, time.monotonic(), a.eval_every * 60, 0, []
    while time.monotonic() - start < budget:
        elapsed = time.monotonic() - start
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        for group in optimizer.param_groups:
            group["lr"] = a.lr * min(1.0, (step + 1) / 50) * cosine
        rows = torch.randint(0, len(data), (a.batch,), generator=generator).tolist()
        batch = feature.make_batch(data, rows, "cpu", head.config.hidden_size, a.prompt_pos)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss, parts = feature.head_loss(head, batch, index, a.unroll, a.reg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            print(step, f"{elapsed:.0f}s", f"{float(loss):.3f}", {k: round(v, 3) for k, v in parts.items()}, flush=True)
        if elapsed >= next_eval:
            paused = time.monotonic()
            log.append((step, elapsed, evaluate()))
            start += time.monotonic() - paused  # the measure is not training time
            print("EVAL", *log[-1], flush=True)
            next_eval += a.eval_every * 60
    log.append((step, time.monotonic() - start, evaluate()))
    print("FINAL", a.tag, *log[-1], flush=True)
    Path(a.out, f"heads_{a.tag}.json").write_text(json.dumps({"args": vars(a), "log": log}))


if __name__ == "__main__":
    main()
