"""B=16 phase profile: eager vs compiled speculative L=3 and AR on 32 default prompts."""
import json, os, sys, time
import torch, transformers
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../..")))
import spectr
torch.set_num_threads(1)
R = sys.path[0]
load = transformers.AutoModelForCausalLM.from_pretrained
target = load(f"{R}/assets/models/target", dtype=torch.float32).eval()
draft = load(f"{R}/assets/models/draft", dtype=torch.float32).eval()
tok = transformers.AutoTokenizer.from_pretrained(f"{R}/assets/models/target")
texts = [json.loads(l)["prompt"] for _, l in zip(range(32), open(f"{R}/assets/prompts.jsonl"))]
prompts = [tok(t)["input_ids"] for t in texts]
def run(m, l, comp):
    t = time.perf_counter()
    out = spectr.generate(target, draft, prompts, method=m, draft_length=l, max_new_tokens=64,
                          seed=list(range(len(prompts))), compile=comp, batch_size=16)
    w = time.perf_counter() - t
    s = out.stats; n = sum(len(x) for x in out.tokens); it = s.iterations
    return f"{m} L={l} compiled={comp}: {n/w:.1f} tok/s it {it} tok/it {n/it:.2f} per-it ms: draft {1e3*s.draft_seconds/it:.2f} target {1e3*s.target_seconds/it:.2f} sel {1e3*s.selection_seconds/it:.2f} other {1e3*s.other_seconds/it:.2f} wall {1e3*w/it:.2f} comp {s.compile_seconds:.1f}"
arms = [("autoregressive", 1), ("speculative", 3)]
for m, l in arms:
    for c in (False, True): run(m, l, c)
for r in range(2):
    for m, l in arms:
        for c in (False, True): print(run(m, l, c), flush=True)
