"""Resume after the driver is SIGKILLed mid-run: exactly one row per prompt, finished shards untouched.

The job runs as a real `python -m jobs.generate` process that joins the test session's Ray instance by
address (`ray.address=<gcs address>`, as a driver joins any running cluster). Once the commit log lists two
finished shards, the driver gets SIGKILL (no cleanup of any kind; Ray then ends the dead driver's actors);
the same command is then run again in the same output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.generate.reader import read_output


def command(tiny_pair, data: Path, out: Path, address: str) -> list[str]:
    return [
        sys.executable, "-m", "jobs.generate",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={data}", f"output_dir={out}", "shard_size=4", "ray.num_actors=1", f"ray.address={address}",
        "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3", "spectr.max_new_tokens=40", "spectr.batch_size=1",
        "mlflow.enabled=false", "progress=false", "lease_timeout_s=6",  # the killed driver's lease: 6 s of watching
    ]  # fmt: skip


def listed_shards(out: Path) -> dict[int, dict]:
    """The commit log's records by shard (a torn last line skipped)."""
    try:
        lines = (out / "_commits.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    records = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[record["shard"]] = record
    return records


def job_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token")


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the process group we started (the job's own Ray processes)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_after_two_shards(driver: subprocess.Popen, out) -> None:
    """SIGKILL the job's driver once the commit log lists two shards (and its session, whatever happens)."""
    try:
        deadline = time.monotonic() + 180
        while len(listed_shards(out)) < 2:
            assert driver.poll() is None, f"the job ended before it could be killed:\n{driver.stderr.read()}"
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        kill_session(driver)


# slow: 30 s of a real SIGKILLed driver; the default suite resumes in process (test_resume_does_only_missing_shards)
@pytest.mark.slow
def test_driver_sigkill_then_rerun(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    out = tmp_path / "out"
    address = ray_local.get_runtime_context().gcs_address
    env = job_env()
    driver = subprocess.Popen(
        command(tiny_pair, prompts_jsonl, out, address),
        cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    kill_after_two_shards(driver, out)
    before = listed_shards(out)
    assert 2 <= len(before) < 10, "the kill should land mid-run"
    assert not (out / "_SUCCESS").exists()
    digests = {
        entry["file"]: hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()
        for entry in before.values()
    }

    rerun = subprocess.run(
        command(tiny_pair, prompts_jsonl, out, address), cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, start_new_session=True,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: {4 * len(before)} prompts already done" in rerun.stdout + rerun.stderr

    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids  # exactly one row per prompt, in order
    assert (out / "_SUCCESS").exists() and len(listed_shards(out)) == 10
    for name, digest in digests.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, f"{name} changed"
    assert not list(out.glob(".*tmp*"))


# slow: a real SIGKILLed driver; the default suite resumes a samples job in process
# (tests/pipeline/generate/test_samples_shards.py::test_job_spreads_few_prompts_samples_over_both_actors)
@pytest.mark.slow
def test_driver_sigkill_mid_samples_then_rerun(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """8 prompts x 4 samples, 2 output rows a shard: each prompt's samples in two shards (0-1, 2-3). Killed
    after two shards, the rerun leaves every (id, sample_index) exactly once, the listed parts untouched."""
    out = tmp_path / "out"
    address = ray_local.get_runtime_context().gcs_address
    args = command(tiny_pair, prompts_jsonl, out, address) + ["spectr.num_samples=4", "data.limit=8",
                                                               "spectr.max_new_tokens=24"]
    args[args.index("shard_size=4")] = "shard_size=2"
    env = job_env()
    driver = subprocess.Popen(args, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    kill_after_two_shards(driver, out)
    before = listed_shards(out)
    assert 2 <= len(before) < 16, "the kill should land mid-run"
    assert all(entry["rows"] == 2 for entry in before.values())
    digests = {e["file"]: hashlib.sha256((out / e["file"]).read_bytes()).hexdigest() for e in before.values()}

    rerun = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                           start_new_session=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = rerun.stdout + rerun.stderr
    assert "8 prompts x 4 samples = 32 rows" in said and f"resuming: {2 * len(before)} rows already done" in said
    table = read_output(out)
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()][:8]
    pairs = list(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
    assert sorted(pairs) == sorted((i, s) for i in ids for s in range(4))  # every (id, sample) exactly once
    assert (out / "_SUCCESS").exists() and len(listed_shards(out)) == 16
    for name, digest in digests.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, f"{name} changed"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
