"""Tables of the benchmark job: one row per configuration, as text, Markdown and CSV rows.

Also the optimality table (acceptance of K-SEQ, SpecInfer and the optimum per K) and the cost model's
latency table. Not here: goals (`goals`), plots (`plots`), writing files (`report`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pipeline.benchmark.config import HF_ASSISTED, HF_GENERATE

MULTI_DRAFT = ("spectr", "specinfer", "traversal")
SPECULATIVE = ("speculative", "block", *MULTI_DRAFT)
# ---------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------

COLUMNS = [
    # (key, header, text width, format)
    ("method", "method", 14, "s"),
    ("batch_size", "B", 3, "d"),
    ("num_drafts", "K", 2, "k"),
    ("draft_length", "L", 2, "k"),
    ("tokens_per_s", "tok/s", 8, ".1f"),
    ("speedup_vs_autoregressive", "xAR", 5, ".2f"),
    ("speedup_vs_hf_generate", "xHF", 5, ".2f"),
    ("block_efficiency", "blk.eff", 7, ".2f"),
    ("acceptance_rate", "acc", 5, ".2f"),
    ("acceptance_per_position", "acc/position", 24, "s"),
    ("draft_pct", "draft%", 6, ".0f"),
    ("target_pct", "targ%", 5, ".0f"),
    ("selection_pct", "sel%", 4, ".0f"),
    ("other_pct", "oth%", 4, ".0f"),
    ("peak_memory_mib", "peakMiB", 7, ".0f"),
    ("predicted_tokens_per_s", "pred", 8, ".1f"),
    ("prediction_error_pct", "err%", 5, "+.0f"),
]


def result_row(r) -> dict[str, Any]:
    """One configuration as a flat dict (the CSV row; the tables format a subset of it)."""
    c = r.case
    auto = getattr(r, "auto", None)  # method auto: a mix of configurations, K and L are its bounds
    method = "spectr" if auto is not None else c.method  # auto reports its speculative iterations' acceptance
    row: dict[str, Any] = {
        "method": c.method,
        "batch_size": c.batch_size,
        "num_drafts": c.num_drafts,
        "draft_length": c.draft_length,
        "repeats": len(r.runs),
        "error": r.error or "",
    }
    if not r.ok:
        return row
    low, high = r.tokens_per_second_spread
    split = r.time_split
    has_split = c.method not in (HF_GENERATE, HF_ASSISTED)
    row.update(
        tokens_per_s=r.tokens_per_second,
        tokens_per_s_min=low,
        tokens_per_s_max=high,
        speedup_vs_autoregressive=r.speedup_vs_autoregressive,
        speedup_vs_hf_generate=r.speedup_vs_hf_generate,
        block_efficiency=r.block_efficiency,
        acceptance_rate=r.acceptance_rate if method in SPECULATIVE else None,
        acceptance_per_position=" ".join(f"{a:.2f}" for a in r.acceptance_per_position)
        if method in SPECULATIVE
        else "",
        draft_pct=100 * split["draft"] if has_split else None,
        target_pct=100 * split["target"] if has_split else None,
        selection_pct=100 * split["selection"] if has_split else None,
        other_pct=100 * split["other"] if has_split else None,
        peak_memory_mib=r.peak_memory_bytes / 2**20,
        generated_tokens=r.generated_tokens,
        target_calls=r.target_calls,
        wall_seconds_median=statistics.median(run.wall_seconds for run in r.runs),
        cpu_per_wall=r.cpu_per_wall or 0.0,
        predicted_tokens_per_s=r.predicted_tokens_per_second,
        prediction_error_pct=100 * r.prediction_error if r.prediction_error is not None else None,
    )
    predicted = r.predicted_split
    if predicted:
        row.update({f"predicted_{k}_pct": 100 * v for k, v in predicted.items()})
    if c.method == HF_ASSISTED:
        row["draft_calls"] = sum(run.draft_calls for run in r.runs)
    if auto is not None:
        row.update(auto_choice=auto.description, planner_wasted_s=auto.wasted_seconds)
    return row


def _cell(value: Any, fmt: str) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "k":
        return str(value) if value else "-"
    if fmt == "s":
        return str(value)
    if fmt == "d":
        return str(int(value))
    return format(value, fmt)


def text_table(rows: list[dict[str, Any]]) -> str:
    header = " ".join(h.rjust(w) if f != "s" else h.ljust(w) for _, h, w, f in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.get("error"):
            lines.append(
                f"{row['method']:<14} {row['batch_size']:>3} {_cell(row['num_drafts'], 'k'):>2} "
                f"{_cell(row['draft_length'], 'k'):>2}  FAILED: {row['error']}"
            )
            continue
        cells = []
        for key, _, width, fmt in COLUMNS:
            text = _cell(row.get(key), fmt)
            cells.append(text.ljust(width) if fmt == "s" else text.rjust(width))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_results(rows: list[dict[str, Any]]) -> str:
    headers = [
        "method",
        "B",
        "K",
        "L",
        "tokens/s (min-max)",
        "× our AR",
        "× HF generate",
        "block eff.",
        "accept. rate",
        "accept. per position",
        "draft / target / select / other %",
        "peak MiB",
        "predicted tok/s (err)",
    ]
    body = []
    for row in rows:
        name = row["method"] + (" ¹" if row["method"] == HF_ASSISTED else "")
        head = [name, str(row["batch_size"]), _cell(row["num_drafts"], "k"), _cell(row["draft_length"], "k")]
        if row.get("error"):
            body.append(head + [f"FAILED: {row['error']}"] + [""] * (len(headers) - 5))
            continue
        split = (
            "-"
            if row.get("draft_pct") is None
            else " / ".join(
                f"{row[k]:.0f}" for k in ("draft_pct", "target_pct", "selection_pct", "other_pct")
            )
        )
        predicted = (
            "-"
            if row.get("predicted_tokens_per_s") is None
            else (f"{row['predicted_tokens_per_s']:.1f} ({row['prediction_error_pct']:+.0f}%)")
        )
        body.append(
            head
            + [
                f"{row['tokens_per_s']:.1f} ({row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f})",
                _cell(row.get("speedup_vs_autoregressive"), ".2f"),
                _cell(row.get("speedup_vs_hf_generate"), ".2f"),
                _cell(row.get("block_efficiency"), ".2f"),
                _cell(row.get("acceptance_rate"), ".2f"),
                row.get("acceptance_per_position") or "-",
                split,
                _cell(row.get("peak_memory_mib"), ".0f"),
                predicted,
            ]
        )
    return markdown_table(headers, body)


def summary_rows(results, batch_sizes) -> list[dict[str, Any]]:
    """Per batch size: the baselines and the fastest configuration of each speculative method."""
    rows = []
    for batch in batch_sizes:
        here = [r for r in results if r.ok and r.case.batch_size == batch]
        for method in (HF_GENERATE, HF_ASSISTED, "autoregressive", *SPECULATIVE):
            chosen = [r for r in here if r.case.method == method]
            if chosen:
                rows.append(result_row(max(chosen, key=lambda r: r.tokens_per_second)))
    return rows


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    body = [[
        row["method"] + (" ¹" if row["method"] == HF_ASSISTED else ""), str(row["batch_size"]),
        _cell(row["num_drafts"], "k"), _cell(row["draft_length"], "k"), f"{row['tokens_per_s']:.1f}",
        _cell(row.get("speedup_vs_autoregressive"), ".2f"), _cell(row.get("speedup_vs_hf_generate"), ".2f"),
        _cell(row.get("block_efficiency"), ".2f"),
    ] for row in rows]
    return markdown_table(["method (fastest K, L)", "B", "K", "L", "tokens/s", "× our AR", "× HF generate",
                           "block eff."], body)


# ---------------------------------------------------------------------------------------
# optimality and latencies
# ---------------------------------------------------------------------------------------


def optimality_rows(optimality) -> list[dict[str, Any]]:
    return [
        {
            "K": row.num_drafts,
            "kseq": row.kseq,
            "specinfer": row.specinfer,
            "optimum": row.optimum,
            "kseq_over_optimum": row.kseq_ratio,
            "specinfer_over_optimum": row.specinfer_ratio,
            "kseq_stderr": row.kseq_stderr,
            "specinfer_stderr": row.specinfer_stderr,
            "optimum_stderr": row.optimum_stderr,
        }
        for row in optimality.rows
    ]


def optimality_text(optimality) -> str:
    lines = [f"{'K':>2} {'K-SEQ':>7} {'SpecInfer':>9} {'optimum':>8} {'K-SEQ/opt':>9} {'SpecInfer/opt':>13}"]
    for row in optimality.rows:
        lines.append(
            f"{row.num_drafts:>2} {row.kseq:>7.4f} {row.specinfer:>9.4f} {row.optimum:>8.4f} "
            f"{row.kseq_ratio:>9.4f} {row.specinfer_ratio:>13.4f}"
        )
    return "\n".join(lines)


def optimality_markdown(optimality) -> str:
    return markdown_table(
        ["K", "K-SEQ", "SpecInfer", "optimum α_K", "K-SEQ / α_K", "SpecInfer / α_K"],
        [
            [
                str(row.num_drafts),
                f"{row.kseq:.4f} ± {row.kseq_stderr:.4f}",
                f"{row.specinfer:.4f} ± {row.specinfer_stderr:.4f}",
                f"{row.optimum:.4f} ± {row.optimum_stderr:.4f}",
                f"{row.kseq_ratio:.4f}",
                f"{row.specinfer_ratio:.4f}",
            ]
            for row in optimality.rows
        ],
    )


def latency_markdown(table) -> str:
    """Target and draft forward latency (ms) against tokens per row per call, one column per batch size,
    one table per measured context."""
    from spectr.planner.table import DRAFT, TARGET

    parts = []
    for component in (TARGET, DRAFT):
        for context in table.contexts(component) or [None]:
            grid = table.grid(component, context)
            batches = sorted({b for b, _ in grid})
            tokens = sorted({t for _, t in grid})
            rows = [
                [str(t[0])] + [f"{1000 * grid[(b, t)]:.2f}" if (b, t) in grid else "-" for b in batches]
                for t in tokens
            ]
            where = f", {context} cached tokens" if context is not None else ""
            parts.append(
                f"**{component} forward, ms{where}** (rows: new tokens per row; columns: batch size)\n\n"
                + markdown_table(["T"] + [f"B={b}" for b in batches], rows)
            )
    return "\n\n".join(parts)
