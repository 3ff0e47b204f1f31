"""Unreadable input records end as error rows, never as the job's end (issue #40, finding 1).

The fault is injected from outside: the session's 40 prompts copied with two bytes that are not UTF-8
(`\\xff\\xfe`) inside line 17's prompt string. Before the fix the worker's read raised on that shard on every
attempt: the job ended with a traceback and no rows, and a resume failed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks


def with_bad_utf8(prompts: Path, folder: Path, line: int) -> Path:
    """The prompts with bytes that are not UTF-8 at the start of line `line`'s prompt string."""
    lines = prompts.read_bytes().splitlines(keepends=True)
    at = lines[line - 1].index(b'"prompt": "') + len(b'"prompt": "')
    lines[line - 1] = lines[line - 1][:at] + b"\xff\xfe" + lines[line - 1][at:]
    path = folder / "bad_utf8.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def test_a_record_that_is_not_utf8_is_one_error_row_and_max_failed_fraction_decides(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    data = with_bad_utf8(prompts_jsonl, tmp_path, line=17)
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    out = tmp_path / "out"
    raw = job_config(tiny_pair, data, out)

    # the default tolerance (0): every row written, the job fails
    report = run_generate(from_dict(raw))
    table = read_output(out)
    assert table.column("id").to_pylist() == ids  # every id once, in order (line 17's id is readable)
    errors = table.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [16]
    assert errors[16] == f"data.path: {data} line 17 is not valid UTF-8 (byte 0xff at column 27)"
    assert table.column("finish_reason").to_pylist()[16] == "error" and table.column("prompt").to_pylist()[16] is None
    assert report.exit_code == 1 and "1 of 40 prompts failed" in report.messages[0]
    assert report.messages[-1] == f"row 'p016' failed: {errors[16]}"  # the last line: which row, and why (#52)
    assert report.summary.prompts_completed == 39 and not (out / "_SUCCESS").exists()

    # a rerun: the same input fails that record again, so nothing is generated again (retry_failed or not)
    dispatched: list[int] = []
    again = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard.index)))
    assert dispatched == [] and again.exit_code == 1 and again.summary.prompts_failed == 1
    assert read_output(out).column("id").to_pylist() == ids

    # a tolerant max_failed_fraction (not part of the config hash): exit 0 and _SUCCESS, still nothing regenerated
    tolerant = run_generate(from_dict({**raw, "max_failed_fraction": 0.1}), RunHooks(on_dispatch=lambda *a: dispatched.append(a)))
    assert dispatched == [] and tolerant.exit_code == 0 and (out / "_SUCCESS").exists()
    assert tolerant.summary.prompts_completed == 39 and tolerant.summary.prompts_failed == 1
