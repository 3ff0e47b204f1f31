"""Progress of long work outside the engine's iterations (`pipeline.busy`, #40 finding 8): a compile reports
itself while it runs and counts once it ends; skipping ahead in a compressed stream advances the counter at
each block. The job-level checks (a slow compile or skip does not restart the actor; a hang still does) are in
tests/jobs/test_generate_long_work.py."""

from __future__ import annotations

import gzip

import torch
from torch._dynamo.callback import callback_handler

from pipeline import busy, fs, prompts


def test_a_compile_reports_itself_while_it_runs_and_counts_when_it_ends():
    busy.watch_compiles()
    seen: list[float | None] = []

    def backend(graph, example_inputs):  # runs inside dynamo's compile, as inductor would
        seen.append(busy.report()["compiling_s"])
        return graph.forward

    before = busy.report()
    assert before["compiling_s"] is None
    torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(3))
    after = busy.report()
    assert seen and seen[0] is not None and seen[0] >= 0  # compiling, as the actor's ping says
    assert after["compiling_s"] is None and after["busy_ticks"] > before["busy_ticks"]
    callback_handler.clear()  # what torch._dynamo.reset() does to every compile callback: the next report
    # registers ours again
    busy.report()
    seen.clear()
    torch.compile(lambda x: x - 1, backend=backend)(torch.ones(3))
    assert seen and seen[0] is not None


def test_skipping_ahead_in_a_compressed_stream_advances_at_each_block(tmp_path, monkeypatch):
    data = b"".join(b'{"id": %d, "prompt": "x"}\n' % i for i in range(200))
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(data))
    monkeypatch.setattr(prompts, "SKIP_BYTES", 256)
    start = data.index(b'{"id": 150,')
    before = busy.report()["busy_ticks"]
    got = prompts.ReadCache().text_range(fs.resolve(str(path), "data.path").uri, start, start + 10)
    assert got == data[start : start + 10]
    assert busy.report()["busy_ticks"] - before == -(-start // 256)  # one per block skipped
