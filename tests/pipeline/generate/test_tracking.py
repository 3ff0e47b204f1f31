"""The MLflow pieces of the generation job without Ray: live metrics, the summary's arithmetic, the run
file, resource usage, sweep naming and outcomes, and `MlflowRun` on a SQLite store (experiment kind,
reopening a run, the dataset input)."""

from __future__ import annotations

import json

import pytest

from jobs.sweep import parse_overrides
from pipeline.config import MlflowConfig
from pipeline.generate.live import LiveMetrics, merge_usage
from pipeline.generate.stats import ResourceMeter, empty_stats, merge_stats
from pipeline.generate.summary import LIVE_METRICS, JobSummary, acceptance_by_position, progress_metrics
from pipeline.generate.sweep import SweepRun, cell_output_dir, read_sweep
from pipeline.generate.tracking import RunRecord, model_name, read_run_record, write_run_record
from pipeline.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, MlflowRun


def shard(prompts: int, tokens: int, calls: int, accepted: list[int], tested: int, failed: int = 0) -> dict:
    stats = empty_stats()
    stats.update(
        prompts_completed=prompts, prompts_failed=failed, generated_tokens=tokens, target_calls=calls
    )
    stats.update(accepted_per_position=accepted, tested_positions=tested)
    return stats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def live_logger(
    sent: list, earlier=(), earlier_s=0.0, num_prompts=8, every_s=5.0, clock=None, heartbeat_s=30.0
):
    clock = clock or Clock()
    return LiveMetrics(sent.extend, list(earlier), earlier_s, num_prompts, every_s, started=clock(),
                       clock=clock,
                       heartbeat_s=heartbeat_s)  # fmt: skip


def test_acceptance_by_position_is_conditional_on_reaching_the_position():
    # 10 target calls; position 1 accepted 8 times, position 2 4 of those 8, position 3 1 of those 4
    assert acceptance_by_position([8, 4, 1], 10) == [0.8, 0.5, 0.25]
    assert acceptance_by_position([], 10) == [] and acceptance_by_position([0, 0], 0) == [0.0, 0.0]


def test_live_points_are_rate_limited_and_stepped_by_prompts_completed():
    sent: list = []
    clock = Clock()
    live = live_logger(sent, clock=clock)
    clock.now += 1.0
    live.tick()  # nothing of this run yet: no point at step 0
    live.flush()
    assert sent == []
    live.shard_written(shard(2, 20, 10, [8, 4], 14), {"host": "h", "pid": 1})
    live.flush()
    first = list(sent)  # the first shard is logged at once
    clock.now += 1.0
    live.tick()  # 1 s later: too soon
    live.shard_written(shard(2, 10, 5, [3, 1], 6), {"host": "h", "pid": 1})
    live.stop()
    assert {m.key for m in first} == {
        *LIVE_METRICS, "target_calls", "prompts_failed",
        "acceptance_at_position_1", "acceptance_at_position_2",
    }  # fmt: skip
    values = {m.key: m.value for m in first}
    assert all(m.step == 2 for m in first) and values["prompts_completed"] == 2
    assert values["throughput_tokens_per_s"] == 20.0 and values["block_efficiency"] == 2.0
    assert values["acceptance_rate"] == pytest.approx(12 / 14)
    assert len(sent) == len(first)  # nothing more within every_s


def test_a_hanging_server_drops_the_oldest_points_and_stop_waits_at_most_its_timeout():
    """Issue #40: every live call hangs (a tracking server that accepts and never answers). The points
    queue up to MAX_PENDING (the oldest dropped and counted beyond), and `stop` gives up after its timeout
    instead of waiting for each call's minutes of retries."""
    import threading
    import time

    from pipeline.generate.live import MAX_PENDING

    answer = threading.Event()
    calls: list = []

    def hanging(metrics: list) -> None:
        calls.append(metrics)
        answer.wait()

    clock = Clock()
    live = LiveMetrics(hanging, [], 0.0, 10_000, 1.0, started=clock(), clock=clock)
    for point in range(100):
        clock.now += 2.0
        live.shard_written(shard(2, 20, 10, [5], 10), None)
        while point == 0 and not calls:  # the first call is in flight (and hangs) before the others come
            time.sleep(0.01)
    assert live.dropped == 100 - 1 - MAX_PENDING  # one in flight, MAX_PENDING waiting: the newest
    started = time.monotonic()
    assert live.stop(timeout_s=0.3) == 100 - 1 and len(calls) == 1
    assert time.monotonic() - started < 2.0
    clock.now += 2.0
    live.shard_written(shard(2, 20, 10, [5], 10), None)  # after stop: dropped, never queued
    answer.set()
    assert live.dropped == 100 and len(calls) == 1


def test_live_heartbeat_repeats_the_step_and_the_end_is_left_to_the_final_point():
    sent: list = []
    clock = Clock()
    live = live_logger(sent, num_prompts=4, every_s=5.0, clock=clock, heartbeat_s=30.0)
    clock.now += 2.0
    live.shard_written(shard(2, 20, 10, [5], 10), None)
    clock.now += 6.0
    live.tick()  # 6 s without a shard: no heartbeat yet
    clock.now += 30.0
    live.tick()  # 36 s: a point at the same step, throughput over the longer time
    live.flush()
    beats = [m for m in sent if m.key == "throughput_tokens_per_s"]
    assert [m.step for m in beats] == [2, 2] and beats[0].value == 10.0 and beats[1].value == 20 / 38
    clock.now += 6.0
    live.shard_written(shard(2, 20, 10, [5], 10), None)  # the job is complete: no live point
    live.stop()
    assert len([m for m in sent if m.key == "throughput_tokens_per_s"]) == 2


def test_live_metrics_cover_the_whole_job_when_resumed():
    sent: list = []
    clock = Clock()
    earlier = [shard(4, 40, 20, [10], 20)]
    live = live_logger(sent, earlier=earlier, earlier_s=10.0, num_prompts=12, clock=clock)
    clock.now += 10.0
    live.shard_written(shard(4, 40, 20, [10], 20), None)
    live.stop()
    values = {m.key: m.value for m in sent}
    assert values["prompts_completed"] == 8 and values["generated_tokens"] == 80
    assert values["throughput_tokens_per_s"] == 4.0  # 80 tokens / (10 s earlier + 10 s now)
    assert {m.step for m in sent} == {8}


def test_worker_usage_is_logged_per_worker_as_its_peak_over_the_interval():
    sent: list = []
    clock = Clock()
    live = live_logger(sent, num_prompts=100, clock=clock)
    usage = {"wall_s": 1.0, "cpu_s": 1.0, "cpu_utilization_percentage": 90.0, "peak_rss_megabytes": 300.0}
    live.shard_written({**shard(1, 5, 2, [1], 2), "resources": usage}, {"host": "a", "pid": 1})
    live.shard_written({**shard(1, 5, 2, [1], 2), "resources": dict(usage, peak_rss_megabytes=350.0)},
                       {"host": "a", "pid": 1})  # fmt: skip
    live.shard_written({**shard(1, 5, 2, [1], 2), "resources": usage}, {"host": "b", "pid": 7})
    live.stop()
    rss = {(m.key, m.value) for m in sent if m.key.endswith("peak_rss_megabytes")}
    assert rss == {("system/worker_0/peak_rss_megabytes", 300.0),
                   ("system/worker_0/peak_rss_megabytes", 350.0),
                   ("system/worker_1/peak_rss_megabytes", 300.0)}  # fmt: skip
    assert not any(m.key.endswith(("wall_s", "cpu_s")) for m in sent)
    assert merge_usage({"a": 1.0, "b": 5.0}, {"a": 3.0}) == {"a": 3.0, "b": 5.0}


def test_summary_throughput_and_wall_time_cover_the_whole_job():
    earlier, now = shard(4, 40, 20, [10, 5], 25), shard(4, 60, 20, [12, 6], 26)
    common = dict(
        num_prompts=8, startup_s=1.0, num_actors=2, actor_device="cpu", output_dir="o", num_shards=2
    )
    resumed = JobSummary.build([earlier, now], [now], wall_time_s=12.0, generation_s=10.0,
                               earlier_generation_s=15.0, earlier_wall_s=20.0, **common)  # fmt: skip
    assert resumed.throughput_tokens_per_s == 100 / 25 and resumed.wall_time_s == 32.0
    assert resumed.generated_tokens == 100 and resumed.block_efficiency == 2.5
    assert "whole job 32.0 s" in resumed.table()
    unknown = JobSummary.build([earlier, now], [now], wall_time_s=12.0, generation_s=10.0, **common)
    assert unknown.throughput_tokens_per_s == 6.0  # earlier time unknown: this run's tokens / time
    metrics = resumed.metrics()
    assert "num_actors" not in metrics and metrics["acceptance_at_position_1"] == 22 / 40
    live = progress_metrics(merge_stats(merge_stats(empty_stats(), earlier), now), now, 10.0, 15.0)
    assert all(live[name] == pytest.approx(metrics[name]) for name in live)  # the live series ends here


def test_planner_prediction_mix_and_waste_in_the_summary():
    """method=auto: each shard carries the batch's tokens and seconds per configuration, the wasted seconds,
    the chooser's choice and the seconds one actor would need at its predicted tok/s; the summary turns them
    into the method line (what ran, by share of tokens), the prediction against the measured batches, and
    the MLflow metrics (shares, current configuration, planner_wasted_s)."""
    fast, slow = shard(4, 60, 20, [10, 5], 25), shard(4, 40, 20, [12, 6], 26)
    fast.update(plan="speculative L=3", plan_choice={"method": "speculative", "num_drafts": 1, "draft_length": 3},
                tokens_by_config={"speculative L=3": 50, "autoregressive": 10},
                seconds_by_config={"speculative L=3": 2.0, "autoregressive": 0.5},
                predicted_seconds=60 / 30.0, wall_seconds=3.0, wasted_seconds=0.25)
    slow.update(plan="block L=3", plan_choice={"method": "block", "num_drafts": 1, "draft_length": 3},
                tokens_by_config={"speculative L=3": 31, "block L=3": 9}, seconds_by_config={"block L=3": 0.4},
                predicted_seconds=40 / 10.0, wall_seconds=2.0)
    common = dict(num_prompts=8, startup_s=1.0, num_actors=2, actor_device="cpu", output_dir="o", num_shards=2)
    summary = JobSummary.build([fast, slow], [fast, slow], wall_time_s=12.0, generation_s=10.0, **common)
    assert summary.plan == "auto: speculative L=3 for 81% of tokens, autoregressive 10%, block L=3 9%"
    assert summary.planner_predicted_tokens_per_s == pytest.approx(2 * 100 / 6.0)  # two actors
    assert summary.planner_measured_tokens_per_s == pytest.approx(2 * 100 / 5.0)  # 100 tokens in 5 s of batches
    metrics = summary.metrics()
    assert metrics["planner_measured_over_predicted"] == pytest.approx(40.0 / (100 / 3.0))
    assert metrics["planner_wasted_s"] == 0.25
    assert metrics["planner_share_speculative_L3"] == pytest.approx(0.81)
    assert metrics["planner_share_autoregressive"] == pytest.approx(0.10)
    assert (metrics["planner_current_num_drafts"], metrics["planner_current_draft_length"]) == (1.0, 3.0)
    table = summary.table()
    assert "method            auto: speculative L=3 for 81% of tokens" in table
    assert "predicted 33.3 tokens/s for 2 actor(s); their batches made 40.0 = 1.20x; wasted 0.2 s" in table
    compiling = [dict(fast, compile_seconds=1.0), slow]  # spectr.compile: not the chooser's seconds
    compiled = JobSummary.build(compiling, compiling, wall_time_s=12.0, generation_s=10.0, **common)
    assert compiled.planner_measured_tokens_per_s == pytest.approx(2 * 100 / 4.0)
    assert "compiling         1.0 s" in compiled.table()
    live = progress_metrics(merge_stats(merge_stats(empty_stats(), fast), slow), slow, 10.0, None)
    assert live["planner_share_block_L3"] == pytest.approx(0.09)  # the live series carries the shares too
    fixed = JobSummary.build([shard(4, 60, 20, [10, 5], 25)], [], wall_time_s=1.0, generation_s=1.0, **common)
    assert "planner_predicted_tokens_per_s" not in fixed.metrics() and "planner" not in fixed.table()
    assert not any(name.startswith("planner_") for name in fixed.metrics())


def test_compile_seconds_are_summed_into_the_summary():
    """spectr.compile: the actors' compile seconds (each shard's `compile_seconds`) become `compile_s`, a
    final metric (0 in eager jobs) and, when non-zero, a line of the table."""
    common = dict(num_prompts=8, startup_s=1.0, num_actors=2, actor_device="cpu", output_dir="o", num_shards=2)
    first, second = shard(4, 60, 20, [10, 5], 25), shard(4, 40, 20, [12, 6], 26)
    first.update(compile_seconds=30.5)
    second.update(compile_seconds=1.5)
    compiled = JobSummary.build([first, second], [first, second], wall_time_s=12.0, generation_s=10.0, **common)
    assert compiled.compile_s == 32.0 and compiled.metrics()["compile_s"] == 32.0
    assert "compiling         32.0 s of the actors' generation time" in compiled.table()
    eager = JobSummary.build([shard(4, 60, 20, [10, 5], 25)], [], wall_time_s=1.0, generation_s=1.0, **common)
    assert eager.metrics()["compile_s"] == 0.0 and "compiling" not in eager.table()


def test_compile_fallbacks_are_summed_into_the_summary_and_a_metric():
    """GenerationStats.compile_fallbacks of each shard: summed, a final metric (0 when none) and a table line."""
    common = dict(num_prompts=8, startup_s=1.0, num_actors=2, actor_device="cpu", output_dir="o", num_shards=2)
    first, second = shard(4, 60, 20, [10, 5], 25), shard(4, 40, 20, [12, 6], 26)
    first.update(compile_fallbacks=1)
    second.update(compile_fallbacks=2)
    total = merge_stats(merge_stats(empty_stats(), first), second)
    assert total["compile_fallbacks"] == 3
    summary = JobSummary.build([first, second], [first, second], wall_time_s=12.0, generation_s=10.0, **common)
    assert summary.compile_fallbacks == 3 and summary.metrics()["compile_fallbacks"] == 3.0
    assert "compile fallbacks 3 compiled calls failed" in " ".join(summary.table().split())
    clean = JobSummary.build([shard(4, 60, 20, [10, 5], 25)], [], wall_time_s=1.0, generation_s=1.0, **common)
    assert clean.metrics()["compile_fallbacks"] == 0.0 and "fallbacks" not in clean.table()


def test_run_record_round_trip_and_a_broken_file(tmp_path):
    assert read_run_record(tmp_path) is None
    write_run_record(tmp_path, RunRecord("r1", "0", "http://x", 12.5, 30.0, 2))
    assert read_run_record(tmp_path) == RunRecord("r1", "0", "http://x", 12.5, 30.0, 2)
    assert not list(tmp_path.glob(".*tmp*"))
    (tmp_path / "_mlflow_run.json").write_text("{not json")
    assert read_run_record(tmp_path) is None


def test_resource_meter_on_cpu():
    meter = ResourceMeter("cpu")
    sum(i * i for i in range(200_000))
    usage = meter.usage()
    assert set(usage) == {"wall_s", "cpu_s", "cpu_utilization_percentage", "peak_rss_megabytes"}
    assert usage["peak_rss_megabytes"] > 10 and usage["cpu_s"] > 0
    total = merge_stats(empty_stats(), {**shard(1, 1, 1, [], 0), "resources": usage})
    assert "resources" not in total  # per worker, never summed


def test_model_names_for_tags(tmp_path):
    assert model_name(str(tmp_path / "models" / "big")) == "big"
    assert model_name("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"


def test_sweep_overrides_cell_dirs_and_outcomes(tmp_path):
    values, swept = parse_overrides(
        ["spectr.num_drafts=1,2", "data.limit=4", "spectr.draft_length=range(2,4)"]
    )
    assert values == {"spectr.num_drafts": "1,2", "data.limit": "4", "spectr.draft_length": "range(2,4)"}
    assert swept == ["spectr.num_drafts", "spectr.draft_length"]
    cell = {"spectr.num_drafts": "2", "data.limit": "4", "spectr.draft_length": "3"}
    assert cell_output_dir("/o/", cell, swept) == "/o/spectr.num_drafts=2,spectr.draft_length=3"
    assert (
        cell_output_dir("s3://b/o", {"model.target": "/m/big"}, ["model.target"])
        == "s3://b/o/model.target=_m_big"
    )
    sweep = SweepRun(MlflowConfig(enabled=False), tmp_path / "sweep")
    sweep.start(values, swept)
    assert (
        read_sweep(tmp_path / "sweep").swept_keys == swept and read_sweep(tmp_path / "sweep").run_id is None
    )
    for number, code in enumerate((0, 2, 1)):
        sweep.cell_ended(number, f"cell {number}", code)
    assert sweep.finish() == 2 and "3 cell(s), 2 failed" in sweep.report()


def test_mlflow_run_experiment_kind_reopen_and_dataset(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    old = client.create_experiment("old")  # made before the kind tag existed: it gets one
    run = MlflowRun(MlflowConfig(tracking_uri=uri, experiment="old"))
    run_id = run.start({"a": {"b": 1}}, {"t": "x"})
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    for _ in range(2):  # logged twice (a resumed job): one input
        run.log_dataset("prompts", "/data/p.jsonl", "ab" * 40, 12)
    run.terminate("KILLED")
    again = MlflowRun(MlflowConfig(tracking_uri=uri, experiment="old"))
    again.reopen(run_id, {"a": {"b": 2}, "c": 3}, {"t": "y"})
    got = client.get_run(run_id)
    assert got.info.status == "RUNNING" and got.data.params == {
        "a.b": "1",
        "c": "3",
    }  # params keep their first value
    assert got.data.tags["t"] == "y"
    (dataset_input,) = got.inputs.dataset_inputs
    assert dataset_input.dataset.digest == ("ab" * 40)[:36]
    assert json.loads(dataset_input.dataset.profile) == {"num_rows": 12}
    again.terminate()
    assert client.get_run(run_id).info.status == "FINISHED"


def test_planner_choice_becomes_params_first_and_tags_latest(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.generate.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = MlflowRun(MlflowConfig(tracking_uri=uri, experiment="e"))
    run_id = run.start({}, {})
    MlflowTracker.planner_chose(run, "auto chose speculative L=4, ...", {"method": "speculative", "num_drafts": 1,
                                                                        "draft_length": 4})
    MlflowTracker.planner_chose(run, "auto chose spectr K=2 L=3, ...", {"method": "spectr", "num_drafts": 2,
                                                                        "draft_length": 3})
    data = MlflowClient(tracking_uri=uri).get_run(run_id).data
    assert (data.params["planner_method"], data.params["planner_num_drafts"], data.params["planner_draft_length"]) == (
        "speculative", "1", "4")
    assert (data.tags["planner_method"], data.tags["planner_num_drafts"], data.tags["planner_draft_length"]) == (
        "spectr", "2", "3")
    assert data.tags["planner_choice"].startswith("auto chose spectr K=2 L=3")
    run.terminate()


def test_planner_choice_is_passed_on_when_it_changes():
    sent: list = []
    plans: list = []
    clock = Clock()
    live = LiveMetrics(sent.extend, [], 0.0, 10, 5.0, started=clock(), clock=clock,
                       on_plan=lambda plan, choice: plans.append((plan, choice)))
    choices = {"speculative L=4": {"method": "speculative", "num_drafts": 1, "draft_length": 4},
               "spectr K=2 L=3": {"method": "spectr", "num_drafts": 2, "draft_length": 3}}
    for plan in ("speculative L=4", "speculative L=4", "spectr K=2 L=3", ""):
        live.shard_written({**shard(1, 4, 2, [1], 2), "plan": plan, "plan_choice": choices.get(plan)}, None)
    live.stop()
    assert plans == [(label, choices[label]) for label in ("speculative L=4", "spectr K=2 L=3")]
    total = merge_stats(merge_stats(empty_stats(), {"plan": "a"}), {"plan": ""})
    assert total["plan"] == "a"


class FailingStart:
    """A tracker whose MLflow start fails after creating its run (a server error while logging params)."""

    def __init__(self, error: Exception):
        self.error, self.failed = error, 0

    def start(self, params, tags):
        raise self.error

    def fail(self):
        self.failed += 1


def test_an_mlflow_start_that_fails_is_a_warning_and_the_job_logs_nothing(caplog):
    """Bookkeeping never fails a job: the run that failed to start is ended, and the job goes on with a
    tracker that logs nothing; a run MLflow refuses to create stays a refusal (exit 2, negative control)."""
    from pipeline.errors import JobInputError
    from pipeline.generate.job import _start_tracking
    from pipeline.generate.tracking import NullTracker

    broken = FailingStart(RuntimeError("503 Service Unavailable"))
    with caplog.at_level("WARNING", logger="pipeline"):
        tracker = _start_tracking(broken, {}, {})
    assert isinstance(tracker, NullTracker) and broken.failed == 1
    assert "mlflow: job start failed (RuntimeError: 503 Service Unavailable); the job goes on" in caplog.text
    with pytest.raises(JobInputError, match="cannot start a run"):
        _start_tracking(FailingStart(JobInputError("mlflow: cannot start a run at x")), {}, {})


def test_the_tracking_uri_comes_from_the_environment_when_the_config_leaves_it_unset(tmp_path, monkeypatch):
    """`mlflow.tracking_uri: null` takes MLflow's own MLFLOW_TRACKING_URI (a cluster's job environment sets it
    once); a configured URI wins over it; with neither, the local SQLite file in the working directory."""
    from pipeline.tracking import resolve_tracking_uri

    server = "http://mlflow.internal:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    assert resolve_tracking_uri(MlflowConfig(tracking_uri=None)) == server
    assert MlflowRun(MlflowConfig(tracking_uri=None)).tracking_uri == server
    assert resolve_tracking_uri(MlflowConfig(tracking_uri="http://other:5000")) == "http://other:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri(MlflowConfig(tracking_uri=None)) == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
