"""Faults as the job meets them, measured: a stuck actor, and a node lost and another added.

    python scripts/measure_faults.py --out benchmarks/results/faults.json             # both parts
    python scripts/measure_faults.py --part stuck --prompts 48 --pair tiny --out bench_out/faults.json

`--part stuck` (issue #23: "a job with a stuck actor finishes within stall_timeout_s + one shard"): the
real job (`run_generate`) on a local Ray with 2 CPUs, 2 actors of 1 CPU, one shard queued per actor (so a
shard's dispatch -> commit is its own time), run three times on one Ray instance:
- `baseline`: no fault; one shard's time (median and max of dispatch -> commit);
- `sigstop`: SIGSTOP of one actor's process as it gets its 3rd shard. A stopped process answers no ping
  either, so `ray.heartbeat_timeout_s` is set above `ray.stall_timeout_s` here (the job's defaults, 30 s
  vs 300 s, would have the heartbeat fire first): the log line that re-queued the shard says which fired;
- `blocked`: the case the watchdog exists for: one actor's target forward blocks (installed with Ray's
  `__ray_call__`, as tests/jobs/test_generate_faults.py does), its pings still answer.
For each fault: the time from the fault to the re-queue (and which timeout fired), from the re-queue to the
stuck shard's commit (on the other actor); the goal `generation time - the baseline's <= stall_timeout_s +
one shard (the baseline's slowest)`, and `fault -> stuck shard committed <= stall_timeout_s + heartbeat_s +
two shards` (the re-queued shard waits for the other actor's shard in progress); the output read back
(every id once, `_SUCCESS`).

`--part nodes` ("a two-node job that loses a node and gets one back ends with both nodes working"): a real
two-node cluster on this machine (`ray start --head` and `ray start --address`, one CPU each, from
`tests/cluster_support.py`), the job as a driver process joining it with 2 actors. Once both nodes have
committed a shard, the worker node's process group is SIGKILLed; `--away-s` later a new worker node
starts. Per node, the shards committed before the loss, while it was away and after the return; the time
from the loss to the first re-queue and from the return to the new node's first commit.

Models: `--pair embedded` (assets/models, float32: shards of real length) or `--pair tiny` (the tests'
random pair, built here: a quick check of the script).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report  # noqa: E402

sys.path.append(str(PROJECT_ROOT / "tests"))  # the tiny pair and the local cluster of the tests

EMBEDDED = {"target": PROJECT_ROOT / "assets/models/target", "draft": PROJECT_ROOT / "assets/models/draft"}


def build_pair(folder: Path, prompts: int) -> tuple[dict[str, Path], Path]:
    """The tiny random pair and `prompts` prompts for it."""
    import random

    from tiny_pair_support import WORDS, build_llama, build_tokenizer

    pair = {"target": folder / "target", "draft": folder / "draft"}
    tokenizer = build_tokenizer(WORDS, pair["target"])
    build_tokenizer(WORDS, pair["draft"])
    build_llama(pair["target"], len(tokenizer), hidden=32, layers=2, seed=1, max_positions=128)
    build_llama(pair["draft"], len(tokenizer), hidden=16, layers=1, seed=2, max_positions=128)
    rng = random.Random(0)
    path = folder / "prompts.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"q{i:05d}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))}) + "\n"
        for i in range(prompts)))  # fmt: skip
    return pair, path


def inputs(args: argparse.Namespace, folder: Path) -> tuple[dict[str, Path], Path]:
    if args.pair == "tiny":
        return build_pair(folder, args.prompts)
    path = folder / "prompts.jsonl"
    lines = (PROJECT_ROOT / "assets/prompts.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: args.prompts]))
    return EMBEDDED, path


def job_raw(args: argparse.Namespace, pair: dict[str, Path], prompts: Path, out: Path, **ray: Any) -> dict:
    return {
        "model": {"target": str(pair["target"]), "draft": str(pair["draft"]), "dtype": "float32"},
        "data": {"path": str(prompts), "limit": None},
        "spectr": {"method": "spectr", "num_drafts": 2, "draft_length": 3,
                   "max_new_tokens": args.new_tokens, "batch_size": args.batch_size},  # fmt: skip
        "ray": {"num_actors": 2, "cpus_per_actor": 1, "shards_per_actor": 1, "heartbeat_s": 1.0,
                "max_restarts": 2, **ray},  # fmt: skip
        "mlflow": {"enabled": False},
        "output_dir": str(out),
        "shard_size": args.shard_size,
        "progress": False,
    }


def block_forward(generator: Any) -> None:
    """On the actor: the target's forward waits forever (a hung kernel); pings still answer."""
    import functools

    never = threading.Event()

    @functools.wraps(generator.target.forward)
    def stuck(*a: Any, **k: Any) -> None:
        never.wait()

    generator.target.forward = stuck


class Recorder(logging.Handler):
    """The pipeline's warnings with their times (monotonic)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.getMessage()))

    def first(self, pattern: str, after: float) -> tuple[float, str] | None:
        return next(((t, m) for t, m in self.lines if t >= after and re.search(pattern, m)), None)


class FaultHooks:
    """RunHooks that time every shard (dispatch -> commit) and inject the arm's fault into actor 0."""

    def __init__(self, ray: Any, arm: str):
        self.ray, self.arm = ray, arm
        self.pids: dict[Any, int] = {}
        self.first_actor: Any = None
        self.dispatched: dict[tuple[int, int], float] = {}
        self.written: dict[int, tuple[float, float, int]] = {}  # index -> (time, shard seconds, pid)
        self.to_first: int = 0  # shards dispatched to actor 0 so far
        self.fault: tuple[float, int] | None = None  # (when, the stuck shard's index)

    def hooks(self) -> Any:
        from pipeline.generate.scheduler import RunHooks

        return RunHooks(on_actors_ready=self.on_ready, on_dispatch=self.on_dispatch, on_shard_written=self.on_written)

    def on_ready(self, actors: list[Any], workers: list[dict[str, Any]]) -> None:
        self.pids = {actor: worker["pid"] for actor, worker in zip(actors, workers)}
        self.first_actor = actors[0]
        if self.arm == "blocked":
            self.ray.get(actors[0].__ray_call__.remote(block_forward))

    def on_dispatch(self, actor: Any, task: Any) -> None:
        now = time.monotonic()
        self.dispatched[(task.index, task.attempt)] = now
        if actor is not self.first_actor or self.fault is not None or self.arm == "baseline":
            return
        self.to_first += 1
        if self.arm == "blocked":
            self.fault = (now, task.index)  # its first shard: it never finishes a forward
        elif self.to_first == 3:
            os.kill(self.pids[actor], signal.SIGSTOP)
            self.fault = (time.monotonic(), task.index)

    def on_written(self, result: Any) -> None:
        now = time.monotonic()
        sent = self.dispatched.get((result.index, result.attempt), now)
        self.written[result.index] = (now, now - sent, result.worker["pid"])

    def release(self) -> None:
        if self.fault is None:
            return
        try:  # the stopped or stuck process, should it outlive Ray's kill
            os.kill(self.pids[self.first_actor], signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_arm(args: argparse.Namespace, ray: Any, arm: str, pair: dict, prompts: Path, folder: Path) -> dict:
    from pipeline.generate.config import from_dict
    from pipeline.generate.job import run_generate
    from pipeline.generate.reader import read_output

    out = folder / f"out-{arm}"
    timeouts = {"stall_timeout_s": args.stall_timeout_s, "heartbeat_timeout_s": args.heartbeat_timeout_s}
    probe, recorder = FaultHooks(ray, arm), Recorder()
    logging.getLogger("pipeline").addHandler(recorder)
    try:
        report = run_generate(from_dict(job_raw(args, pair, prompts, out, **timeouts)), probe.hooks())
    finally:
        logging.getLogger("pipeline").removeHandler(recorder)
        probe.release()
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    seconds = [s for _, s, _ in probe.written.values()]
    result = {
        "arm": arm, "exit_code": report.exit_code, "wall_time_s": round(report.summary.wall_time_s, 2),
        "generation_s": round(report.summary.generation_s, 2), "shards": len(probe.written),
        "shard_s_median": round(statistics.median(seconds), 2), "shard_s_max": round(max(seconds), 2),
        "every_id_once": read_output(out).column("id").to_pylist() == ids, "success": (out / "_SUCCESS").exists(),
        "warnings": [m[:160] for _, m in recorder.lines],
    }  # fmt: skip
    if probe.fault is not None:
        result.update(fault_times(probe, recorder))
    return result


def fault_times(probe: FaultHooks, recorder: Recorder) -> dict:
    at, index = probe.fault
    requeue = recorder.first(r"restarting an actor|giving up an actor", at)
    done_at, _, pid = probe.written[index]
    fired = "none"
    if requeue is not None:
        fired = "stall (ray.stall_timeout_s)" if "stall_timeout_s" in requeue[1] else (
            "heartbeat (ray.heartbeat_timeout_s)" if "no answer" in requeue[1] else requeue[1][:80])
    return {
        "stuck_shard": index,
        "fault_to_requeue_s": round(requeue[0] - at, 2) if requeue else None,
        "which_timeout_fired": fired,
        "requeue_to_stuck_shard_committed_s": round(done_at - requeue[0], 2) if requeue else None,
        "fault_to_stuck_shard_committed_s": round(done_at - at, 2),
        "stuck_shard_done_by_another_process": pid != probe.pids.get(probe.first_actor),
    }


def part_stuck(args: argparse.Namespace, folder: Path) -> dict:
    import ray

    pair, prompts = inputs(args, folder)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024 * 1024)
    try:
        arms = [run_arm(args, ray, arm, pair, prompts, folder) for arm in ("baseline", "sigstop", "blocked")]
    finally:
        ray.shutdown()
    shard_max = arms[0]["shard_s_max"]
    for arm in arms[1:]:  # the goal: the job takes at most stall_timeout_s + one shard longer
        arm["extra_generation_s_vs_baseline"] = round(arm["generation_s"] - arms[0]["generation_s"], 2)
        arm["goal_s"] = round(args.stall_timeout_s + shard_max, 2)
        arm["extra_within_goal"] = arm["extra_generation_s_vs_baseline"] <= arm["goal_s"]
        # the stuck shard itself: seen stalled at a ping (+ heartbeat_s), then, on another actor, that actor's
        # shard in progress (one queued per actor) and its own
        arm["stuck_shard_bound_s"] = round(args.stall_timeout_s + 1.0 + 2 * shard_max, 2)
        arm["stuck_shard_within_bound"] = arm["fault_to_stuck_shard_committed_s"] <= arm["stuck_shard_bound_s"]
    return {"stall_timeout_s": args.stall_timeout_s, "heartbeat_timeout_s": args.heartbeat_timeout_s,
            "heartbeat_s": 1.0, "arms": arms}  # fmt: skip


EVENTS = r"re-queued|restarting|giving up|joined|answers again|new actor|unavailable|handing it|not loaded"


class DriverLog:
    """The driver's output lines with their wall-clock times, read on a thread."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def first(self, pattern: str, after: float) -> float | None:
        return next((t for t, line in self.lines if t >= after and re.search(pattern, line)), None)


def start_driver(args: argparse.Namespace, cluster: Any, pair: dict, prompts: Path, out: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "jobs.generate", f"ray.address=127.0.0.1:{cluster.gcs_port}",
        f"model.target={pair['target']}", f"model.draft={pair['draft']}", "model.dtype=float32",
        f"data.path={prompts}", "data.limit=null", f"output_dir={out}", f"shard_size={args.shard_size}",
        "ray.num_actors=2", "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3",
        f"spectr.max_new_tokens={args.new_tokens}", f"spectr.batch_size={args.batch_size}", "ray.heartbeat_s=1",
        "ray.heartbeat_timeout_s=10", "mlflow.enabled=false", "progress=false",
    ]  # fmt: skip
    env = dict(cluster.env, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.Popen(command, env=env, cwd=out.parent, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def lose_and_return(args: argparse.Namespace, cluster: Any, driver: subprocess.Popen, out: Path) -> dict:
    """Wait until both nodes committed a shard; kill the worker node; `--away-s` later, a new one."""
    from cluster_support import commit_records

    nodes = json.loads(cluster.ray("list", "nodes", "--format=json", f"--address={cluster.dashboard}").stdout)
    head = next(node["node_id"] for node in nodes if node["is_head_node"])
    deadline = time.monotonic() + 300
    while len({r["worker"]["node_id"] for r in commit_records(out)}) < 2:
        if driver.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("both nodes did not commit a shard in time")
        time.sleep(0.2)
    lost_pids = {r["worker"]["pid"] for r in commit_records(out) if r["worker"]["node_id"] != head}
    lost_at = time.time()
    cluster.kill_worker_node()
    for pid in lost_pids:  # its actor too, should it outlive its raylet
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(args.away_s)
    back_at = time.time()
    cluster.add_worker_node()
    return {"head": head, "lost_at": lost_at, "back_at": back_at}


def node_windows(records: list[dict], head: str, lost_at: float, back_at: float) -> dict:
    """Shards committed per node: before the loss, while the node was away, after the return."""
    names: dict[str, str] = {head: "head"}
    windows: dict[str, dict[str, int]] = {"before_loss": {}, "while_away": {}, "after_return": {}}
    for record in records:
        node = record["worker"]["node_id"]
        if node not in names:
            names[node] = "lost node" if record["time"] < lost_at else "returned node"
        window = "before_loss" if record["time"] < lost_at else "while_away" if record["time"] < back_at else "after_return"
        windows[window][names[node]] = windows[window].get(names[node], 0) + 1
    return windows


def part_nodes(args: argparse.Namespace, folder: Path) -> dict:
    import shutil

    from cluster_support import LocalCluster, commit_records

    from pipeline.generate.reader import read_output

    pair, prompts = inputs(args, folder)
    out = folder / "out-nodes"
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # Ray's socket paths must stay short
    cluster = LocalCluster(root / "ray")
    try:
        cluster.start()
        started = time.time()
        driver = start_driver(args, cluster, pair, prompts, out)
        driver_log = DriverLog(driver)
        try:
            times = lose_and_return(args, cluster, driver, out)
            driver.wait(timeout=args.node_timeout_s)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
        driver_log.thread.join(timeout=10)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    records = commit_records(out)
    windows = node_windows(records, times["head"], times["lost_at"], times["back_at"])
    returned = [r["time"] for r in records if r["time"] >= times["back_at"] and r["worker"]["node_id"] != times["head"]]
    requeued = driver_log.first(r"re-queued|handing it to another actor|go to the others", times["lost_at"])
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    return {
        "exit_code": driver.returncode, "prompts": len(ids), "shards": len({r["shard"] for r in records}),
        "job_wall_s": round(time.time() - started, 1), "away_s": args.away_s, "shards_per_node": windows,
        "loss_to_first_requeue_s": round(requeued - times["lost_at"], 2) if requeued else None,
        "return_to_first_commit_of_the_returned_node_s": round(min(returned) - times["back_at"], 2) if returned else None,
        "both_nodes_working_after_return": len(windows["after_return"]) == 2,
        "every_id_once": read_output(out).column("id").to_pylist() == ids, "success": (out / "_SUCCESS").exists(),
        "driver_events": [f"{t - times['lost_at']:+.1f} s after the loss: {line[:150]}" for t, line in driver_log.lines
                          if re.search(EVENTS, line)][-30:],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("stuck", "nodes", "both"), default="both")
    parser.add_argument("--pair", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument("--prompts", type=int, default=96, help="prompts of the stuck-actor jobs")
    parser.add_argument("--node-prompts", type=int, default=1000, help="prompts of the two-node job")
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--stall-timeout-s", type=float, default=20.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=120.0)
    parser.add_argument("--away-s", type=float, default=15.0, help="how long the lost node stays away")
    parser.add_argument("--node-timeout-s", type=float, default=540.0)
    parser.add_argument("--out", default="bench_out/faults.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    report = Report("faults", args=args)
    print(report.header(), flush=True)
    results: dict[str, Any] = {"pair": args.pair, "shard_size": args.shard_size, "new_tokens": args.new_tokens,
                               "batch_size": args.batch_size}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="faults-") as folder:
        if args.part in ("stuck", "both"):
            results["stuck"] = part_stuck(args, Path(folder))
            print(json.dumps(results["stuck"], indent=1), flush=True)
        if args.part in ("nodes", "both"):
            node_args = argparse.Namespace(**{**vars(args), "prompts": args.node_prompts})
            (Path(folder) / "nodes").mkdir()
            results["nodes"] = part_nodes(node_args, Path(folder) / "nodes")
            print(json.dumps(results["nodes"], indent=1), flush=True)
    report.write(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
