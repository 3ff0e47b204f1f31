"""The generation job end to end on a real local Ray, with the tiny random pair.

Covers: one row per prompt with contract types, manifest, commit log and _SUCCESS; MLflow in a local
SQLite file; resume (only missing shards, finished ones untouched, a torn commit line cut off); a different
config refused; every bad input refused before any actor starts with nothing written; per-row failures and
max_failed_fraction (no _SUCCESS); actors killed mid-shard; the CLI's one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_pair_support import job_config

from jobs.generate import generate
from pipeline.errors import JobInputError
from pipeline.generate import job as runner
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.plan import prepare
from pipeline.generate.reader import read_output, read_settings
from pipeline.generate.scheduler import RunHooks

REPO = Path(__file__).resolve().parents[2]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prompt_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def commit_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "_commits.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tiny_pair, prompts_jsonl, tmp_path_factory, ray_local):
    """One complete job: 40 prompts, 5 shards of 8, 2 actors, MLflow in a SQLite file."""
    folder = tmp_path_factory.mktemp("job")
    overrides = [
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={prompts_jsonl}", "data.limit=null", f"output_dir={folder / 'out'}", "shard_size=8",
        "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3", "spectr.max_new_tokens=8",
        "spectr.batch_size=4",
        f"mlflow.tracking_uri=sqlite:///{folder / 'mlflow.db'}", "progress=false",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    report = generate(cfg)  # the Hydra entry's plain function, on the real composed config
    raw = OmegaConf.to_container(cfg, resolve=True)
    return {"report": report, "raw": raw, "folder": folder, "out": folder / "out"}


def test_one_row_per_prompt_with_contract_types(finished_run, prompts_jsonl):
    report, out = finished_run["report"], finished_run["out"]
    assert report.exit_code == 0 and report.messages == []
    table = read_output(out)
    assert table.column("id").to_pylist() == prompt_ids(prompts_jsonl)  # input order, no loss, no duplicate
    schema = table.schema
    assert schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert [f.name for f in schema] == [
        "id", "prompt", "completion", "completion_token_ids", "prompt_tokens", "completion_tokens",
        "finish_reason", "stop_reason", "target_calls", "block_efficiency", "seed", "error", "sample_index",
        "time_taken_s", "prompt_token_ids", "stop_token_id", "prompt_logprobs",
    ]  # fmt: skip (completion_logprobs and cumulative_logprob with spectr.logprobs, then the data.keep_columns)
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert table.column("error").null_count == 40
    parts = sorted(p.name for p in out.glob("part-*"))
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS", "_commits.jsonl", "_manifest.json", "_mlflow_run.json"] + parts
    tag = parts[0].split("-")[2]  # the run's tag is in every part's name (a late writer of another run: #40)
    assert parts == [f"part-{i:06d}-{tag}-0.parquet" for i in range(5)]
    manifest = json.loads((out / "_manifest.json").read_text())
    commits = commit_records(out)
    assert manifest["num_rows"] == 40 and [c["rows"] for c in commits] == [8] * 5
    assert sorted(c["shard"] for c in commits) == list(range(5))
    assert all(c["bytes"] == (out / c["file"]).stat().st_size for c in commits)
    settings = read_settings(out / parts[0])
    assert settings["spectr"]["num_drafts"] == 2 and settings["spectr"]["draft_length"] == 3
    assert settings["model"]["target"] == finished_run["raw"]["model"]["target"]
    assert settings["config_hash"] == manifest["config_hash"]
    assert set(settings["versions"]) == {"spectr-pipeline", "torch", "transformers", "ray"}
    summary = report.summary
    assert summary.generated_tokens == sum(table.column("completion_tokens").to_pylist())
    assert summary.target_calls == sum(table.column("target_calls").to_pylist())
    assert summary.num_actors == 2 and summary.prompts_completed == 40


def test_mlflow_sqlite_run_has_contract_metrics_params_and_artifacts(finished_run):
    from mlflow.tracking import MlflowClient

    report = finished_run["report"]
    client = MlflowClient(tracking_uri=report.tracking_uri)
    run = client.get_run(report.run_id)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for name in (
        "throughput_tokens_per_s", "block_efficiency", "acceptance_rate", "generated_tokens",
        "target_calls", "prompts_completed", "prompts_failed", "wall_time_s",
    ):  # fmt: skip
        assert name in metrics, name
    assert metrics["generated_tokens"] == report.summary.generated_tokens
    assert metrics["prompts_completed"] == 40 and metrics["prompts_failed"] == 0
    assert 1.0 <= metrics["block_efficiency"] <= 4.0 and 0.0 <= metrics["acceptance_rate"] <= 1.0
    params = run.data.params
    assert (
        params["spectr.num_drafts"] == "2"
        and params["shard_size"] == "8"
        and params["mlflow.enabled"] == "True"
    )
    artifacts = {a.path for a in client.list_artifacts(report.run_id)}
    assert {"config.yaml", "summary.json", "summary.txt", "tokens_per_target_call.png"} <= artifacts
    assert "mlflow ui --backend-store-uri sqlite:///" in runner.format_report(report)


def part(out: Path, index: int) -> Path:
    """Shard `index`'s one part file (named for its run and attempt)."""
    (found,) = out.glob(f"part-{index:06d}-*.parquet")
    return found


def test_resume_does_only_missing_shards(finished_run, tmp_path, ray_local):
    out = tmp_path / "out"
    shutil.copytree(finished_run["out"], out)
    # as if the driver died after shard 3's file was renamed but before the commit log listed it (in the
    # middle of appending its line), with shard 4 never finished and a temporary file left behind
    kept = [line for line in (out / "_commits.jsonl").read_text().splitlines() if json.loads(line)["shard"] < 3]
    (out / "_commits.jsonl").write_text("\n".join(kept) + '\n{"shard": 3, "fi')
    part(out, 4).unlink()
    (out / "_SUCCESS").unlink()
    (out / ".part-000004.parquet.tmp-99-ab12cd34").write_bytes(b"half a file")
    before = {i: digest(part(out, i)) for i in range(3)}

    dispatched = []
    raw = dict(finished_run["raw"], output_dir=str(out), mlflow={"enabled": False}, ray={"num_actors": 1})
    report = run_generate(
        from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index))
    )
    assert sorted(dispatched) == [3, 4] and report.summary.prompts_this_run == 16
    assert {i: digest(part(out, i)) for i in range(3)} == before
    assert (out / "_SUCCESS").exists() and not list(out.glob(".*tmp*")) and not (out / "_lease.json").exists()
    assert sorted(c["shard"] for c in commit_records(out)) == list(range(5))  # the torn line was cut off
    assert (
        read_output(out).column("id").to_pylist() == read_output(finished_run["out"]).column("id").to_pylist()
    )
    # a complete directory: nothing to do, no Ray needed
    dispatched.clear()
    again = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard)))
    assert dispatched == [] and again.exit_code == 0 and again.summary.prompts_completed == 40


def test_different_config_on_the_same_dir_is_refused(finished_run):
    raw = json.loads(json.dumps(finished_run["raw"]))
    raw["spectr"]["temperature"] = 0.5
    raw["mlflow"] = {"enabled": False}
    before = {p.name: digest(p) for p in finished_run["out"].iterdir()}
    with pytest.raises(
        JobInputError, match=r"holds results of a different config \(spectr.temperature: 1.0 there"
    ):
        run_generate(from_dict(raw))
    assert {p.name: digest(p) for p in finished_run["out"].iterdir()} == before


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BAD_INPUTS = {
    "missing file": ({"data.path": "{tmp}/nope.jsonl"}, "data.path: no such file"),
    "unknown format": ({"data.path": "{tmp}/prompts.txt"}, "data.format: cannot tell the format"),
    "missing prompt column": ({"data.prompt_column": "text"}, "column 'text' not found"),
    "non-string prompt": ({"data.path": "{tmp}/numbers.jsonl"}, "prompt is int 5, expected a string"),
    "duplicate ids": ({"data.path": "{tmp}/dupes.jsonl"}, "duplicate ids"),
    "empty dataset": ({"data.path": "{tmp}/empty.jsonl"}, "holds no rows"),
    "no line break": (  # issue #40: one record over data.max_record_bytes, refused once, not scanned again per block
        {"data.path": "{tmp}/one_line.jsonl", "data.max_record_bytes": 1024},
        r"no line break in its 5023 bytes, over data.max_record_bytes=1024: not one record per line",
    ),
    "tokenizers differ": ({"model.draft": "{tmp}/other_draft"}, "draft tokenizer .* differs"),
    "K out of range": ({"spectr.num_drafts": 0}, "spectr.num_drafts"),
    "L out of range": ({"spectr.draft_length": -1}, "spectr.draft_length"),
    "temperature": ({"spectr.temperature": -1.0}, "spectr.temperature"),
    "top-k": ({"spectr.top_k": -3}, "spectr.top_k"),
    "top-p": ({"spectr.top_p": 0.0}, "spectr.top_p"),
    "missing model": ({"model.target": "{tmp}/no_model"}, "model.target: no such model directory"),
    "pickle weights": ({"model.draft": "{tmp}/pickled"}, "pickle-format weights"),
    "other config in output dir": ({"output_dir": "{tmp}/taken"}, "holds results of a different config"),
    "unknown input scheme": ({"data.path": "nosuch://bucket/p.jsonl"}, "cannot open the URI scheme 'nosuch://'"),
    "unknown output scheme": ({"output_dir": "nosuch://bucket/out"}, "output_dir: cannot open the URI scheme"),
    "output dir held by a live job": ({"output_dir": "{tmp}/held"}, r"held is being written by another job \(host"),
    "non-integer budget": (
        {"data.path": "{tmp}/budget_text.jsonl", "data.max_new_tokens_column": "budget"},
        r"data.max_new_tokens_column: row 1 \(id 2\) of \S*budget_text.jsonl: column 'budget': max_new_tokens is "
        r"str 'many', expected an integer >= 1",
    ),
    "non-positive budget": (
        {"data.path": "{tmp}/budget_zero.jsonl", "data.max_new_tokens_column": "budget"},
        r"row 1 \(id 2\) of \S*budget_zero.jsonl: column 'budget': max_new_tokens is 0, expected an integer >= 1",
    ),
    "budget over the model's limit": (  # the tiny pair takes 64 positions: at most 63 new tokens
        {"data.path": "{tmp}/budget_long.jsonl", "data.max_new_tokens_column": "budget"},
        r"row 1 \(id 2\) of \S*budget_long.jsonl: column 'budget': max_new_tokens is 64, over the models' limit of 63",
    ),
    "missing budget column": (
        {"data.max_new_tokens_column": "budget"}, r"data.max_new_tokens_column: column 'budget' not found in",
    ),
}


@pytest.fixture(scope="module")
def bad_input_files(tiny_pair, tmp_path_factory):
    import torch
    from safetensors.torch import load_file
    from tiny_pair_support import WORDS, build_llama, build_tokenizer

    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "prompts.txt").write_text("def x\n")
    _write(tmp / "numbers.jsonl", [{"id": 1, "prompt": "def"}, {"id": 2, "prompt": 5}])
    _write(tmp / "dupes.jsonl", [{"id": 1, "prompt": "def"}, {"id": 1, "prompt": "x"}])
    for name, budget in (("text", "many"), ("zero", 0), ("long", 64)):
        _write(tmp / f"budget_{name}.jsonl", [{"id": 1, "prompt": "def", "budget": 8}, {"id": 2, "prompt": "x", "budget": budget}])
    (tmp / "empty.jsonl").write_text("")
    (tmp / "one_line.jsonl").write_text(json.dumps({"id": 1, "prompt": "x" * 5000}))
    other = build_tokenizer(WORDS[::-1] + ["user", "assistant", ":"], tmp / "other_draft")
    build_llama(tmp / "other_draft", len(other), hidden=16, layers=1, seed=3)
    shutil.copytree(tiny_pair["draft"], tmp / "pickled")
    torch.save(load_file(str(tmp / "pickled" / "model.safetensors")), tmp / "pickled" / "pytorch_model.bin")
    (tmp / "pickled" / "model.safetensors").unlink()
    (tmp / "held").mkdir()
    from pipeline import fs
    from pipeline.generate.lease import Lease

    # a live job's lease: its heartbeat counter moves (every 0.1 s), which is what a reader watches
    held = Lease.acquire(fs.resolve(str(tmp / "held"), "output_dir"), timeout_s=0.6)
    (tmp / "taken").mkdir()
    (tmp / "taken" / "_manifest.json").write_text(
        json.dumps(
            {"config_hash": "0" * 64, "settings": {"spectr": {"seed": 99}}, "num_rows": 1, "num_shards": 1}
        )
    )
    yield tmp
    held.release()


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_before_any_actor_starts(
    case, tiny_pair, prompts_jsonl, bad_input_files, tmp_path, monkeypatch, ray_local
):  # on the session's Ray: a job that starts its own starts it during the check (test_startup.py)
    overrides, message = BAD_INPUTS[case]
    overrides = {k: v.format(tmp=bad_input_files) if isinstance(v, str) else v for k, v in overrides.items()}
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, **{"mlflow.enabled": True, "mlflow.tracking_uri": f"sqlite:///{db}"}
    )
    raw = job_config(tiny_pair, prompts_jsonl, out, **{**_flat(raw), **overrides})

    def no_actors(*args, **kwargs):
        raise AssertionError("an actor pool was started for bad input")

    monkeypatch.setattr(runner, "ShardActorPool", no_actors)
    monkeypatch.setattr(runner, "ray_session", no_actors)
    with pytest.raises(JobInputError, match=message):
        run_generate(from_dict(raw))
    assert not out.exists() and not db.exists()  # nothing written: no output, no MLflow run
    if case == "other config in output dir":
        assert sorted(p.name for p in (bad_input_files / "taken").iterdir()) == ["_manifest.json"]
    if case == "output dir held by a live job":
        assert sorted(p.name for p in (bad_input_files / "held").iterdir()) == [".lease.lock", "_lease.json"]


def _flat(raw: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_failing_rows_are_written_and_fail_the_job(tiny_pair, tmp_path, ray_local):
    rows = [{"id": i, "prompt": "def x y"} for i in range(6)]
    rows[4]["prompt"] = " ".join(["x"] * 60)  # too long for 64 positions with 8 new tokens
    data = _write(tmp_path / "p.jsonl", rows)
    db = tmp_path / "mlflow.db"
    raw = job_config(
        tiny_pair, data, tmp_path / "out", shard_size=3,
        **{"mlflow.enabled": True, "mlflow.tracking_uri": f"sqlite:///{db}", "ray.num_actors": 1},
    )  # fmt: skip
    report = run_generate(from_dict(raw))
    table = read_output(tmp_path / "out")
    assert table.num_rows == 6 and table.column("finish_reason").to_pylist()[4] == "error"
    assert "exceeds" in table.column("error").to_pylist()[4]
    assert table.column("error").null_count == 5
    assert report.exit_code == 1 and "1 of 6 prompts failed" in report.messages[0]
    assert report.summary.prompts_failed == 1 and report.summary.prompts_completed == 5
    assert not (tmp_path / "out" / "_SUCCESS").exists()  # every prompt has a row, but the job failed

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=report.tracking_uri).get_run(report.run_id)
    assert run.data.metrics["prompts_failed"] == 1 and run.info.status == "FAILED"
    # (a tolerant max_failed_fraction is exercised by the MLflow server test)

    # a re-run regenerates the shard with the error row (retry_failed=true), and only that one
    dispatched = []
    raw["mlflow"] = {"enabled": False}
    again = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index)))
    assert dispatched == [] and again.exit_code == 1 and again.summary.prompts_failed == 1  # too long: its input's fault (#52)
    assert read_output(tmp_path / "out").column("id").to_pylist() == list(range(6))  # still once each
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    kept = run_generate(from_dict({**raw, "retry_failed": False, "max_failed_fraction": 0.2}))
    assert kept.exit_code == 0 and (tmp_path / "out" / "_SUCCESS").exists()  # nothing regenerated: no Ray


@pytest.mark.slow  # the default suite's budget (8 min on 2 cores); see docs/testing.md
def test_rows_do_not_depend_on_how_the_actor_batches_them(tiny_pair, tmp_path, ray_local):
    """Per-row budgets alternating 2 and 30 from a data column, 4 shards on one actor: with 1 shard queued
    and 2 rows in flight, or 2 shards queued (batched together) and 8 rows in flight, every row has the
    same tokens in the Parquet output, and every budget is respected."""
    from tiny_pair_support import WORDS

    rows = [
        {"id": i, "prompt": " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(2 + i % 7)),
         "budget": 2 if i % 2 == 0 else 30}
        for i in range(24)
    ]  # fmt: skip
    data = _write(tmp_path / "p.jsonl", rows)
    tables = []
    for queued, in_flight in ((1, 2), (2, 8)):
        out = tmp_path / f"out-{queued}-{in_flight}"
        raw = job_config(
            tiny_pair, data, out, shard_size=6,
            **{"data.max_new_tokens_column": "budget", "ray.num_actors": 1, "ray.shards_per_actor": queued,
               "spectr.batch_size": in_flight},
        )  # fmt: skip
        assert run_generate(from_dict(raw)).exit_code == 0
        tables.append(read_output(out))
    a, b = tables
    assert a.column("id").to_pylist() == b.column("id").to_pylist() == list(range(24))
    assert a.column("completion_token_ids").to_pylist() == b.column("completion_token_ids").to_pylist()
    for row, count, reason in zip(rows, a.column("completion_tokens").to_pylist(), a.column("finish_reason").to_pylist()):
        assert count <= row["budget"] and (reason == "stop" or count == row["budget"])


def test_a_changed_input_or_model_is_refused_on_resume(tiny_pair, tmp_path):
    data = _write(tmp_path / "p.jsonl", [{"id": i, "prompt": "def x"} for i in range(4)])
    shutil.copytree(tiny_pair["target"], tmp_path / "target")
    raw = job_config(tiny_pair, data, tmp_path / "out", **{"model.target": str(tmp_path / "target")})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    plan.manifest.save(plan.output)  # as a first run does once it starts
    assert prepare(from_dict(raw)).manifest_on_disk  # same input, same models: resumes
    with open(data, "a") as f:
        f.write(json.dumps({"id": 9, "prompt": "def y"}) + "\n")
    with pytest.raises(JobInputError, match=r"^data.path: the input changed since .*out was started \(.*p.jsonl: size"):
        prepare(from_dict(raw))
    data.write_text("".join(json.dumps({"id": i, "prompt": "def x"}) + "\n" for i in range(4)))
    with pytest.raises(JobInputError, match="data.path: the input changed"):  # same size, rewritten: mtime
        prepare(from_dict(raw))
    plan = prepare(from_dict({**raw, "output_dir": str(tmp_path / "out2")}))
    (tmp_path / "out2").mkdir()
    plan.manifest.save(plan.output)
    from tiny_pair_support import build_llama

    vocab = json.loads((tmp_path / "target" / "config.json").read_text())["vocab_size"]
    build_llama(tmp_path / "target", vocab, hidden=32, layers=2, seed=7)  # retrained: same shapes, new weights
    with pytest.raises(JobInputError, match=r"^model.target: the model at .*target changed since .*model.safetensors"):
        prepare(from_dict({**raw, "output_dir": str(tmp_path / "out2")}))


def test_actors_killed_mid_shard_lose_and_duplicate_nothing(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """kill -9 of one actor's process from outside (Ray restarts it: ray.max_restarts), and `ray.kill` of
    another for good: every shard still comes out once, each lost one redone by another process."""
    import ray

    def kill_9(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=10,
        **{"spectr.max_new_tokens": 48, "spectr.batch_size": 1, "ray.max_restarts": 1},
    )  # fmt: skip
    pids: dict = {}
    killed: dict[int, int] = {}  # shard index -> pid of the actor killed while it held the shard
    shard_pids: dict[int, int] = {}
    timers = []

    def on_ready(actors, workers):
        pids.update({actor: worker["pid"] for actor, worker in zip(actors, workers)})

    def on_dispatch(actor, shard):  # each actor's first shard: one actor killed -9, the other for good
        if len(killed) == 2 or pids.get(actor) in killed.values() or actor not in pids:
            return
        killed[shard.index] = pids[actor]
        if len(killed) == 1:  # from outside, as the OOM killer or an operator would
            timers.append(threading.Timer(0.15, kill_9, (pids[actor],)))
        else:
            timers.append(threading.Timer(0.15, ray.kill, (actor,), {"no_restart": True}))
        timers[-1].start()

    def on_written(result):
        shard_pids[result.index] = result.worker["pid"]

    report = run_generate(from_dict(raw), RunHooks(on_ready, on_dispatch, on_written))
    for timer in timers:
        timer.join()
    assert len(killed) == 2 and len(set(killed.values())) == 2  # two actors, each while it held a shard
    for index, pid in killed.items():
        assert shard_pids[index] != pid, f"shard {index} was not redone after its actor was killed"
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == prompt_ids(prompts_jsonl)
    assert report.exit_code == 0 and report.summary.prompts_completed == 40
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_an_actor_that_stops_answering_is_given_up_and_its_shards_redone(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """SIGSTOP one actor as it gets its first shard: it answers no ping, so after heartbeat_timeout_s the
    driver gives it up and the other actor generates its queued shards; every row comes out once."""
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=5,
        **{"spectr.max_new_tokens": 16, "spectr.batch_size": 2, "ray.max_restarts": 0, "ray.heartbeat_s": 0.5,
           "ray.heartbeat_timeout_s": 4},
    )  # fmt: skip
    pids: dict = {}
    stopped: list[int] = []
    written: dict[int, int] = {}

    def on_ready(actors, workers):
        pids.update({actor: worker["pid"] for actor, worker in zip(actors, workers)})

    def on_dispatch(actor, shard):
        if shard.index == 1 and not stopped:
            stopped.append(pids[actor])
            os.kill(pids[actor], signal.SIGSTOP)

    started = time.monotonic()
    try:
        report = run_generate(
            from_dict(raw), RunHooks(on_ready, on_dispatch, lambda r: written.__setitem__(r.index, r.worker["pid"]))
        )
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert report.exit_code == 0 and stopped and time.monotonic() - started < 240
    assert written[1] != stopped[0] and stopped[0] not in written.values()
    assert read_output(tmp_path / "out").column("id").to_pylist() == prompt_ids(prompts_jsonl)
    assert (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.slow  # the default suite's budget (8 min on 2 cores); see docs/testing.md
def test_progress_moves_batch_by_batch_inside_a_shard(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """One shard of 40 prompts, batches of 1: the driver's polled progress shows prompts inside the shard
    before it ends, never goes back, and ends at 40."""
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=40,
        **{"spectr.max_new_tokens": 24, "spectr.batch_size": 1, "ray.num_actors": 1},
    )  # fmt: skip
    seen: list[int] = []
    report = run_generate(from_dict(raw), RunHooks(on_progress=seen.append))
    assert report.exit_code == 0 and seen[-1] == 40
    assert any(0 < n < 40 for n in seen), seen
    assert seen == sorted(seen)


def test_cli_prints_one_line_and_exits_2_for_bad_input(tiny_pair, tmp_path):
    result = subprocess.run(
        [
            sys.executable, "-m", "jobs.generate",
            f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
            f"data.path={tmp_path}/missing.parquet", f"output_dir={tmp_path}/out", "mlflow.enabled=false",
        ],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: data.path: no such file or directory: {tmp_path}/missing.parquet"
    ]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_parquet_rows_read_back_with_pyarrow_dataset(finished_run):
    """The output directory is a plain Parquet dataset for downstream tools."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(str(finished_run["out"]), format="parquet", exclude_invalid_files=True)
    assert dataset.count_rows() == 40
    assert pq.read_metadata(part(finished_run["out"], 0)).num_rows == 8


def test_the_ray_data_stage_gives_the_jobs_tokens_for_the_same_rows(finished_run, prompts_jsonl):
    """The job's input rows (string ids) through the Ray Data stage's actor, with the job's engine settings
    as `engine_kwargs`: every row gets the job's tokens (the same seed from the same id, the same prompt ids).
    Negative control: the rows without their ids (each seeded by its prompt text instead) get other tokens."""
    from pipeline.ray_data import SpecTrProcessorConfig, SpecTrStage
    from pipeline.ray_data.config import MODEL_KEYS, engine_keys

    raw = finished_run["raw"]
    engine = {k: v for k, v in raw["spectr"].items() if k in engine_keys()}
    engine.update({k: v for k, v in raw["model"].items() if k in MODEL_KEYS})
    stage = SpecTrStage(SpecTrProcessorConfig(model_source=raw["model"]["target"],
                                              draft_model_source=raw["model"]["draft"], engine_kwargs=engine))
    rows = [json.loads(line) for line in prompts_jsonl.read_text().splitlines()][:16]  # two of the job's shards
    job = read_output(finished_run["out"])
    expected = dict(zip(job.column("id").to_pylist(), job.column("completion_token_ids").to_pylist()))
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    assert {r["id"]: r["generated_tokens"] for r in out} == {r["id"]: expected[r["id"]] for r in rows}
    unnamed = stage.generate(pa.Table.from_pylist([{"prompt": r["prompt"]} for r in rows[:4]])).to_pylist()
    assert [r["generated_tokens"] for r in unnamed] != [expected[r["id"]] for r in rows[:4]]


def test_chat_mode_renders_messages_with_the_target_template(tiny_pair, tmp_path):
    rows = [{"id": 7, "messages": [{"role": "user", "content": "def x"}]}]
    data = _write(tmp_path / "chat.jsonl", rows)
    config = from_dict(job_config(tiny_pair, data, tmp_path / "out", **{"data.chat": True}))
    plan = prepare(config)
    assert plan.num_shards == 1
    from pipeline.generate.shards import load_shard
    from pipeline.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_pair["target"], "model.target", False)
    shard = load_shard(plan.shard(0), plan.source, tokenizer, config.data, config.spectr.seed)  # as a worker does
    assert shard.prompts == ["user : def x assistant :"] and shard.ids == [7]
    assert shard.prompt_token_ids == [
        tokenizer("user : def x assistant :", add_special_tokens=False)["input_ids"]
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two whole jobs; the default suite plans and reads compressed inputs in test_source.py
def test_a_gzipped_jsonl_input_runs_as_a_whole_job_like_the_plain_file(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """`.jsonl.gz`: the driver's scan streams the decompressed bytes, each worker decompresses in a stream up
    to its shards (several shards of one compressed file, on two actors); the rows equal the plain file's."""
    import gzip

    lines = prompts_jsonl.read_text().splitlines(keepends=True)[:20]
    plain = tmp_path / "p.jsonl"
    plain.write_text("".join(lines))
    compressed = tmp_path / "p.jsonl.gz"
    compressed.write_bytes(gzip.compress(plain.read_bytes()))
    tables = []
    for data in (compressed, plain):
        out = tmp_path / f"out-{data.name}"
        raw = job_config(tiny_pair, data, out, shard_size=4, **{"spectr.max_new_tokens": 4})
        assert run_generate(from_dict(raw)).exit_code == 0
        assert (out / "_SUCCESS").exists() and len(commit_records(out)) == 5
        tables.append(read_output(out))
    gz, txt = tables
    assert gz.column("id").to_pylist() == txt.column("id").to_pylist() == prompt_ids(plain)
    assert gz.column("completion_token_ids").to_pylist() == txt.column("completion_token_ids").to_pylist()
    assert set(gz.column("finish_reason").to_pylist()) <= {"length", "stop"}
