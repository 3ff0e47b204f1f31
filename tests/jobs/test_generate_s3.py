"""Input and output on a real S3 API: moto's S3 server on 127.0.0.1, started here, reached over HTTP.

The job reads `s3://` prompts and writes `s3://` results with credentials and endpoint from the standard
AWS variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`). The driver
forwards the endpoint and region to its actors (on the session's Ray, started before moto), never the keys:
the actors read them from the file `AWS_SHARED_CREDENTIALS_FILE` names, as nodes of a real cluster would. Covers: exactly one row per prompt read back from S3; resume after the
driver is SIGKILLed (committed parts untouched; slow; the default suite resumes a copy of a finished run with
a shard missing, in process); an unreachable endpoint, wrong credentials and a missing
bucket refused up front in one line with nothing written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_support import CREDENTIALS, free_port, moto_s3, start_moto, stop
from tiny_pair_support import job_config

from pipeline.errors import JobInputError
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with buckets 'prompts' and 'results'; the AWS variables point at it meanwhile."""
    with moto_s3(tmp_path_factory.mktemp("moto"), ("prompts", "results")) as (url, client):
        yield {"url": url, "client": client}


def keys(client, bucket: str, prefix: str) -> list[str]:
    found = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(item["Key"][len(prefix) :] for item in found)


def upload_jsonl(client, key: str, rows: list[dict]) -> None:
    client.put_object(Bucket="prompts", Key=key, Body="".join(json.dumps(r) + "\n" for r in rows).encode())


@pytest.fixture(scope="module")
def s3_run(s3, tiny_pair, prompts_jsonl, ray_local):
    """One complete job from a folder of Parquet files on S3 to s3://results/run1 (5 shards of 8)."""
    rows = [json.loads(line) for line in prompts_jsonl.read_text().splitlines()]
    for part, chunk in enumerate((rows[:17], rows[17:])):  # a folder of Parquet files
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(chunk), sink, row_group_size=6)
        s3["client"].put_object(
            Bucket="prompts", Key=f"pq/part-{part}.parquet", Body=sink.getvalue().to_pybytes()
        )
    raw = job_config(tiny_pair, "s3://prompts/pq", "s3://results/run1", shard_size=8)
    return {"rows": rows, "raw": raw, "report": run_generate(from_dict(raw))}


def test_input_and_output_on_s3(s3, s3_run):
    rows, report = s3_run["rows"], s3_run["report"]
    assert report.exit_code == 0 and report.summary.prompts_completed == 40
    table = read_output("s3://results/run1")
    assert table.column("id").to_pylist() == [r["id"] for r in rows]  # exactly once, in order
    names = [name for name in keys(s3["client"], "results", "run1/") if name]  # '': pyarrow's folder marker
    assert names == ["_SUCCESS", "_commits/seg-000001-000000.jsonl", "_manifest.json"] + sorted(
        record["file"] for record in committed(s3["client"], "run1").values()
    )  # no lease left, no temporary objects: the committed parts only
    manifest = json.loads(s3["client"].get_object(Bucket="results", Key="run1/_manifest.json")["Body"].read())
    assert [f["path"] for f in manifest["settings"]["inputs"]] == [
        f"s3://prompts/pq/part-{i}.parquet" for i in range(2)
    ]


def test_s3_resume_redoes_only_the_missing_shard(s3, s3_run):
    """The default suite's resume on S3 (the SIGKILLed driver is the slow test below): a copy of the
    finished run as a dead driver leaves it (shard 4's part and commit record missing, no _SUCCESS);
    the rerun generates shard 4 only, leaves the other parts untouched, and every row comes out once."""
    client = s3["client"]
    for name in keys(client, "results", "run1/"):
        if name and name not in ("_SUCCESS", committed(client, "run1")[4]["file"]):
            client.copy_object(
                Bucket="results", Key=f"resumed/{name}", CopySource={"Bucket": "results", "Key": f"run1/{name}"}
            )
    segment = "resumed/_commits/seg-000001-000000.jsonl"
    lines = client.get_object(Bucket="results", Key=segment)["Body"].read().decode().splitlines()
    kept = [line for line in lines if json.loads(line)["shard"] != 4]
    client.put_object(Bucket="results", Key=segment, Body=("\n".join(kept) + "\n").encode())
    parts = {i: record["file"] for i, record in committed(client, "run1").items()}
    etags = {i: client.head_object(Bucket="results", Key=f"resumed/{parts[i]}")["ETag"] for i in range(4)}

    dispatched = []
    raw = dict(s3_run["raw"], output_dir="s3://results/resumed", ray={"num_actors": 1})
    report = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index)))
    assert dispatched == [4] and report.exit_code == 0 and report.summary.prompts_this_run == 8
    assert read_output("s3://results/resumed").column("id").to_pylist() == [r["id"] for r in s3_run["rows"]]
    assert "_SUCCESS" in keys(client, "results", "resumed/") and len(committed(client, "resumed")) == 5
    for i, etag in etags.items():
        assert client.head_object(Bucket="results", Key=f"resumed/{parts[i]}")["ETag"] == etag, i


def command(tiny_pair, out: str, address: str) -> list[str]:
    return [
        sys.executable, "-m", "jobs.generate",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        "data.path=s3://prompts/p.jsonl", f"output_dir={out}", "shard_size=4", "ray.num_actors=1",
        f"ray.address={address}", "spectr.method=spectr", "spectr.num_drafts=2", "spectr.draft_length=3", "spectr.max_new_tokens=24",
        "spectr.batch_size=1", "mlflow.enabled=false", "progress=false",
        "lease_timeout_s=6",  # the killed driver's lease stands still: the rerun watches it 6 s, then takes it
    ]  # fmt: skip


def committed(client, prefix: str) -> dict[int, dict]:
    records = {}
    for name in keys(client, "results", f"{prefix}/_commits/"):
        body = client.get_object(Bucket="results", Key=f"{prefix}/_commits/{name}")["Body"].read()
        records.update({r["shard"]: r for r in map(json.loads, body.decode().splitlines())})
    return records


@pytest.mark.slow
def test_s3_resume_after_sigkill_has_every_row_once(s3, tiny_pair, prompts_jsonl, tmp_path, ray_local):
    rows = [json.loads(line) for line in prompts_jsonl.read_text().splitlines()]
    upload_jsonl(s3["client"], "p.jsonl", rows)
    address = ray_local.get_runtime_context().gcs_address
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token")
    driver = subprocess.Popen(
        command(tiny_pair, "s3://results/killed", address), cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(committed(s3["client"], "killed")) < 2:
            assert driver.poll() is None, f"the job ended before it could be killed:\n{driver.stderr.read()}"
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    before = committed(s3["client"], "killed")
    assert 2 <= len(before) < 10 and "_SUCCESS" not in keys(s3["client"], "results", "killed/")
    etags = {
        r["file"]: s3["client"].head_object(Bucket="results", Key=f"killed/{r['file']}")["ETag"]
        for r in before.values()
    }

    rerun = subprocess.run(
        command(tiny_pair, "s3://results/killed", address), cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, start_new_session=True,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: {4 * len(before)} prompts already done" in rerun.stdout + rerun.stderr
    assert read_output("s3://results/killed").column("id").to_pylist() == [r["id"] for r in rows]
    assert (
        "_SUCCESS" in keys(s3["client"], "results", "killed/")
        and len(committed(s3["client"], "killed")) == 10
    )
    for name, etag in etags.items():  # the parts committed before the kill were not rewritten
        assert s3["client"].head_object(Bucket="results", Key=f"killed/{name}")["ETag"] == etag, name


def test_s3_problems_are_refused_up_front_with_nothing_written(
    s3, tiny_pair, prompts_jsonl, tmp_path, monkeypatch
):
    upload_jsonl(s3["client"], "small.jsonl", [{"id": 1, "prompt": "def x"}])
    out = tmp_path / "out"
    cases = [
        ({"data.path": "s3://nobucket/p.jsonl"}, {}, r"^data.path: bucket 'nobucket' of s3://nobucket/p.jsonl does not exist"),
        ({"data.path": "s3://prompts/missing.jsonl"}, {}, r"^data.path: no such file or directory: s3://prompts/missing"),
        ({"output_dir": "s3://nobucket/out"}, {}, r"^output_dir: bucket 'nobucket' of s3://nobucket/out does not exist"),
        ({}, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, r"^data.path: cannot reach .*Could not connect|^data.path: cannot reach"),
    ]  # fmt: skip
    for overrides, env, message in cases:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            raw = job_config(tiny_pair, "s3://prompts/small.jsonl", out, **overrides)
            started = time.monotonic()
            with pytest.raises(JobInputError, match=message) as caught:
                run_generate(from_dict(raw))
            assert "\n" not in str(caught.value) and time.monotonic() - started < 60
    assert not out.exists()
    assert keys(s3["client"], "results", "") == [
        k for k in keys(s3["client"], "results", "") if not k.startswith("out")
    ]


def test_wrong_credentials_exit_2_in_one_line(tiny_pair, tmp_path):
    server, url = start_moto(tmp_path, "moto-auth", INITIAL_NO_AUTH_ACTION_COUNT="0")  # checks credentials
    try:
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "wrong"}
        result = subprocess.run(
            [
                sys.executable, "-m", "jobs.generate", f"model.target={tiny_pair['target']}",
                f"model.draft={tiny_pair['draft']}", "data.path=s3://prompts/p.jsonl", f"output_dir={tmp_path}/out",
                "mlflow.enabled=false",
            ],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
        )  # fmt: skip
    finally:
        stop(server)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: data.path: cannot reach prompts") and "ACCESS_DENIED" in line
    assert not (tmp_path / "out").exists()
