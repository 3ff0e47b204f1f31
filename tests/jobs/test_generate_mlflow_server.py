"""MLflow against a real tracking server (`mlflow server` on 127.0.0.1), read back with MlflowClient.

- A job with several shards: live time series (more than one point per contract metric, step = prompts
  completed, the last point equal to the final value), per-position acceptance, params and tags, the
  dataset input, the experiment's kind, driver system metrics and per-worker usage, the run file.
  Its data has one prompt too long for the model, and max_failed_fraction allows it: the job succeeds
  and the server holds prompts_failed = 1.
- A job SIGKILLed mid-run, then run again: one run, FINISHED, whose generated_tokens is the sum over
  all part files (the resume test's approach: a real driver process joining the session's Ray; slow). The
  default suite continues a finished job's run set back to RUNNING, with a shard missing, in process.
- An unreachable server is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output

REPO = Path(__file__).resolve().parents[2]
LIVE = (
    "throughput_tokens_per_s",
    "block_efficiency",
    "acceptance_rate",
    "prompts_completed",
    "generated_tokens",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_files(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


@pytest.fixture(scope="module")
def server_run(mlflow_server, tiny_pair, tmp_path_factory, ray_local):
    folder = tmp_path_factory.mktemp("server_run")
    rows = [{"id": f"q{i}", "prompt": "def x return"} for i in range(12)]
    rows[2]["prompt"] = " ".join(["x"] * 60)
    data = folder / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(
        tiny_pair, data, folder / "out", shard_size=2, max_failed_fraction=0.2,
        **{"ray.num_actors": 1, "spectr.batch_size": 1, "spectr.max_new_tokens": 16, "mlflow.enabled": True,
           "mlflow.tracking_uri": mlflow_server, "mlflow.experiment": "server-test",
           "mlflow.run_name": "tiny",
           "mlflow.log_every_s": 0.05, "mlflow.system_metrics_interval_s": 0.5},
    )  # fmt: skip
    report = run_generate(from_dict(raw))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    return {"report": report, "client": client, "out": folder / "out", "run": client.get_run(report.run_id)}


def test_job_logs_to_a_tracking_server(server_run, mlflow_server):
    report, client, run = server_run["report"], server_run["client"], server_run["run"]
    assert report.exit_code == 0  # 1 of 12 failed <= 0.2
    assert read_output(server_run["out"]).column("finish_reason").to_pylist()[2] == "error"
    experiment = client.get_experiment_by_name("server-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == report.run_id and run.info.run_name == "tiny" and run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["prompts_failed"] == 1 and metrics["prompts_completed"] == 11
    assert metrics["generated_tokens"] == report.summary.generated_tokens > 0
    assert metrics["target_calls"] == report.summary.target_calls
    assert metrics["throughput_tokens_per_s"] > 0 and metrics["wall_time_s"] > 0
    assert "num_actors" not in metrics and "accepted_at_position" not in metrics
    assert run.data.params["mlflow.tracking_uri"] == mlflow_server
    assert run.data.params["max_failed_fraction"] == "0.2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "tokens_per_target_call.png" in artifacts and "config.yaml" in artifacts
    assert f"open {mlflow_server}" in "\n".join(value for _, value in report.tracker_lines)
    record = json.loads((server_run["out"] / "_mlflow_run.json").read_text())
    assert record["run_id"] == report.run_id and record["tracking_uri"] == mlflow_server


def test_live_series_have_several_points_ending_on_the_final_value(server_run):
    client, run = server_run["client"], server_run["run"]
    final = run.data.metrics
    positions = [f"acceptance_at_position_{i}" for i in (1, 2, 3)]  # spectr.draft_length = 3
    for name in (*LIVE, *positions):
        history = sorted(
            client.get_metric_history(run.info.run_id, name), key=lambda m: (m.step, m.timestamp)
        )
        assert len(history) > 1, name
        assert history[-1].value == pytest.approx(final[name]), name
        assert history[-1].step == final["prompts_completed"] == 11, name
        steps = [m.step for m in history]
        assert steps == sorted(steps) and steps[0] < steps[-1], name
    prompts = client.get_metric_history(run.info.run_id, "prompts_completed")
    assert all(m.value == m.step for m in prompts)  # step = prompts completed
    tokens = sorted(client.get_metric_history(run.info.run_id, "generated_tokens"), key=lambda m: m.timestamp)
    assert [m.value for m in tokens] == sorted(m.value for m in tokens)
    assert all(0.0 <= final[name] <= 1.0 for name in positions)
    assert "acceptance_at_position_4" not in final


def test_params_tags_dataset_and_system_metrics(server_run, tiny_pair):
    run = server_run["run"]
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert (tags["method"], tags["K"], tags["L"]) == ("spectr", "2", "3")
    assert (tags["target"], tags["draft"]) == ("target", "draft")
    assert tags["device"] == "cpu" and tags["num_workers"] == "1" and params["num_actors"] == "1"
    assert tags["output_dir"] == str(server_run["out"]) and len(tags["git_commit"]) >= 40
    assert tags["mlflow.source.git.commit"] == tags["git_commit"].removesuffix("-dirty")
    assert params["spectr.num_drafts"] == "2" and params["ray.num_actors"] == "1"
    (dataset_input,) = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert dataset.name == "p" and json.loads(dataset.profile) == {"num_rows": 12}
    assert json.loads(dataset.source)["uri"].endswith("p.jsonl") and len(dataset.digest) > 8
    assert "system/cpu_utilization_percentage" in metrics  # MLflow's monitor on the driver
    assert metrics["system/worker_0/peak_rss_megabytes"] > 10
    assert metrics["system/worker_0/cpu_utilization_percentage"] > 0


def test_unreachable_server_is_a_warning_and_the_job_goes_on_without_mlflow(
    tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog
):
    """Nothing listens at the URI (issue #52: before, refused with exit 2; now the results do not wait on
    MLflow: a warning, no run, exit 0). A 4xx is still refused: tests/jobs/test_faults3_mlflow.py."""
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out",
        **{"data.limit": 8, "ray.num_actors": 1, "mlflow.enabled": True,
           "mlflow.tracking_uri": f"http://127.0.0.1:{free_port()}"},
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        report = run_generate(from_dict(raw))
    assert report.exit_code == 0 and report.run_id is None and (tmp_path / "out" / "_SUCCESS").exists()
    assert "mlflow: no MLflow server answers" in caplog.text and "goes on without MLflow" in caplog.text


@pytest.mark.slow  # the default suite's budget (8 min on 2 cores); see docs/testing.md
def test_a_run_left_running_is_marked_killed_and_continued_on_resume(
    mlflow_server, tiny_pair, tmp_path, ray_local, caplog
):
    """The default suite's resume against the server (the SIGKILLed driver is the slow test below): a
    finished job's output as a dead driver leaves it (its run RUNNING, shard 1 missing, no _SUCCESS); the
    rerun marks the run KILLED, continues the same run, and ends it FINISHED with totals over both runs."""
    from mlflow.tracking import MlflowClient

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "def x return"}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, data, out, shard_size=4,
        **{"ray.num_actors": 1, "mlflow.enabled": True, "mlflow.tracking_uri": mlflow_server,
           "mlflow.experiment": "left-running-test"},
    )  # fmt: skip
    first = run_generate(from_dict(raw))
    assert first.exit_code == 0
    client = MlflowClient(tracking_uri=mlflow_server)
    client.update_run(first.run_id, status="RUNNING")  # as SIGKILL leaves it: nothing could end it
    kept = [line for line in (out / "_commits.jsonl").read_text().splitlines() if json.loads(line)["shard"] == 0]
    (out / "_commits.jsonl").write_text("\n".join(kept) + "\n")
    (part,) = out.glob("part-000001-*.parquet")  # named for its run and attempt
    part.unlink()
    (out / "_SUCCESS").unlink()

    with caplog.at_level("WARNING"):
        again = run_generate(from_dict(raw))
    assert again.exit_code == 0 and again.run_id == first.run_id
    assert "marked KILLED" in caplog.text
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["resumed_from_status"] == "RUNNING" and run.data.tags["job_runs"] == "2"
    tokens = sum(sum(pq.read_table(p).column("completion_tokens").to_pylist()) for p in part_files(out))
    assert len(part_files(out)) == 2 and run.data.metrics["generated_tokens"] == tokens
    assert run.data.metrics["prompts_completed"] == 8
    record = json.loads((out / "_mlflow_run.json").read_text())
    assert record["run_id"] == run.info.run_id and record["invocations"] == 2


def driver_command(tiny_pair, data: Path, out: Path, address: str, tracking_uri: str) -> list[str]:
    return [
        sys.executable, "-m", "jobs.generate",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={data}", f"output_dir={out}", "shard_size=4", "ray.num_actors=1",
        f"ray.address={address}",
        "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3", "spectr.max_new_tokens=40", "spectr.batch_size=1",
        f"mlflow.tracking_uri={tracking_uri}", "mlflow.experiment=killed-test", "mlflow.log_every_s=0.2",
        "progress=false", "lease_timeout_s=6",  # the killed driver's lease: taken over after 6 s of watching
    ]  # fmt: skip


@pytest.mark.slow
def test_sigkilled_then_resumed_job_has_one_finished_run(
    mlflow_server, tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    command = driver_command(
        tiny_pair, prompts_jsonl, out, ray_local.get_runtime_context().gcs_address, mlflow_server
    )
    # cwd = this checkout: Ray's workers import the code from the driver's directory (everything the job
    # writes goes to output_dir and the server)
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token", PYTHONPATH=str(REPO))
    driver = subprocess.Popen(
        command, cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(part_files(out)) < 2:
            assert driver.poll() is None, f"the job ended before it could be killed:\n{driver.stderr.read()}"
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.05)
        time.sleep(0.3)  # a live point after the second shard
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("killed-test").experiment_id
    (killed,) = client.search_runs([experiment])
    assert killed.info.status == "RUNNING"  # SIGKILL: nothing could end it; the rerun detects it
    done_before = len(part_files(out))
    assert 2 <= done_before < 10

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "marked KILLED" in rerun.stdout + rerun.stderr
    (run,) = client.search_runs([experiment])
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["resumed_from_status"] == "RUNNING" and run.data.tags["job_runs"] == "2"
    tokens = sum(sum(pq.read_table(p).column("completion_tokens").to_pylist()) for p in part_files(out))
    assert len(part_files(out)) == 10 and run.data.metrics["generated_tokens"] == tokens
    assert run.data.metrics["prompts_completed"] == 40
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "generated_tokens")]
    assert min(steps) <= 4 * done_before <= max(steps) == 40  # one series over both drivers (a point per commit)
    record = json.loads((out / "_mlflow_run.json").read_text())
    assert record["run_id"] == run.info.run_id and record["invocations"] == 2
    assert record["generation_s"] > 0 and run.data.metrics["throughput_tokens_per_s"] > 0


@pytest.mark.slow
def test_sigterm_marks_the_run_killed(mlflow_server, tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """SIGTERM (`ray job stop`, a scheduler's kill) ends the job like Ctrl-C: its run is KILLED at once."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    address = ray_local.get_runtime_context().gcs_address
    command = driver_command(tiny_pair, prompts_jsonl, out, address, mlflow_server)
    command[command.index("mlflow.experiment=killed-test")] = "mlflow.experiment=terminated-test"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token", PYTHONPATH=str(REPO))
    driver = subprocess.Popen(
        command, cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not part_files(out):
            assert driver.poll() is None, f"the job ended before it could be stopped:\n{driver.stderr.read()}"
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.05)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) != 0
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("terminated-test").experiment_id])
    assert run.info.status == "KILLED"
