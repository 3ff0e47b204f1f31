"""Per-iteration traces of every default candidate, interleaved: one batch of rows, the configuration
changing at every iteration in a fixed cycle, so that every candidate's seconds are measured under the
same machine conditions (a loaded 2-core machine moves by +-25% over minutes; a trace recorded one
configuration after another carries that drift into the ranking). An iteration that follows an
autoregressive one paid the draft's catch-up and is flagged (the chooser does not measure those).

    python benchmarks/results/chooser_replay/trace_interleaved.py B PROMPTS OUT.json   (repository root)

Output: {label: {"iterations": [[tokens, seconds, prefill_seconds, rows, after_autoregressive], ...]}}.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import spectr
from spectr.planner.chooser import default_candidates

torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained("assets/models/target")
T = AutoModelForCausalLM.from_pretrained("assets/models/target", dtype=torch.float32)
D = AutoModelForCausalLM.from_pretrained("assets/models/draft", dtype=torch.float32)
B, N, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lines = open("assets/prompts.jsonl").read().splitlines()
prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in lines[:N]]
configs = default_candidates(8, 8)
b = spectr.ContinuousBatcher(T, D, method="spectr", num_drafts=4, draft_length=4, batch_size=B, max_length=512,
                             eos_token_id=tok.eos_token_id)
b.admit(prompts, max_new_tokens=64, seed=list(range(len(prompts))))
traces = {c.label: {"iterations": []} for c in configs}
step = 0
previous = None
while not b.idle:
    config = configs[step % len(configs)]
    b.step(config)
    r = b.last_step
    if r is not None:
        after_ar = previous is not None and not previous.speculative and config.speculative
        traces[config.label]["iterations"].append([r.tokens, r.seconds, r.prefill_seconds, r.rows, after_ar])
    previous = config
    step += 1
json.dump(traces, open(out, "w"))
for label, t in traces.items():
    its = [i for i in t["iterations"] if i[3] == B and not i[4]]
    if its:
        print(f"{label:18s} n={len(its):4d} tok/it={sum(i[0] for i in its)/len(its):.2f} "
              f"s/it={sum(i[1] for i in its)/len(its)*1e3:.1f} ms  rate={sum(i[0] for i in its)/sum(i[1] for i in its):.1f}")
