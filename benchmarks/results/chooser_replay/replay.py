# Offline replay of the online chooser on recorded per-iteration traces (bootstrapped); see the README.
"""Offline chooser simulation from recorded per-iteration traces (bootstrap), B=1 jobs."""
import json, random, statistics as st, sys
from spectr.planner.chooser import OnlineChooser, default_candidates
from spectr.planner.prior import PriorLatencies, prior_tokens_per_second
from spectr.steps import StepConfig, StepReport
import inspect

def run(traces, total_tokens, seed, rows=1, catch_up=True):
    rng = random.Random(seed)
    lat = PriorLatencies(34087424, 2458560, 8192)
    ch = OnlineChooser(default_candidates(8, 8), lambda c, r, a: prior_tokens_per_second(lat, c, r, a))
    takes_measure = "measure" in inspect.signature(ch.observe).parameters
    done = 0; secs = 0.0; ar_run = 0
    while done < total_tokens:
        c = ch.choose(rows)
        pools = traces[c.label]
        after_ar = c.speculative and ar_run and catch_up
        if "after_ar" in pools:  # an interleaved trace: catch-up iterations were recorded as such
            use_after = pools["after_ar"] and (after_ar or not pools["iterations"])
            tok, s, _, r = rng.choice(pools["after_ar"] if use_after else pools["iterations"])[:4]
            extra = 0.0
        else:
            tok, s, _, r = rng.choice(pools["iterations"])[:4]
            extra = 0.003 + 0.0002 * min(ar_run, 80) if after_ar else 0.0
        measure = not (c.speculative and ar_run)
        ar_run = 0 if c.speculative else ar_run + 1
        acc = tok - r; L = max(c.draft_length, 1)
        rep = StepReport(config=c, rows=r, tokens=tok, seconds=s + extra, prefill_seconds=0.0,
                         accepted=acc, tested=min(L * r, acc + r) if c.speculative else 0)
        if takes_measure:
            ch.observe(rep, measure=measure)
        else:
            ch.observe(rep)
        done += tok; secs += s + extra
    return done / secs, ch

def evaluate(path, total, seeds, rows=1, **consts):
    import spectr.planner.chooser as C
    saved = {k: getattr(C, k) for k in consts}
    for k, v in consts.items(): setattr(C, k, v)
    traces = json.load(open(path))
    if any(len(i) > 4 for v in traces.values() for i in v["iterations"]):  # interleaved: [.., after_ar]
        traces = {k: {"iterations": [i for i in v["iterations"] if i[3] == rows and not i[4]],
                      "after_ar": [i for i in v["iterations"] if i[3] == rows and i[4]]} for k, v in traces.items()}
    elif rows > 1:
        traces = {k: {"iterations": [i for i in v["iterations"] if i[3] == rows]} for k, v in traces.items()}
    true = {k: sum(i[0] for i in v["iterations"] or v["after_ar"]) / sum(i[1] for i in v["iterations"] or v["after_ar"])
            for k, v in traces.items()}
    best = max(true.values())
    ratios = [run(traces, total, s, rows=rows)[0] / best for s in range(seeds)]
    for k, v in saved.items(): setattr(C, k, v)
    q = st.quantiles(ratios, n=20)
    return f"mean {st.mean(ratios):.3f} p5 {q[0]:.3f} med {st.median(ratios):.3f} <0.95: {sum(r < 0.95 for r in ratios)/len(ratios):.2f}"


if __name__ == "__main__":
    # python benchmarks/results/chooser_replay/replay.py  (from the repository root)
    here = "benchmarks/results/chooser_replay"
    print("batch 1:", evaluate(f"{here}/trace_b1.json", 640, 60))
    print("batch 8:", evaluate(f"{here}/trace_b8.json", 2048, 30, rows=8))
