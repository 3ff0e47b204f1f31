"""Plots of the benchmark job (matplotlib, Agg): block efficiency and speedup against K, optimality, cost model.

Not here: the numbers themselves (`tables`, `goals`).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.benchmark.config import HF_ASSISTED, HF_GENERATE
from pipeline.benchmark.goals import pooled_block_efficiency
from pipeline.benchmark.tables import SPECULATIVE

# the multi-draft lines; K = 1 joins each as the method it reduces to (traversal: block verification)
LINES = (("spectr", "-o"), ("specinfer", "--s"), ("traversal", "-.d"))
AT_ONE_DRAFT = {"spectr": "speculative", "specinfer": "speculative", "traversal": "block"}

# ---------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log2_axis(ax) -> None:
    from matplotlib.ticker import ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())


def plot_block_efficiency(results, lengths, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for method, style in LINES:
        for length in lengths:
            points = []
            one = pooled_block_efficiency(results, AT_ONE_DRAFT[method], 1, length)
            if one:
                points.append((1, one[0]))
            drafts = sorted(
                {
                    r.case.num_drafts
                    for r in results
                    if r.case.method == method and r.case.draft_length == length
                }
            )
            for k in drafts:
                value = pooled_block_efficiency(results, method, k, length)
                if value:
                    points.append((k, value[0]))
            if len(points) > 1 or (points and method == "spectr"):
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"{method} L={length}")
    _log2_axis(ax)
    ax.set_xlabel("K (drafts); K=1 is speculative sampling (traversal: block verification)")
    ax.set_ylabel("block efficiency (tokens / target call)")
    ax.set_title("Block efficiency vs K (pooled over batch sizes)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(results, batch_sizes, lengths, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(5.5 * len(batch_sizes), 4), squeeze=False,
                             layout="constrained")
    for ax, batch in zip(axes[0], batch_sizes):
        here = [r for r in results if r.ok and r.case.batch_size == batch]
        lines = [(m, style) for m, style in LINES if any(r.case.method == m for r in here)]
        for method, style in lines or [("speculative", ":^")]:  # K = 1 joins each multi-draft line
            for length in lengths:
                points = [
                    (r.case.num_drafts, r.speedup_vs_autoregressive)
                    for r in here
                    if r.speedup_vs_autoregressive
                    and r.case.draft_length == length
                    and (r.case.method == method or r.case.method == AT_ONE_DRAFT.get(method, method))
                ]
                points.sort()
                if points:  # one point (a single K) still shows as its marker
                    ax.plot(
                        [p[0] for p in points], [p[1] for p in points], style, label=f"{method} L={length}"
                    )
        for r in here:
            if r.case.method in (HF_GENERATE, HF_ASSISTED) and r.speedup_vs_autoregressive:
                ax.axhline(
                    r.speedup_vs_autoregressive,
                    linestyle=":",
                    color="gray" if r.case.method == HF_GENERATE else "black",
                )
                ax.text(1, r.speedup_vs_autoregressive, f" {r.case.method}", fontsize=7, va="bottom")
        ax.axhline(1.0, color="red", linewidth=0.8)
        _log2_axis(ax)
        ax.set_xlabel("K (drafts)")
        ax.set_ylabel("tokens/s relative to our autoregressive")
        ax.set_title(f"Speedup vs K, B={batch}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_optimality(optimality, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    ks = [row.num_drafts for row in optimality.rows]
    ax.plot(ks, [row.optimum for row in optimality.rows], "-^", label="optimum α_K")
    ax.plot(ks, [row.kseq for row in optimality.rows], "-o", label="K-SEQ (SpecTr)")
    ax.plot(ks, [row.specinfer for row in optimality.rows], "--s", label="SpecInfer")
    ax.set_xlabel("K (drafts)")
    ax.set_ylabel("mean acceptance probability")
    ax.set_title(
        f"Token-level acceptance ({optimality.num_positions} positions, {optimality.num_prompts} prompts)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cost_model(results, table, path: Path) -> None:
    from spectr.planner.table import DRAFT, TARGET

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    points = [
        (r.tokens_per_second, r.predicted_tokens_per_second, r.case)
        for r in results
        if r.ok and r.predicted_tokens_per_second
    ]
    for batch in sorted({c.batch_size for _, _, c in points}):
        chosen = [(m, p) for m, p, c in points if c.batch_size == batch]
        left.scatter([m for m, _ in chosen], [p for _, p in chosen], label=f"B={batch}", s=18)
    if points:
        high = max(max(m, p) for m, p, _ in points) * 1.1
        left.plot([0, high], [0, high], "k-", linewidth=0.8)
        left.fill_between(
            [0, high], [0, 0.75 * high], [0, 1.25 * high], color="gray", alpha=0.15, label="±25%"
        )
    left.set_xlabel("measured tokens/s")
    left.set_ylabel("predicted tokens/s")
    left.set_title("Cost model: predicted vs measured")
    left.legend(fontsize=7)
    for component, style in ((TARGET, "-o"), (DRAFT, "--s")):
        grid = table.grid(component)  # at the widest measured context
        for batch in sorted({b for b, _ in grid}):
            tokens = sorted(t[0] for b, t in grid if b == batch)
            right.plot(
                tokens,
                [1000 * grid[(batch, (t,))] for t in tokens],
                style,
                label=f"{component} B={batch}",
                markersize=3,
            )
    _log2_axis(right)
    right.set_yscale("log")
    right.set_xlabel("new tokens per row in one forward")
    right.set_ylabel("latency (ms)")
    right.set_title("Forward latency vs tokens per call")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_planner_timeline(results, path: Path) -> None:
    """`auto`: the configuration of every iteration over the first timed run, one panel per batch size,
    colored by the live rows; the title gives the token shares and the ratio to the best fixed configuration."""
    autos = [r for r in results if r.ok and r.auto is not None and r.auto.timeline]
    plt = _pyplot()
    fig, axes = plt.subplots(len(autos) or 1, 1, figsize=(9, 2.6 * max(len(autos), 1)), squeeze=False,
                             layout="constrained")
    for ax, r in zip(axes[:, 0], autos):
        labels = sorted({c for _, c, _ in r.auto.timeline}, key=lambda c: (c != "autoregressive", c))
        row_of = {c: i for i, c in enumerate(labels)}
        seconds, configs, rows = zip(*r.auto.timeline)
        points = ax.scatter(seconds, [row_of[c] for c in configs], c=rows, s=8, cmap="viridis", marker="|")
        fig.colorbar(points, ax=ax, label="live rows", pad=0.01)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        fixed = [f for f in results if f.ok and f.case.batch_size == r.case.batch_size
                 and f.case.method in ("autoregressive", *SPECULATIVE)]
        best = max(fixed, key=lambda f: f.tokens_per_second, default=None)
        ratio = f"; {r.tokens_per_second / best.tokens_per_second:.2f}x the best fixed ({best.case.label})" if best else ""
        ax.set_title(f"B={r.case.batch_size}: {r.auto.description}{ratio}", fontsize=8)
        ax.set_xlabel("seconds since the run started (first timed run)")
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
