"""Goals of the benchmark job, computed from the measurements (PASS / MISS / N/A), and the best configuration.

A goal whose configurations are not in the grid is N/A; nothing is assumed. Not here: tables, plots.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pipeline.benchmark.config import AUTO, HF_ASSISTED, HF_GENERATE, BenchCase
from pipeline.benchmark.tables import SPECULATIVE

GOAL_BLOCK_EFFICIENCY_RATIO = 1.1
GOAL_COST_MODEL_ERROR = 0.25

# ---------------------------------------------------------------------------------------
# goals and the best configuration
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    name: str
    status: str  # PASS | MISS | N/A
    detail: str

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def pooled_block_efficiency(results, method: str, drafts: int, length: int) -> tuple[float, int] | None:
    chosen = [
        r
        for r in results
        if r.ok and r.case.method == method and r.case.num_drafts == drafts and r.case.draft_length == length
    ]
    calls = sum(r.target_calls for r in chosen)
    if not calls:
        return None
    return sum(r.generated_tokens for r in chosen) / calls, calls


GOAL_AUTO_VS_BEST = 0.95  # auto's tokens/s against the best fixed configuration of the grid
GOAL_AUTO_WASTED_SHARE = 0.03  # generation seconds whose tokens were not kept
IDENTITY_SHARE = 0.95  # auto "ran" a configuration when that configuration made this share of its tokens


def evaluate_goals(report) -> list[Goal]:
    """The benchmark's goals, each PASS / MISS from the measurements, or N/A when not in the grid.

    The planner's two goals are listed only when the grid has `auto`."""
    goals = [
        block_efficiency_goal(report),
        optimality_goal(report),
        speculation_pays_goal(report),
        cost_model_goal(report),
    ]
    if any(r.case.method == "block" for r in report.results):
        goals.append(block_verification_goal(report))
    if any(r.case.method == AUTO for r in report.results):
        goals += [auto_speed_goal(report), auto_wasted_goal(report)]
    return goals


GOAL_BLOCK_VS_TOKEN = 1.05  # block verification's block efficiency over token verification's, same L


def block_verification_goal(report) -> Goal:
    """Block verification >= 1.05x the block efficiency of speculative sampling at L = 4 and L = 8."""
    g = report.config.bench
    name = (f"block efficiency of block >= {GOAL_BLOCK_VS_TOKEN:g}x speculative at L=4 and L=8, "
            f"temperature {g.temperature:g}")
    parts, ok, found = [], True, False
    for length in (4, 8):
        block = pooled_block_efficiency(report.results, "block", 1, length)
        token = pooled_block_efficiency(report.results, "speculative", 1, length)
        if not (block and token):
            continue
        found = True
        ratio = block[0] / token[0]
        ok = ok and ratio >= GOAL_BLOCK_VS_TOKEN
        parts.append(f"L={length}: {block[0]:.3f} vs {token[0]:.3f} = {ratio:.3f}x ({block[1]} and {token[1]} calls)")
    if not found:
        return Goal(name, "N/A", "block and speculative at L=4 or L=8 not both in this grid")
    return Goal(name, "PASS" if ok else "MISS", "; ".join(parts))


def _auto_results(report) -> list:
    return [r for r in report.results if r.ok and r.case.method == AUTO and r.auto is not None]


def auto_speed_goal(report) -> Goal:
    """5) at each batch size: auto >= 0.95x the best fixed configuration of ours, and >= autoregressive."""
    name = (f"auto >= {GOAL_AUTO_VS_BEST:g}x the best fixed configuration of the grid and >= autoregressive, "
            "at every batch size")
    autos = _auto_results(report)
    if not autos:
        return Goal(name, "N/A", "auto did not run")
    parts, ok = [], True
    for r in autos:
        fixed = [f for f in report.results if f.ok and f.case.batch_size == r.case.batch_size
                 and f.case.method in ("autoregressive", *SPECULATIVE)]
        if not fixed:
            continue
        best = max(fixed, key=lambda f: f.tokens_per_second)
        ratio = r.tokens_per_second / best.tokens_per_second
        vs_ar = r.speedup_vs_autoregressive
        # auto running (almost only) the comparator's own configuration meets the goal by identity; the
        # measured ratio is then two timings of one configuration (the run-to-run noise), reported as such
        best_same, ar_same = _same(r.auto, best.case), _same(r.auto, BenchCase("autoregressive", 1))
        ok = ok and (best_same or ratio >= GOAL_AUTO_VS_BEST) and (ar_same or vs_ar is None or vs_ar >= 1.0 - 1e-9)
        ar_text = f", {vs_ar:.2f}x autoregressive" if vs_ar is not None else ""
        noise = " (the same configuration: the ratio is run-to-run noise)" if best_same or ar_same else ""
        parts.append(f"B={r.case.batch_size}: {r.auto.description}; {r.tokens_per_second:.1f} tok/s "
                     f"= {ratio:.2f}x the best fixed ({best.case.label}, {best.tokens_per_second:.1f}){ar_text}{noise}")
    if not parts:
        return Goal(name, "N/A", "no fixed configuration of ours at auto's batch sizes")
    return Goal(name, "PASS" if ok else "MISS", "; ".join(parts))


def _same(auto, case) -> bool:
    """Whether auto ran the grid configuration `case` (same method, K and L) for >= IDENTITY_SHARE of its tokens."""
    label, share = auto.dominant
    if share < IDENTITY_SHARE:
        return False
    if case.method == "autoregressive":
        return label == "autoregressive"
    if case.method in ("speculative", "block"):
        return label == f"{case.method} L={case.draft_length}"
    return label == f"{case.method} K={case.num_drafts} L={case.draft_length}"


def auto_wasted_goal(report) -> Goal:
    """6) generation seconds whose tokens were not kept <= 3% of auto's generation seconds."""
    name = f"auto's wasted seconds (tokens not kept) <= {GOAL_AUTO_WASTED_SHARE:.0%} of its generation time"
    autos = _auto_results(report)
    if not autos:
        return Goal(name, "N/A", "auto did not run")
    shares = [(r, r.auto.wasted_seconds / r.auto.generation_seconds if r.auto.generation_seconds else 0.0)
              for r in autos]
    status = "PASS" if all(share <= GOAL_AUTO_WASTED_SHARE for _, share in shares) else "MISS"
    detail = ", ".join(f"B={r.case.batch_size}: {r.auto.wasted_seconds:.2f} s of {r.auto.generation_seconds:.1f} s "
                       f"({100 * share:.1f}%)" for r, share in shares)
    return Goal(name, status, detail)


def block_efficiency_goal(report) -> Goal:
    """1) block efficiency K=4, L=4 vs K=1, L=4 (pooled over batch sizes and repeats)."""
    results, g = report.results, report.config.bench
    name = f"block efficiency spectr K=4 L=4 >= {GOAL_BLOCK_EFFICIENCY_RATIO}x speculative (K=1) L=4, temperature {g.temperature:g}"
    many = pooled_block_efficiency(results, "spectr", 4, 4)
    one = pooled_block_efficiency(results, "speculative", 1, 4)
    if not (many and one):
        return Goal(name, "N/A", "spectr K=4 L=4 or speculative L=4 not in this grid")
    ratio = many[0] / one[0]
    status = "PASS" if ratio >= GOAL_BLOCK_EFFICIENCY_RATIO else "MISS"
    detail = (
        f"{many[0]:.3f} vs {one[0]:.3f} tokens per target call = {ratio:.3f}x "
        f"({many[1]} and {one[1]} target calls, pooled over batch sizes and repeats)"
    )
    if g.temperature != 1.0:
        detail += f"; NOTE the goal is stated at temperature 1, this run used {g.temperature:g}"
    return Goal(name, status, detail)


def optimality_goal(report) -> Goal:
    """2) K-SEQ >= SpecInfer at every K."""
    name = "mean K-SEQ acceptance >= SpecInfer for every K"
    if not report.optimality:
        return Goal(name, "N/A", "optimality analysis disabled")
    rows = report.optimality.rows
    worst = min(rows, key=lambda row: row.kseq - row.specinfer)
    status = "PASS" if all(row.kseq >= row.specinfer - 1e-9 for row in rows) else "MISS"  # float64 round-off at K=1
    return Goal(
        name,
        status,
        "K-SEQ - SpecInfer per K: "
        + ", ".join(f"K={row.num_drafts}: {row.kseq - row.specinfer:+.4f}" for row in rows)
        + f" (smallest at K={worst.num_drafts}; {report.optimality.num_positions} positions)",
    )


def speculation_pays_goal(report) -> Goal:
    """3) best spectr/speculative beats our autoregressive at B = 1."""
    results = report.results
    name = "best spectr or speculative beats our autoregressive tokens/s at B=1"
    autoregressive = [
        r for r in results if r.ok and r.case.method == "autoregressive" and r.case.batch_size == 1
    ]
    candidates = [
        r for r in results if r.ok and r.case.method in ("spectr", "speculative") and r.case.batch_size == 1
    ]
    if not (autoregressive and candidates):
        return Goal(name, "N/A", "no B=1 autoregressive or spectr/speculative configuration in this grid")
    best = max(candidates, key=lambda r: r.tokens_per_second)
    base = autoregressive[0].tokens_per_second
    status = "PASS" if best.tokens_per_second > base else "MISS"
    return Goal(
        name,
        status,
        f"{best.case.label}: {best.tokens_per_second:.1f} tok/s vs autoregressive "
        f"{base:.1f} tok/s = {best.tokens_per_second / base:.2f}x",
    )


def cost_model_goal(report) -> Goal:
    """4) cost model within 25% for every configuration of our methods."""
    name = f"cost model within {GOAL_COST_MODEL_ERROR:.0%} of measured tokens/s (every configuration of our methods)"
    errors = [(abs(r.prediction_error), r) for r in report.results if r.ok and r.prediction_error is not None]
    if not errors:
        return Goal(name, "N/A", "cost model disabled")
    worst_error, worst = max(errors, key=lambda e: e[0])
    within = sum(1 for e, _ in errors if e <= GOAL_COST_MODEL_ERROR)
    status = "PASS" if worst_error <= GOAL_COST_MODEL_ERROR else "MISS"
    return Goal(
        name,
        status,
        f"{within}/{len(errors)} within; median |error| {100 * statistics.median(e for e, _ in errors):.1f}%, "
        f"worst {100 * worst_error:.1f}% ({worst.case.label})",
    )


def best_configurations(report) -> list[str]:
    """Per batch size: the fastest configuration and why, in the cost model's terms."""
    lines = []
    table = report.latencies
    for batch in report.config.bench.batch_sizes:
        here = [r for r in report.results if r.ok and r.case.batch_size == batch]
        if not here:
            continue
        best = max(here, key=lambda r: r.tokens_per_second)
        ours = [r for r in here if r.case.method not in (HF_GENERATE, HF_ASSISTED)]
        best_ours = max(ours, key=lambda r: r.tokens_per_second) if ours else None
        text = f"B={batch}: fastest is {best.case.label} at {best.tokens_per_second:.1f} tok/s"
        if best.speedup_vs_autoregressive:
            text += f" ({best.speedup_vs_autoregressive:.2f}x our autoregressive)"
        text += "."
        if best_ours is not None and best_ours is not best:
            text += f" Fastest of ours: {best_ours.case.label} at {best_ours.tokens_per_second:.1f} tok/s."
        if (
            table is not None
            and best_ours is not None
            and any(r.case.method == "autoregressive" for r in ours)
        ):
            text += " " + _why(table, best_ours, ours, batch)
        lines.append(text)
    return lines


def _ms_per_token(result) -> float:
    """Median over repeats of wall milliseconds per generated token (amortised over the batch)."""
    return 1000 * statistics.median(r.wall_seconds / max(r.generated_tokens, 1) for r in result.runs)


def _why(table, best, ours, batch: int) -> str:
    from spectr.planner.table import DRAFT, TARGET

    autoregressive = next(r for r in ours if r.case.method == "autoregressive")
    speculative = [r for r in ours if r.case.method in SPECULATIVE and r.predicted_split]
    explained = (
        best
        if best.case.method in SPECULATIVE
        else (max(speculative, key=lambda r: r.tokens_per_second) if speculative else None)
    )
    if explained is None:
        return ""
    k, length = explained.case.num_drafts, explained.case.draft_length
    nodes = 1 + k * length
    context = explained.context
    one = table.at(TARGET, batch, (1,), context)
    tree = table.at(TARGET, batch, (nodes,), context)
    drafting = table.at(DRAFT, batch, (1,), context) + (length - 1) * table.at(DRAFT, batch, (k,), context)
    split = explained.predicted_split
    text = (
        f"one target call over {batch}x{nodes} tokens (K={k}, L={length}) costs {1000 * tree:.1f} ms = "
        f"{tree / one:.2f}x a {batch}x1-token call ({1000 * one:.1f} ms) and yields {explained.block_efficiency:.2f} "
        f"tokens per row; the {length} draft steps add {1000 * drafting:.1f} ms per iteration; predicted split "
        f"draft {100 * split['draft']:.0f}% / target {100 * split['target']:.0f}% / selection "
        f"{100 * split['selection']:.0f}% / other {100 * split['other']:.0f}%; {_ms_per_token(explained):.2f} ms per token vs "
        f"{_ms_per_token(autoregressive):.2f} ms autoregressive"
    )
    if explained is best:
        return f"Why: {text}."
    step = (tree + drafting) / one
    return (f"Why not speculative here: for the fastest speculative configuration, {explained.case.label}, {text}. "
            f"So one draft+verify iteration costs {step:.2f} autoregressive steps (forwards only) and yields "
            f"{explained.block_efficiency:.2f} tokens per row.")
