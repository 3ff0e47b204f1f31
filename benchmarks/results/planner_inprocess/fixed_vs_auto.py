"""auto against fixed configurations inside one process at batch 1 (see result.txt for the command)."""
import json, torch, sys, itertools, statistics
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
import spectr
t = AutoModelForCausalLM.from_pretrained("assets/models/target").eval()
d = AutoModelForCausalLM.from_pretrained("assets/models/draft").eval()
tok = AutoTokenizer.from_pretrained("assets/models/target")
texts = [json.loads(l)["prompt"] for l in open("assets/prompts.jsonl")]
ids = [tok(x)["input_ids"] for x in texts][:10]
B = int(sys.argv[1]); confs = [("autoregressive",1,1),("block",1,2),("block",1,3),("block",1,4),("speculative",1,1),("spectr",2,2),("auto",8,8)]
res = {c: [] for c in confs}
for r in range(int(sys.argv[2])):
    for c in confs:
        m, K, L = c
        out = spectr.generate(t, d, ids, method=m, num_drafts=K, draft_length=L, max_new_tokens=64, batch_size=B, seed=r, eos_token_id=tok.eos_token_id)
        n = sum(len(x) for x in out.tokens)
        res[c].append(n / out.stats.wall_seconds)
for c, v in res.items():
    print(c, "median %.1f" % statistics.median(v), ["%.1f" % x for x in v])
