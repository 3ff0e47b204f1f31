"""Writing the benchmark job's report: the text it prints and the files of its output directory.

`write_report(report)` fills `report.text` (what the job prints, also saved as benchmark.log) and writes
into `report.output_dir`:

- results.md: environment, goals (PASS/MISS with the numbers), the main table, the best configuration
  per batch size and why, the optimality table, the cost model's latencies;
- results.csv (one row per configuration), optimality.csv, latencies.csv, results.json;
- block_efficiency_vs_k.png, speedup_vs_k.png, optimality.png, cost_model.png (matplotlib, Agg).

The goals are computed from the measurements, never assumed; a goal whose configurations are not in the
grid is reported as N/A (`goals`). The tables, goals and plots are built by `tables`, `goals` and
`plots`; MLflow is `tracking`. This module measures nothing.
"""


from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

from pipeline.benchmark.goals import best_configurations, evaluate_goals
from pipeline.benchmark.plots import (
    plot_block_efficiency,
    plot_cost_model,
    plot_optimality,
    plot_planner_timeline,
    plot_speedup,
)
from pipeline.benchmark.tables import (
    latency_markdown,
    markdown_results,
    optimality_markdown,
    optimality_rows,
    optimality_text,
    result_row,
    summary_markdown,
    summary_rows,
    text_table,
)

# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in keys})


def notes(report) -> list[str]:
    g = report.config.bench
    env = report.environment
    memory = (
        "CUDA max allocated (tensors only)"
        if env["memory_kind"] == "cuda_max_allocated"
        else f"peak resident set size of the whole process, sampled every {g.memory_sample_ms:g} ms"
    )
    return [
        f"Prompts: the first prompts of {report.config.data.path}, cut to their last {g.max_prompt_tokens} tokens; "
        f"batch size B runs ceil({g.num_prompts}/B) batches of B prompts; {g.max_new_tokens} new tokens per prompt"
        + (" (EOS ignored: every method does the same work)" if g.ignore_eos else "")
        + ".",
        f"Sampling: temperature {g.temperature:g}, top_k {g.top_k}, top_p {g.top_p:g}. tokens/s is the median of "
        f"{g.repeats} timed repeats (seeds differ per repeat) after one warm-up run of {g.warmup_tokens} tokens; "
        "block efficiency and acceptance pool all repeats.",
        "Block efficiency = generated tokens / target calls (the prefill is not a call; HF runs count every target "
        "forward, whose first one also consumes the prompt). Acceptance per position j = P(draft position j "
        "accepted | reached).",
        "K=1 is speculative sampling (K-SEQ and SpecInfer both reduce to it) and is measured once as `speculative`.",
        f"¹ hf_assisted: transformers {env['transformers']} assisted generation, sampling, constant schedule of "
        f"{g.assisted_tokens} draft tokens, confidence early-stop off; batch size 1 only (transformers 5 raises "
        "for larger batches). HF rows have no time split.",
        f"Peak memory: {memory}.",
        f"Contention: process CPU time / wall time of the timed runs, median over configurations, "
        f"{_median_cpu_per_wall(report):.2f} with {env['torch_threads']} torch thread(s) (below the thread count: "
        "the process waited for a CPU; the machine is shared).",
        "Time split of our methods from spectr.generate's phase timer (prefill included in draft/target); other = "
        "wall - draft - target - selection (bookkeeping, cache commits, host syncs).",
    ]


def _median_cpu_per_wall(report) -> float:
    values = [r.cpu_per_wall for r in report.results if r.ok and r.cpu_per_wall is not None]
    return statistics.median(values) if values else float("nan")


def write_report(report) -> None:
    """Fill `report.text`, `report.goals` and `report.files`; write every file into `report.output_dir`."""
    out = report.output_dir
    rows = [result_row(r) for r in report.results]
    goals = evaluate_goals(report)
    best = best_configurations(report)
    report.text = report_text(report, rows, goals, best)
    (out / "results.md").write_text("\n".join(report_markdown(report, rows, goals, best)) + "\n")
    _write_csv(out / "results.csv", rows)
    files = [out / "results.md", out / "results.csv"] + _write_figures(report)
    summary = {
        "environment": report.environment,
        "config": report.config.to_dict(),
        "results": rows,
        "goals": [goal.__dict__ for goal in goals],
        "best": best,
        "optimality": optimality_rows(report.optimality) if report.optimality else None,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "benchmark.log").write_text(report.text + "\n")
    files += [out / "results.json", out / "benchmark.log"]
    report.files = files
    report.goals = goals


def report_text(report, rows, goals, best) -> str:
    """What the job prints (and benchmark.log holds)."""
    env = report.environment
    header = (
        f"SpecTr benchmark: target {report.config.model.target}, draft {report.config.model.draft}, "
        f"device {env['device']} ({env['torch_threads']} torch threads, {env['cpu_count']} CPUs, load average "
        f"{env['load_average_at_start']} at start, {env.get('load_average_at_end', '?')} at end), "
        f"{env.get('wall_minutes', '?')} min"
    )
    text = [header, "", text_table(rows), ""]
    text += ["Best configuration per batch size:"] + [f"  {line}" for line in best] + [""]
    text += _auto_lines(report, "  ")
    if report.optimality:
        text += [
            f"Token-level acceptance on {report.optimality.num_prompts} held-out prompts, "
            f"{report.optimality.num_positions} positions (exact, means):",
            optimality_text(report.optimality),
            "",
        ]
    text += ["Goals:"] + [f"  {goal.line()}" for goal in goals]
    text += [f"ERROR: {error}" for error in report.phase_errors]
    return "\n".join(text)


def report_markdown(report, rows, goals, best) -> list[str]:
    """results.md, as lines."""
    env = report.environment
    md = [
        "# SpecTr benchmark results",
        "",
        f"- command: `{env.get('command', 'python -m jobs.benchmark')}`",
        f"- target `{report.config.model.target}`, draft `{report.config.model.draft}`",
        f"- device: {env['device']}, {env['torch_threads']} torch threads, {env['cpu_count']} CPUs; load average "
        f"{env['load_average_at_start']} at start, {env.get('load_average_at_end', '?')} at end; "
        f"{env['platform']}, python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
        f"- started {env['started_utc']} UTC, took {env.get('wall_minutes', '?')} min",
        "",
        "## Goals",
        "",
    ]
    md += [f"- **{goal.status}** {goal.name}: {goal.detail}" for goal in goals]
    md += [f"- **ERROR** {error}" for error in report.phase_errors]
    md += ["", "## Summary", "", "Fastest K, L of each method per batch size (full grid below).", "",
           summary_markdown(summary_rows(report.results, report.config.bench.batch_sizes))]
    md += ["", "## Throughput, block efficiency, time split", "", markdown_results(rows), ""]
    md += [f"- {line}" for line in notes(report)]
    md += ["", "![block efficiency vs K](block_efficiency_vs_k.png)", "", "![speedup vs K](speedup_vs_k.png)", ""]
    md += ["## Best configuration per batch size", ""] + [f"- {line}" for line in best] + [""]
    auto = _auto_lines(report, "- ")
    if auto:
        md += ["## Planner", ""] + auto[1:]
    return md + _analysis_markdown(report)


def _auto_lines(report, bullet: str) -> list[str]:
    """What `auto` ran at each batch size and the seconds it wasted (empty without auto)."""
    lines = [
        f"{bullet}B={r.case.batch_size}: {r.auto.description}; measured {r.tokens_per_second:.1f} tok/s; "
        f"wasted {r.auto.wasted_seconds:.2f} s of {r.auto.generation_seconds:.1f} s generating"
        for r in report.results
        if r.ok and r.auto is not None
    ]
    if lines and bullet == "- ":
        lines.append(f"{bullet}the configuration of every iteration over time: ![planner timeline](planner_timeline.png)")
    return ["Planner (auto):", *lines, ""] if lines else []


def _analysis_markdown(report) -> list[str]:
    md = []
    if report.optimality:
        md += [
            "## Token-level optimality",
            "",
            f"Mean acceptance probability over {report.optimality.num_positions} positions of target-sampled "
            f"continuations of {report.optimality.num_prompts} held-out prompts (± standard error over positions). "
            "All three are exact per position: K-SEQ 1-(1-β(ρ*))^K, SpecInfer 1-Π(1-γ_i) with "
            "γ_i = Σ min(p, r_i), the optimum α_K by the sorted-prefix formula.",
            "",
            optimality_markdown(report.optimality),
            "",
            "![optimality](optimality.png)",
            "",
        ]
    if report.latencies:
        md += [
            "## Cost model",
            "",
            "Predicted tokens/s (last column of the main table) from per-call latencies measured through the "
            "engine's own forward, sampling, selection and cache code, and each run's measured target calls "
            "per row and acceptance histogram (see spectr/planner/). Forwards are measured at the "
            "cached context of each batch size's prompts (a batch attends as many slots as its longest row).",
            "",
            latency_markdown(report.latencies),
            "",
            "![cost model](cost_model.png)",
            "",
        ]
    return md


def _write_figures(report) -> list[Path]:
    """The CSVs and plots of the analyses and the grid; returns the files written."""
    out, g = report.output_dir, report.config.bench
    files = []
    if report.optimality:
        _write_csv(out / "optimality.csv", optimality_rows(report.optimality))
        plot_optimality(report.optimality, out / "optimality.png")
        files += [out / "optimality.csv", out / "optimality.png"]
    if report.latencies:
        _write_csv(out / "latencies.csv", report.latencies.rows())
        plot_cost_model(report.results, report.latencies, out / "cost_model.png")
        files += [out / "latencies.csv", out / "cost_model.png"]
    plot_block_efficiency(report.results, g.draft_lengths, out / "block_efficiency_vs_k.png")
    plot_speedup(report.results, g.batch_sizes, g.draft_lengths, out / "speedup_vs_k.png")
    files += [out / "block_efficiency_vs_k.png", out / "speedup_vs_k.png"]
    autos = [r for r in report.results if r.ok and r.auto is not None]
    if autos:
        _write_csv(out / "planner_timeline.csv", [
            {"batch_size": r.case.batch_size, "seconds": seconds, "config": config, "rows": rows}
            for r in autos for seconds, config, rows in r.auto.timeline])
        plot_planner_timeline(report.results, out / "planner_timeline.png")
        files += [out / "planner_timeline.csv", out / "planner_timeline.png"]
    return files
