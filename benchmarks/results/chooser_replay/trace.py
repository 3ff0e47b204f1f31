"""Record per-iteration traces (python trace.py B N out.json, from the repository root) (tokens, seconds) of every default candidate at batch B, fixed configs, embedded pair."""
import json, sys, time, torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
import spectr
from spectr.planner.chooser import default_candidates
tok = AutoTokenizer.from_pretrained("assets/models/target")
T = AutoModelForCausalLM.from_pretrained("assets/models/target", dtype=torch.float32)
D = AutoModelForCausalLM.from_pretrained("assets/models/draft", dtype=torch.float32)
B = int(sys.argv[1]); N = int(sys.argv[2]); out = sys.argv[3]
prompts = [tok(json.loads(l)["prompt"])["input_ids"] for l in open("assets/prompts.jsonl").read().splitlines()[:N]]
common = dict(batch_size=B, max_length=512, eos_token_id=tok.eos_token_id, max_num_drafts=8, max_draft_length=8)
traces = {}
for config in default_candidates(8, 8):
    b = spectr.ContinuousBatcher(T, D, method=config.method, num_drafts=max(1, config.num_drafts),
                                 draft_length=max(1, config.draft_length), **common)
    b.admit(prompts, max_new_tokens=64, seed=list(range(len(prompts))))
    t0 = time.perf_counter(); n = 0; its = []
    while not b.idle:
        for row in b.step(config):
            n += len(row.tokens)
        r = b.last_step
        if r is not None:
            its.append((r.tokens, r.seconds, r.prefill_seconds, r.rows))
    wall = time.perf_counter() - t0
    traces[config.label] = {"tok_s": n / wall, "iterations": its}
    print(f"{config.label:20s} {n / wall:6.1f} tok/s  its={len(its)} tok/it={n/len(its):.2f} "
          f"s/it={sum(i[1] for i in its)/len(its)*1e3:.1f}ms prefill={sum(i[2] for i in its):.2f}s", flush=True)
json.dump(traces, open(out, "w"))
