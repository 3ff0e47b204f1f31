"""Mask time per token of llguidance and xgrammar on the embedded tokenizer (issue 50's choice of engine).

For each grammar: compile once, then walk a valid output token by token: compute the next-token bitmask,
consume the token. Prints compile time and the median / mean mask-and-consume time per token. CPU only.

    .venv/bin/python scripts/bench_grammar_masks.py [--tokenizer assets/models/target] [--repeat 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, table  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "reason": {"type": "string", "minLength": 1, "maxLength": 40}},
    "required": ["label", "score", "reason"], "additionalProperties": False}
CASES = {
    "json": (SCHEMA, '{"label": "positive", "score": 87, "reason": "the tone is warm and the plot moves"}'),
    "regex": (r"[A-Z][a-z]{2,8} [0-9]{1,3}(, [A-Z][a-z]{2,8} [0-9]{1,3}){0,3}", "Alpha 12, Beta 7, Gamma 300"),
}


def bench_llguidance(tokenizer, repeat: int) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    lltok = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer),
                                   eos_token=tokenizer.eos_token_id)
    out = {}
    for name, (spec, text) in CASES.items():
        start = time.perf_counter()
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": True})
                   if name == "json" else llguidance.LLMatcher.grammar_from_regex(spec))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        tokens = tokenizer.encode(text, add_special_tokens=False)
        bitmask = lltorch.allocate_token_bitmask(1, lltok.vocab_size)
        times = []
        for _ in range(repeat):
            matcher.reset()
            for token in tokens:
                t0 = time.perf_counter()
                lltorch.fill_next_token_bitmask(matcher, bitmask, 0)
                assert matcher.consume_token(token), (name, token)
                times.append(time.perf_counter() - t0)
        out[name] = (compile_s, statistics.median(times), statistics.fmean(times), len(tokens))
    return out


def bench_xgrammar(tokenizer, repeat: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info)
    out = {}
    for name, (spec, text) in CASES.items():
        start = time.perf_counter()
        compiled = (compiler.compile_json_schema(json.dumps(spec), any_whitespace=True) if name == "json"
                    else compiler.compile_regex(spec))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        tokens = tokenizer.encode(text, add_special_tokens=False)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        times = []
        for _ in range(repeat):
            matcher.reset()
            for token in tokens:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                assert matcher.accept_token(token), (name, token)
                times.append(time.perf_counter() - t0)
        out[name] = (compile_s, statistics.median(times), statistics.fmean(times), len(tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default="assets/models/target")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write the results here (and .md)")
    args = parser.parse_args()
    report = Report("bench_grammar_masks", args=args)
    print(report.header(), flush=True)
    rows = []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for engine, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            results = bench(tokenizer, args.repeat)
        except ImportError as error:
            print(f"{engine}: not installed ({error})")
            continue
        for name, (compile_s, median, mean, count) in results.items():
            print(f"{engine:10s} {name:6s} compile {compile_s * 1e3:8.2f} ms  mask+consume per token: median "
                  f"{median * 1e6:8.1f} us, mean {mean * 1e6:8.1f} us ({count} tokens)")
            rows.append(dict(engine=engine, grammar=name, compile_ms=compile_s * 1e3, median_us=median * 1e6,
                             mean_us=mean * 1e6, tokens=count))
    if args.json:
        report.write(args.json, dict(rows=rows), markdown=table(rows))


if __name__ == "__main__":
    main()
