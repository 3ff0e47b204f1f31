"""Faults the driver heals from, on the session's real local Ray with the tiny pair (issue #23).

- A stuck actor: its target's forward blocks (installed from outside with Ray's `__ray_call__`, the
  documented test-only hook: the engine is not touched). Its pings still answer, its progress does not
  move; after `ray.stall_timeout_s` it is restarted and its shards are generated elsewhere.
- A late writer: the part an actor the driver gave up on was writing is written, marked, only after the
  shard's retry is committed (a node cut off from the driver that still reaches the storage). Ray kills
  an actor's child processes with it, so a process the test starts does the actor's write late: the bytes
  and the part name are the given-up actor's own. The fence (the attempt's part name) keeps it from
  replacing the committed part.
- A sick actor: building its batch raises a CUDA-like error on every shard (again through
  `__ray_call__`). The failed shard is retried on another actor first (quarantine), where it succeeds;
  the sick actor is then restarted, and the shards that were only its neighbours are not charged
  (`ray.shard_attempts=2`: a retry on the same actor, or a charged neighbour, would fail the job).

Each ends with the output read back: every id exactly once, only committed part files, `_SUCCESS`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ray import cloudpickle
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hooks below run on the actors


def prompt_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def commit_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "_commits.jsonl").read_text().splitlines()]


def assert_complete(out: Path, prompts: Path) -> None:
    """Every id once, in order; the directory holds exactly the committed parts; `_SUCCESS`."""
    assert read_output(out).column("id").to_pylist() == prompt_ids(prompts)
    last = {record["shard"]: record["file"] for record in commit_records(out)}
    assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(last.values())
    assert (out / "_SUCCESS").exists()


def _block_forward(generator) -> None:
    """On the actor: the target's forward waits forever (a hung kernel)."""
    import functools
    import threading

    never = threading.Event()

    @functools.wraps(generator.target.forward)  # the same signature, which the engine checks
    def stuck(*args, **kwargs):
        never.wait()

    generator.target.forward = stuck


def _sick_batch(generator) -> None:
    """On the actor: every batch it builds fails like a GPU with a sticky error."""

    def broken(config):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    generator.feed._build = broken


LATE_SCRIPT = """
import json, pathlib, sys, time
out, stage = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
log, deadline = out / "_commits.jsonl", time.time() + 300
while not (stage / "late.json").exists() and time.time() < deadline:  # the given-up actor's part
    time.sleep(0.1)
index, name = json.loads((stage / "late.json").read_text()).values()

def committed():
    for line in (log.read_text().splitlines() if log.exists() else []):
        try:
            if json.loads(line).get("shard") == index:
                return True
        except ValueError:
            pass
    return False

while not committed() and time.time() < deadline:
    time.sleep(0.1)
(out / name).write_bytes((stage / "late.bin").read_bytes())
(stage / "late.done").write_text(str(committed()))
"""


def _late_writer(generator, stage: str) -> None:
    """On the actor: the first part it writes (every completion marked LATE) and its attempt's name are left in
    `stage` for the late writing process (LATE_SCRIPT) instead of written; the actor then hangs, so the driver
    gives up on it (ray.stall_timeout_s) and kills it."""
    import threading

    from pipeline.generate import output

    original, first = output.write_shard, []

    def late(out, index, rows, schema, digits, fence):
        if first:
            return original(out, index, rows, schema, digits, fence)
        first.append(index)
        marked = [dict(row, completion="LATE " + (row.get("completion") or "")) for row in rows]
        Path(stage, "late.bin").write_bytes(output.encode_part(index, marked, schema))
        name = output.part_name(index, digits, fence)
        Path(stage, "late.json").write_text(json.dumps({"index": index, "name": name}))
        threading.Event().wait()

    output.write_shard = late


def _kill_quietly(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow  # a whole job; siblings: test_scheduler.py / test_faults3_scheduler.py (a stall restarts, fake Ray), test_generate.py (a SIGSTOPped actor restarted, real Ray)
def test_a_stuck_actor_is_restarted_and_its_shards_done_by_its_new_process(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    """One actor; pings answer, iterations do not: the watchdog (ray.stall_timeout_s) restarts it (the pool
    heals: `ray.max_restarts` applies), and the new process generates every shard. Without the watchdog the
    job would hang; without restarts it would end with no live actor."""
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=10,
        **{"spectr.max_new_tokens": 8, "spectr.batch_size": 2, "ray.max_restarts": 1, "ray.heartbeat_s": 0.5,
           "ray.num_actors": 1,
           "ray.heartbeat_timeout_s": 60, "ray.stall_timeout_s": 5},
    )  # fmt: skip
    stuck: list[int] = []
    joined: list[int] = []
    written: dict[int, int] = {}

    def on_ready(actors, workers):
        ray_local.get(actors[0].__ray_call__.remote(_block_forward))
        stuck.append(workers[0]["pid"])

    hooks = RunHooks(
        on_actors_ready=on_ready,
        on_shard_written=lambda r: written.__setitem__(r.index, r.worker["pid"]),
        on_actor_joined=lambda actor, worker: joined.append(worker["pid"]),
    )
    try:
        report = run_generate(from_dict(raw), hooks)
    finally:
        _kill_quietly(stuck)
    assert report.exit_code == 0 and stuck
    assert stuck[0] not in written.values() and set(written.values()) == set(joined[:1])  # the new process
    assert joined and stuck[0] not in joined
    assert_complete(tmp_path / "out", prompts_jsonl)


@pytest.mark.slow
def test_a_late_writer_never_replaces_the_committed_part(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """The actor the driver gave up on writes its part after the retry was committed: under its own attempt's
    name, so the committed part is untouched, and the read-back has every id once and none of its rows."""
    out, stage = tmp_path / "out", tmp_path / "stage"
    stage.mkdir()
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=10,
        **{"spectr.max_new_tokens": 8, "spectr.batch_size": 2, "ray.max_restarts": 1, "ray.heartbeat_s": 0.5,
           "ray.num_actors": 1, "ray.shards_per_actor": 1, "ray.heartbeat_timeout_s": 60, "ray.stall_timeout_s": 3},
    )  # fmt: skip
    given_up: list[int] = []

    def on_ready(actors, workers):
        ray_local.get(actors[0].__ray_call__.remote(_late_writer, str(stage)))
        given_up.append(workers[0]["pid"])

    writer = subprocess.Popen([sys.executable, "-c", LATE_SCRIPT, str(out), str(stage)])
    try:
        report = run_generate(from_dict(raw), RunHooks(on_actors_ready=on_ready))
        writer.wait(timeout=120)  # the late write lands after the commit, maybe after the job's end
    finally:
        writer.kill()
        _kill_quietly(given_up)
    assert report.exit_code == 0 and (stage / "late.done").read_text() == "True"  # written after the commit
    late = json.loads((stage / "late.json").read_text())
    records = [r for r in commit_records(out) if r["shard"] == late["index"]]
    assert records and all(r["file"] != late["name"] for r in records)  # the fence: another name
    table = read_output(out)
    assert table.column("id").to_pylist() == prompt_ids(prompts_jsonl)
    assert not any(c.startswith("LATE") for c in table.column("completion").to_pylist() if c)
    committed = out / records[-1]["file"]
    assert committed.stat().st_size == records[-1]["bytes"] and (out / "_SUCCESS").exists()


@pytest.mark.slow  # a whole job; siblings: test_scheduler.py (quarantine, fake Ray), test_feed.py, test_faults3_scheduler.py
def test_a_sick_actor_is_quarantined_and_charges_only_its_own_shard(
    tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog
):
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=5,
        **{"spectr.max_new_tokens": 8, "spectr.batch_size": 2, "ray.max_restarts": 1, "ray.shard_attempts": 2,
           "ray.heartbeat_s": 0.5},
    )  # fmt: skip
    sick: list[int] = []
    written: dict[int, int] = {}

    def on_ready(actors, workers):
        ray_local.get(actors[0].__ray_call__.remote(_sick_batch))
        sick.append(workers[0]["pid"])

    hooks = RunHooks(on_actors_ready=on_ready, on_shard_written=lambda r: written.__setitem__(r.index, r.worker["pid"]))
    with caplog.at_level("WARNING", logger="pipeline"):
        report = run_generate(from_dict(raw), hooks)
    assert report.exit_code == 0 and sick[0] not in written.values()
    assert "failed on it and then succeeded on another actor" in caplog.text  # the sick actor was restarted
    retried = [r for r in commit_records(tmp_path / "out") if r["attempt"] > 0]
    assert retried and all("-" in Path(r["file"]).stem.removeprefix("part-") for r in retried)  # fenced names
    assert_complete(tmp_path / "out", prompts_jsonl)


@pytest.mark.slow
def test_a_run_record_that_cannot_be_written_never_fails_the_job(tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog):
    """`_mlflow_run.json` becomes unwritable once the job runs (a directory in its place): every per-shard
    and final write of it is retried, then warned about; the job succeeds."""
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=10,
        **{"mlflow.enabled": True, "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )  # fmt: skip

    def on_ready(actors, workers):
        record = out / "_mlflow_run.json"
        record.unlink()
        record.mkdir()

    with caplog.at_level("WARNING", logger="pipeline"):
        report = run_generate(from_dict(raw), RunHooks(on_actors_ready=on_ready))
    assert report.exit_code == 0 and "run record: could not write" in caplog.text
    assert_complete(out, prompts_jsonl)


@pytest.mark.slow
def test_the_job_starts_with_the_actors_that_loaded_and_replaces_a_failed_one(
    tiny_pair, prompts_jsonl, tmp_path, ray_local, monkeypatch, caplog
):
    """One of two actors dies while loading the pair: the job starts with the other at once (the old pool
    aborted: "an actor failed to load"), a new actor is started in its place (ray.max_restarts), and the
    output is complete."""
    from pipeline.generate.scheduler import ShardActorPool

    raw = job_config(tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=5, **{"ray.max_restarts": 1})
    original = ShardActorPool.wait_ready

    def kill_one_then_wait(self):
        ray_local.kill(self.actors[1], no_restart=True)
        return original(self)

    monkeypatch.setattr(ShardActorPool, "wait_ready", kill_one_then_wait)
    started: list[int] = []
    hooks = RunHooks(on_actors_ready=lambda actors, workers: started.append(len(workers)))
    with caplog.at_level("WARNING", logger="pipeline"):
        report = run_generate(from_dict(raw), hooks)
    assert report.exit_code == 0 and started == [1]
    assert "starting a new actor in its place" in caplog.text
    assert_complete(tmp_path / "out", prompts_jsonl)


def _slow_forward(generator) -> None:
    """On the actor: every target forward takes 0.2 s longer (a slow device), so the job outlasts a join."""
    import functools
    import time

    original = generator.target.forward

    @functools.wraps(original)
    def slow(*args, **kwargs):
        time.sleep(0.2)
        return original(*args, **kwargs)

    generator.target.forward = slow


@pytest.mark.slow
def test_an_actor_waiting_for_room_joins_however_late_while_another_works(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    """A lost node, in one process: another actor holds one of the session's 2 CPUs, so the job's second
    actor cannot be placed; the job starts with one (slowed down, so that the job outlasts the join). The
    CPU comes back only after `ray.actor_start_timeout_s`, once the first shard is written: the waiting
    actor was not given up (the old pool gave it up at its first heartbeat and ended with one actor), it
    joins and generates shards; every id once, `_SUCCESS`."""

    @ray_local.remote(num_cpus=1)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray_local.get(holder.ready.remote())
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out", shard_size=2,
        **{"spectr.max_new_tokens": 16, "spectr.batch_size": 1, "ray.heartbeat_s": 0.5,
           "ray.actor_start_timeout_s": 15},
    )  # fmt: skip
    joined: list[int] = []
    written: dict[int, int] = {}

    def slow_first(actors, workers):  # the job started with the actor that had room
        ray_local.get(actors[0].__ray_call__.remote(_slow_forward))

    def on_written(result):
        if not written:
            ray_local.kill(holder)  # the room returns (after actor_start_timeout_s: wait_ready waited 15 s)
        written[result.index] = result.worker["pid"]

    hooks = RunHooks(
        on_actors_ready=slow_first, on_shard_written=on_written,
        on_actor_joined=lambda actor, worker: joined.append(worker["pid"]),
    )  # fmt: skip
    try:
        report = run_generate(from_dict(raw), hooks)
    finally:
        ray_local.kill(holder)
    assert report.exit_code == 0 and joined, "the waiting actor never joined"
    assert joined[0] in written.values() and len(set(written.values())) == 2  # both actors generated
    assert_complete(tmp_path / "out", prompts_jsonl)


@pytest.mark.slow
def test_a_job_whose_every_actor_is_sick_fails_without_success_and_a_rerun_completes(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    """Both actors raise the CUDA-like error on every shard and cannot be restarted (`ray.max_restarts=0`):
    a shard fails on both (`ray.shard_attempts=2`) and the job fails, with no `_SUCCESS`; a re-run on
    healthy actors generates what is missing and ends complete."""
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=5,
        **{"spectr.max_new_tokens": 8, "spectr.batch_size": 2, "ray.max_restarts": 0, "ray.shard_attempts": 2,
           "ray.heartbeat_s": 0.5},
    )  # fmt: skip

    def all_sick(actors, workers):
        ray_local.get([actor.__ray_call__.remote(_sick_batch) for actor in actors])

    with pytest.raises(RuntimeError, match=r"(?s)failed 2 time\(s\); last error: .*CUDA error"):
        run_generate(from_dict(raw), RunHooks(on_actors_ready=all_sick))
    assert (out / "_manifest.json").exists() and not (out / "_SUCCESS").exists()
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0
    assert_complete(out, prompts_jsonl)
