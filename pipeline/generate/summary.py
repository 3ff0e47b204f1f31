"""Aggregating shard statistics into the job's metrics, the summary table, and the plot.

`JobSummary.build` combines the manifest's per-shard stats (all shards, including those an earlier run
finished) with this run's timings. The metric names are the MLflow contract of docs/architecture.md. This module
does not log (that is `pipeline.generate.tracking`) and does not run anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.generate.stats import empty_stats, merge_stats


@dataclass
class JobSummary:
    # the contract metrics
    throughput_tokens_per_s: float
    block_efficiency: float
    acceptance_rate: float
    generated_tokens: int
    target_calls: int
    prompts_completed: int
    prompts_failed: int
    wall_time_s: float
    # context
    num_prompts: int
    prompts_this_run: int
    generated_tokens_this_run: int
    generation_s: float  # this run: first shard dispatched -> last shard written
    startup_s: float  # this run: from start to the first shard dispatched (checks, Ray, model loading)
    overhead_s: float  # wall_time_s - generation_s
    num_actors: int
    actor_device: str
    accepted_per_position: list[int] = field(default_factory=list)
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    seconds_by_phase: dict[str, float] = field(default_factory=dict)  # inside spectr.generate, all shards
    output_dir: str = ""
    num_shards: int = 0

    @classmethod
    def build(
        cls,
        shard_stats: list[dict[str, Any]],
        this_run_stats: list[dict[str, Any]],
        *,
        num_prompts: int,
        wall_time_s: float,
        generation_s: float,
        startup_s: float,
        num_actors: int,
        actor_device: str,
        output_dir: str,
        num_shards: int,
    ) -> JobSummary:
        total = empty_stats()
        for stats in shard_stats:
            merge_stats(total, stats)
        this_run = empty_stats()
        for stats in this_run_stats:
            merge_stats(this_run, stats)
        tested = total["tested_positions"]
        return cls(
            throughput_tokens_per_s=this_run["generated_tokens"] / generation_s if generation_s > 0 else 0.0,
            block_efficiency=total["generated_tokens"] / total["target_calls"]
            if total["target_calls"]
            else 0.0,
            acceptance_rate=sum(total["accepted_per_position"]) / tested if tested else 0.0,
            generated_tokens=int(total["generated_tokens"]),
            target_calls=int(total["target_calls"]),
            prompts_completed=int(total["prompts_completed"]),
            prompts_failed=int(total["prompts_failed"]),
            wall_time_s=wall_time_s,
            num_prompts=num_prompts,
            prompts_this_run=int(this_run["prompts_completed"] + this_run["prompts_failed"]),
            generated_tokens_this_run=int(this_run["generated_tokens"]),
            generation_s=generation_s,
            startup_s=startup_s,
            overhead_s=max(0.0, wall_time_s - generation_s),
            num_actors=num_actors,
            actor_device=actor_device,
            accepted_per_position=list(total["accepted_per_position"]),
            tokens_per_call_histogram=list(total["tokens_per_call_histogram"]),
            seconds_by_phase={
                "draft": total["draft_seconds"],
                "target": total["target_seconds"],
                "selection": total["selection_seconds"],
                "other": total["other_seconds"],
            },
            output_dir=output_dir,
            num_shards=num_shards,
        )

    @property
    def failed_fraction(self) -> float:
        return self.prompts_failed / self.num_prompts if self.num_prompts else 0.0

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics: the contract names, plus the time split."""
        names = (
            "throughput_tokens_per_s",
            "block_efficiency",
            "acceptance_rate",
            "generated_tokens",
            "target_calls",
            "prompts_completed",
            "prompts_failed",
            "wall_time_s",
            "generation_s",
            "startup_s",
            "overhead_s",
            "num_actors",
        )
        return {name: float(getattr(self, name)) for name in names}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        phases = self.seconds_by_phase
        phase_total = sum(phases.values()) or 1.0
        split = " | ".join(f"{name} {100 * seconds / phase_total:.0f}%" for name, seconds in phases.items())
        earlier = self.num_prompts - self.prompts_this_run
        lines = [
            (
                "prompts",
                f"{self.num_prompts} ({self.prompts_completed} completed, {self.prompts_failed} failed"
                + (f"; {earlier} done by an earlier run)" if earlier else ")"),
            ),
            ("generated tokens", f"{self.generated_tokens}"),
            ("target calls", f"{self.target_calls}"),
            ("block efficiency", f"{self.block_efficiency:.3f} tokens per target call"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("throughput", f"{self.throughput_tokens_per_s:.1f} tokens/s over this run's generation"),
            (
                "wall time",
                f"{self.wall_time_s:.1f} s = startup {self.startup_s:.1f} s + generation "
                f"{self.generation_s:.1f} s + finish {max(0.0, self.wall_time_s - self.startup_s - self.generation_s):.1f} s",
            ),
            ("inside generate", split),
            ("actors", f"{self.num_actors} on {self.actor_device}"),
            ("output", f"{self.output_dir} ({self.num_shards} shards)"),
        ]
        width = max(len(name) for name, _ in lines)
        return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in lines)


def plot_tokens_per_call(histogram: list[int], path: str, title: str) -> None:
    """Histogram of tokens per target call (accepted draft tokens + the correction or bonus token).

    histogram[n] = how many (prompt, target call) pairs produced n tokens, n = 0..L+1. Saved as PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    total = sum(histogram) or 1
    ax.bar(range(len(histogram)), [count / total for count in histogram], color="#4477aa")
    ax.set_xlabel("tokens per target call (accepted draft tokens + 1)")
    ax.set_ylabel("fraction of target calls")
    ax.set_xticks(range(len(histogram)))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_report(report: Any) -> str:
    """The end-of-job text: the summary table, where the MLflow run is, and any error (a `JobReport`)."""
    lines = ["SpecTr generation summary", report.summary.table()]
    width = 16
    for name, value in report.tracker_lines:
        lines.append(f"  {name.ljust(width)}  {value}")
    lines.extend(f"error: {message}" for message in report.messages)
    return "\n".join(lines)
