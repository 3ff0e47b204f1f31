"""Aggregating shard statistics into the job's metrics, the summary table, and the plot.

`JobSummary.build` combines the per-shard stats of the whole job (all shards, including those an earlier run
finished) with the timings of this run and, when known, of the earlier runs of the same job, so that a
resumed job's throughput and wall time cover all of it. `progress_metrics` computes the metrics that are
also logged while the job runs, from the same sums, so the live series ends on the final value. The metric
names are the MLflow contract of docs/architecture.md. This module does not log (that is
`pipeline.generate.tracking` and `pipeline.generate.live`) and does not run anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.generate.mix import ConfigMix, metric_name
from pipeline.generate.stats import empty_stats, merge_stats

# The metrics logged while the job runs (step = prompts completed), contract names.
LIVE_METRICS = (
    "throughput_tokens_per_s",
    "block_efficiency",
    "acceptance_rate",
    "prompts_completed",
    "generated_tokens",
)


def total_stats(shard_stats: list[dict[str, Any]]) -> dict[str, Any]:
    total = empty_stats()
    for stats in shard_stats:
        merge_stats(total, stats)
    return total


def acceptance_by_position(accepted_per_position: list[int], target_calls: int) -> list[float]:
    """P(position i accepted | position i tested), i = 1..L: position 1 is tested at every target call
    of a row, position i > 1 when position i - 1 was accepted."""
    tested = [target_calls, *accepted_per_position[:-1]]
    return [a / t if t else 0.0 for a, t in zip(accepted_per_position, tested)]


def progress_metrics(
    total: dict[str, Any], this_run: dict[str, Any], generation_s: float, earlier_generation_s: float | None
) -> dict[str, float]:
    """The live metrics (`LIVE_METRICS`, `target_calls`, `prompts_failed`, `acceptance_at_position_<i>`)
    from summed stats (`total_stats`).

    total: every finished shard of the job; this_run: the shards this run generated; generation_s: this
    run's generation time so far; earlier_generation_s: the earlier runs' (None: unknown, and then the
    throughput covers this run only, as it cannot be divided fairly).
    """
    if earlier_generation_s is None:
        seconds, tokens = generation_s, this_run["generated_tokens"]
    else:
        seconds, tokens = earlier_generation_s + generation_s, total["generated_tokens"]
    tested, calls = total["tested_positions"], total["target_calls"]
    values = {
        "throughput_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "block_efficiency": total["generated_tokens"] / calls if calls else 0.0,
        "acceptance_rate": sum(total["accepted_per_position"]) / tested if tested else 0.0,
        "prompts_completed": float(total["prompts_completed"]),
        "generated_tokens": float(total["generated_tokens"]),
        "target_calls": float(total["target_calls"]),
        "prompts_failed": float(total["prompts_failed"]),
    }
    for i, rate in enumerate(acceptance_by_position(total["accepted_per_position"], total["target_calls"])):
        values[f"acceptance_at_position_{i + 1}"] = rate
    values.update(planner_metrics(total))
    return values


def planner_metrics(total: dict[str, Any]) -> dict[str, float]:
    """method=auto, live and final: the share of tokens per configuration (`planner_share_<label>`), the
    chooser's current configuration (`planner_current_num_drafts`, `planner_current_draft_length`: 0 for
    autoregressive) and `planner_wasted_s`; {} for a fixed method."""
    if not total.get("tokens_by_config"):
        return {}
    values = {metric_name(label): share for label, share in ConfigMix.of(total).shares().items()}
    choice = total.get("plan_choice") or {}
    if choice:
        autoregressive = choice.get("method") == "autoregressive"
        values["planner_current_num_drafts"] = 0.0 if autoregressive else float(choice.get("num_drafts", 0))
        values["planner_current_draft_length"] = 0.0 if autoregressive else float(choice.get("draft_length", 0))
    values["planner_wasted_s"] = float(total.get("wasted_seconds", 0.0))
    return values


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
    wall_time_s: float  # the whole job: this run + the earlier runs (earlier_wall_s)
    # context
    num_prompts: int
    prompts_this_run: int
    generated_tokens_this_run: int
    generation_s: float  # this run: first shard dispatched -> last shard written
    startup_s: float  # this run: from start to the first shard dispatched (checks, Ray, model loading)
    overhead_s: float  # wall_time_s - generation_s
    num_actors: int
    actor_device: str
    earlier_generation_s: float | None = None  # the earlier runs of this job (None: unknown or none)
    earlier_wall_s: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    seconds_by_phase: dict[str, float] = field(default_factory=dict)  # inside spectr.generate, all shards
    output_dir: str = ""
    num_shards: int = 0
    plan: str = ""  # method=auto: "auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%"
    planner_predicted_tokens_per_s: float = 0.0  # method=auto: the chooser's prediction for its choice (all actors)
    planner_measured_tokens_per_s: float = 0.0  # the same quantity measured: the actors' batches
    planner_wasted_s: float = 0.0  # method=auto: generation seconds whose tokens were not kept (goal: 0)
    tokens_by_config: dict[str, int] = field(default_factory=dict)  # method=auto: label -> tokens
    planner_values: dict[str, float] = field(default_factory=dict)  # method=auto: `planner_metrics`
    compile_s: float = 0.0  # spectr.compile: seconds the actors spent compiling (summed), inside generation
    compile_fallbacks: int = 0  # compiled calls that failed or disagreed with eager, answered eagerly (spectr.native)
    prefilled_rows: int = 0  # rows whose prompt ran through the models (one prefill each) ...
    shared_prefill_rows: int = 0  # ... and rows that copied the prefill of the same prompt in the batch (samples)
    startup_phases: dict[str, float] = field(default_factory=dict)  # this run's startup, seconds per phase
    input_prompts: int = 0  # the input's prompts (num_prompts counts output rows: more with samples); 0: unknown

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
        earlier_generation_s: float | None = None,
        earlier_wall_s: float = 0.0,
    ) -> JobSummary:
        """wall_time_s, generation_s, startup_s: this run's; earlier_*: the job's earlier runs."""
        total, this_run = total_stats(shard_stats), total_stats(this_run_stats)
        live = progress_metrics(total, this_run, generation_s, earlier_generation_s)
        return cls(
            throughput_tokens_per_s=live["throughput_tokens_per_s"],
            block_efficiency=live["block_efficiency"],
            acceptance_rate=live["acceptance_rate"],
            generated_tokens=int(total["generated_tokens"]),
            target_calls=int(total["target_calls"]),
            prompts_completed=int(total["prompts_completed"]),
            prompts_failed=int(total["prompts_failed"]),
            wall_time_s=earlier_wall_s + wall_time_s,
            num_prompts=num_prompts,
            prompts_this_run=int(this_run["prompts_completed"] + this_run["prompts_failed"]),
            generated_tokens_this_run=int(this_run["generated_tokens"]),
            generation_s=generation_s,
            startup_s=startup_s,
            overhead_s=max(0.0, wall_time_s - generation_s),
            num_actors=num_actors,
            actor_device=actor_device,
            earlier_generation_s=earlier_generation_s,
            earlier_wall_s=earlier_wall_s,
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
            plan=_method_line(total, this_run),
            planner_predicted_tokens_per_s=predicted_throughput(total, num_actors),
            planner_measured_tokens_per_s=batch_throughput(total, num_actors),
            planner_wasted_s=float(total.get("wasted_seconds", 0.0)),
            tokens_by_config=dict(total.get("tokens_by_config") or {}),
            planner_values=planner_metrics(total),
            compile_s=float(total.get("compile_seconds", 0.0)),
            compile_fallbacks=int(total.get("compile_fallbacks", 0)),
            prefilled_rows=int(total.get("prefilled_rows", 0)),
            shared_prefill_rows=int(total.get("shared_prefill_rows", 0)),
        )

    @property
    def failed_fraction(self) -> float:
        return self.prompts_failed / self.num_prompts if self.num_prompts else 0.0

    @property
    def wall_time_this_run_s(self) -> float:
        return self.wall_time_s - self.earlier_wall_s

    def metrics(self) -> dict[str, float]:
        """The final MLflow metrics: the contract names, this run's time split, and
        `acceptance_at_position_<i>` (i = 1..L). The number of actors is a param, not a metric."""
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
            "compile_s",
            "compile_fallbacks",
            "shared_prefill_rows",
        )
        values = {name: float(getattr(self, name)) for name in names}
        for i, rate in enumerate(acceptance_by_position(self.accepted_per_position, self.target_calls)):
            values[f"acceptance_at_position_{i + 1}"] = rate
        if self.planner_predicted_tokens_per_s > 0:
            values["planner_predicted_tokens_per_s"] = self.planner_predicted_tokens_per_s
            values["planner_measured_tokens_per_s"] = self.planner_measured_tokens_per_s
            values["planner_measured_over_predicted"] = self.measured_over_predicted
        values.update(self.planner_values)
        values.update({f"startup_{phase}_s": float(seconds) for phase, seconds in self.startup_phases.items()})
        return values

    @property
    def measured_over_predicted(self) -> float:
        """method=auto: the actors' measured batch throughput / the planner's prediction (0: none)."""
        predicted = self.planner_predicted_tokens_per_s
        return self.planner_measured_tokens_per_s / predicted if predicted > 0 else 0.0

    @property
    def counts_rows(self) -> bool:
        """Whether the job's rows are not one per prompt (samples): the summary says rows, and from how many prompts."""
        return bool(self.input_prompts) and self.input_prompts != self.num_prompts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        phases = self.seconds_by_phase
        phase_total = sum(phases.values()) or 1.0
        split = " | ".join(f"{name} {100 * seconds / phase_total:.0f}%" for name, seconds in phases.items())
        earlier = self.num_prompts - self.prompts_this_run
        rows = self.counts_rows  # samples: count rows, say prompts
        lines = [
            (
                "rows" if rows else "prompts",
                f"{self.num_prompts}" + (f" from {self.input_prompts} prompts" if rows else "")
                + f" ({self.prompts_completed} completed, {self.prompts_failed} failed"
                + (f"; {earlier} done by an earlier run)" if earlier else ")"),
            ),
            ("generated tokens", f"{self.generated_tokens}"),
            ("target calls", f"{self.target_calls}"),
            ("block efficiency", f"{self.block_efficiency:.3f} tokens per target call"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("throughput", f"{self.throughput_tokens_per_s:.1f} tokens/s over {self._throughput_covers()}"),
            ("wall time", self._wall_time_line()),
            ("inside generate", split),
            *([("compiling", f"{self.compile_s:.1f} s of the actors' generation time (spectr.compile)")]
              if self.compile_s > 0 else []),
            *([("compile fallbacks", f"{self.compile_fallbacks} compiled calls failed or disagreed with eager and "
                                     "ran eager instead (warnings above)")] if self.compile_fallbacks else []),
            *([("prefills", f"{self.prefilled_rows} run, {self.shared_prefill_rows} shared (samples of a prompt in "
                            "the batch together copy its prefill)")] if self.shared_prefill_rows else []),
            ("actors", f"{self.num_actors} on {self.actor_device}"),
            ("output", f"{self.output_dir} ({self.num_shards} shards)"),
        ]
        if self.plan:
            lines.insert(0, ("method", self.plan))
        if self.planner_predicted_tokens_per_s > 0:
            lines.insert(1, ("planner", f"predicted {self.planner_predicted_tokens_per_s:.1f} tokens/s for "
                                        f"{self.num_actors} actor(s); their batches made "
                                        f"{self.planner_measured_tokens_per_s:.1f} = {self.measured_over_predicted:.2f}x; "
                                        f"wasted {self.planner_wasted_s:.1f} s"))
        width = max(len(name) for name, _ in lines)
        return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in lines)

    def _throughput_covers(self) -> str:
        if self.earlier_generation_s:
            return "the whole job's generation (this run and the earlier ones)"
        return "this run's generation"

    def _wall_time_line(self) -> str:
        this_run = self.wall_time_this_run_s
        finish = max(0.0, this_run - self.startup_s - self.generation_s)
        line = (
            f"{this_run:.1f} s = startup {self.startup_s:.1f} s + generation {self.generation_s:.1f} s"
            f" + finish {finish:.1f} s"
        )
        return line + (f"; whole job {self.wall_time_s:.1f} s" if self.earlier_wall_s else "")


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


def _method_line(total: dict[str, Any], this_run: dict[str, Any]) -> str:
    """method=auto: what ran, by share of tokens (the whole job's); else the fixed method's plan, if any."""
    if total.get("tokens_by_config"):
        return ConfigMix.of(total).describe()
    return str(this_run.get("plan") or total.get("plan") or "")


def predicted_throughput(total: dict[str, Any], num_actors: int) -> float:
    """method=auto: the chooser's predicted tokens/s of the job (each actor at its choice's prediction,
    weighted by the tokens generated under each); 0 without a prediction."""
    seconds = total.get("predicted_seconds", 0.0)
    return num_actors * total["generated_tokens"] / seconds if seconds > 0 else 0.0


def batch_throughput(total: dict[str, Any], num_actors: int) -> float:
    """The actors' tokens per second of batch time (`wall_seconds`) less the seconds spent compiling in it
    (spectr.compile: the chooser predicts steady iterations, not graphs being built), times the number of
    actors: what the chooser predicts, measured; 0 without a prediction."""
    seconds = total.get("wall_seconds", 0.0) - total.get("compile_seconds", 0.0)
    if total.get("predicted_seconds", 0.0) <= 0 or seconds <= 0:
        return 0.0
    return num_actors * total["generated_tokens"] / seconds
