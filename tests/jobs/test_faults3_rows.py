"""Outlier rows cost their row, not the job (issue #52, item 1), on the session's local Ray with the tiny pair.

Each fault is injected from outside, in the input file:
- a Parquet file whose row 16 (the 17th of 40) holds bytes that are not UTF-8 in its prompt column (written
  with pyarrow's unvalidated buffers, as a buggy writer would): before the fix the worker's `to_pylist()`
  raised on that shard on every attempt and the job failed with no rows for it;
- a JSON-lines file with one empty prompt and one prompt longer than the model's positions among 40: the
  engine refuses both at admission; before the fix their error rows were not input failures, so every rerun
  generated their shards again and, at the default tolerance, `_SUCCESS` could never be written.

The failed job's last lines name its first failed rows and why (not only a count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_pair_support import WORDS, job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks


def bad_utf8_parquet(prompts: Path, folder: Path, row: int) -> Path:
    """The 40 prompts as Parquet (row groups of 10) with bytes that are not UTF-8 in row `row`'s prompt."""
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    values = [r["prompt"].encode() for r in records]
    values[row] = b"\xff\xfe" + values[row]
    raw = pa.array(values, pa.binary())
    texts = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # no validation: a buggy writer's file
    path = folder / "bad_utf8.parquet"
    pq.write_table(pa.table({"id": [r["id"] for r in records], "prompt": texts}), path, row_group_size=10)
    return path


def test_a_parquet_value_that_is_not_utf8_is_one_error_row_named_in_the_last_lines(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    data = bad_utf8_parquet(prompts_jsonl, tmp_path, row=16)
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    out = tmp_path / "out"
    raw = job_config(tiny_pair, data, out)
    reason = f"data.path: row 16 (id 'p016') of {data}: column 'prompt' is not valid UTF-8 (byte 0xff at position 1"

    # the default tolerance (0): every row written, the job fails, and its last lines say which row and why
    report = run_generate(from_dict(raw))
    table = read_output(out)
    assert table.column("id").to_pylist() == ids
    errors = table.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [16] and errors[16].startswith(reason)
    assert report.exit_code == 1 and not (out / "_SUCCESS").exists()
    assert "1 of 40 prompts failed" in report.messages[0]
    assert "'p016'" in report.messages[-1] and reason in report.messages[-1]

    # a rerun regenerates nothing (the row fails for its input again); a tolerant one exits 0 with 39 + 1 rows
    dispatched: list[int] = []
    hooks = RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index))
    again = run_generate(from_dict(raw), hooks)
    assert dispatched == [] and again.exit_code == 1 and reason in again.messages[-1]
    tolerant = run_generate(from_dict({**raw, "max_failed_fraction": 0.1}), hooks)
    assert dispatched == [] and tolerant.exit_code == 0 and (out / "_SUCCESS").exists()
    assert tolerant.summary.prompts_completed == 39 and tolerant.summary.prompts_failed == 1
    finish = read_output(out).column("finish_reason").to_pylist()
    assert finish.count("error") == 1 and len(finish) == 40


def pair_without_bos(tiny_pair: dict[str, Path], folder: Path) -> dict[str, Path]:
    """A copy of the tiny pair whose tokenizers add no BOS token (as many models' do): an empty prompt is then
    no tokens at all, which the engine refuses."""
    import shutil

    pair = {}
    for role in ("target", "draft"):
        pair[role] = shutil.copytree(tiny_pair[role], folder / role)
        tokenizer = json.loads((pair[role] / "tokenizer.json").read_text())
        tokenizer["post_processor"] = None
        (pair[role] / "tokenizer.json").write_text(json.dumps(tokenizer))
    return pair


def refused_prompts(prompts: Path, folder: Path) -> Path:
    """The 40 prompts with row 5's prompt empty and row 30's longer than the tiny models' 64 positions."""
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    records[5]["prompt"] = ""
    records[30]["prompt"] = " ".join(WORDS[i % len(WORDS)] for i in range(80))
    path = folder / "refused.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow  # two whole jobs; light siblings: test_faults3_memory.py (the worker), test_faults3_output.py (the rerun)
def test_rows_the_engine_refuses_are_input_failures_and_a_rerun_generates_nothing(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    data = refused_prompts(prompts_jsonl, tmp_path)
    out = tmp_path / "out"
    raw = job_config(pair_without_bos(tiny_pair, tmp_path), data, out, max_failed_fraction=0.1)
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0 and (out / "_SUCCESS").exists()
    table = read_output(out)
    errors = table.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [5, 30]
    assert "prompt 0 is empty" in errors[5] and "exceeds the target model's 64 positions" in errors[30]
    records = [json.loads(line) for line in (out / "_commits.jsonl").read_text().splitlines()]
    assert sum(r["failed"] for r in records) == sum(r["failed_input"] for r in records) == 2

    # the rerun: nothing dispatched, no token generated (retry_failed is on by default)
    dispatched: list[int] = []
    again = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index)))
    assert dispatched == [] and again.exit_code == 0 and again.summary.prompts_failed == 2
    assert (out / "_SUCCESS").exists()
