"""Two jobs started at the same moment on one output_dir: one runs, the other is refused; nothing corrupted.

Both are real `python -m jobs.generate` processes joining the test session's Ray by address. The refused
one exits 2 with one line naming the holder (host and pid of the running job), before it starts any actor;
the running one finishes with exactly one row per prompt and `_SUCCESS`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pipeline.generate.reader import read_output


def command(tiny_pair, data, out, address) -> list[str]:
    return [
        sys.executable, "-m", "jobs.generate",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={data}", f"output_dir={out}", "shard_size=8", "ray.num_actors=1", f"ray.address={address}",
        "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3", "spectr.max_new_tokens=24", "spectr.batch_size=2",
        "mlflow.enabled=false", "progress=false",
        # the holder's counter moves every lease_timeout_s / 6 = 0.5 s: the second job sees it move, and is
        # refused, long before the first ends (with the default 10 s, it may still be watching then, and run after it)
        "lease_timeout_s=3",
    ]  # fmt: skip


# slow: two whole jobs; the default suite refuses a second job on a live lease in
# tests/pipeline/generate/test_lease.py::test_a_live_lease_refuses_a_second_job_and_names_the_holder
@pytest.mark.slow
def test_two_jobs_at_once_one_runs_one_is_refused(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    out = tmp_path / "out"
    address = ray_local.get_runtime_context().gcs_address
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token")
    jobs = [
        subprocess.Popen(
            command(tiny_pair, prompts_jsonl, out, address),
            cwd=tmp_path,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        outputs = [job.communicate(timeout=300) for job in jobs]
        results = [(job.returncode, stdout, stderr) for job, (stdout, stderr) in zip(jobs, outputs)]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, 9)
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [r[2][-2000:] for r in results]
    ((_, _, refused),) = [r for r in results if r[0] == 2]
    winner = next(job for job, r in zip(jobs, results) if r[0] == 0)
    assert refused.strip().splitlines() == [refused.strip().splitlines()[-1]]  # one line, no traceback
    assert refused.startswith(f"error: output_dir: {out} is being written by another job")
    assert f"host {socket.gethostname()}, pid {winner.pid}," in refused  # it names the holder
    assert "Connected to Ray" not in refused  # refused before it joined Ray, let alone started an actor
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids  # exactly once, in order
    assert (out / "_SUCCESS").exists() and not (out / "_lease.json").exists()
    commits = [json.loads(line) for line in (out / "_commits.jsonl").read_text().splitlines()]
    assert sorted(c["shard"] for c in commits) == list(range(5)) and len({c["run"] for c in commits}) == 1
