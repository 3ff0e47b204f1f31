"""The plan's scan with and without counting each row's n (`data.sampling_params_column`), per format.

    flock /tmp/timing.lock .venv/bin/python scripts/bench_scan_samples.py --rows 200000 --rounds 2

For `--rows` synthetic rows whose `params` differ on every row (`{"n": 1 + i % 4, "seed": i}`: no two JSON
texts alike, the worst case for the scan's parse-each-distinct-text), as JSON lines (objects) and Parquet
(a struct column): the real scan (`scan_source`, offsets every 16 rows) in a fresh process, with and
without `SampleCounts`, the two alternating; the report gives each arm's median seconds, its peak resident
memory (ru_maxrss; the inputs are written by another child, so the parent stays small) and the rows the
count found. Nothing here starts Ray or a model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, summary, table  # noqa: E402


def write_inputs(folder: Path, rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"id": f"p{i:08d}", "prompt": f"prompt number {i}", "params": {"n": 1 + i % 4, "seed": i}}
               for i in range(rows)]
    jsonl = folder / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    parquet = folder / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=65536)
    return {"jsonl": jsonl, "parquet": parquet}


def scan(path: str, count: bool) -> dict:
    from pipeline.config import DataConfig
    from pipeline.readers import scan_source
    from pipeline.row_columns import SampleCounts
    from pipeline.source import list_source

    data = DataConfig(path=path, limit=None, sampling_params_column="params" if count else None)
    counts = SampleCounts("params", default=1) if count else None
    started = time.perf_counter()
    source = scan_source(data, list_source(data), 16, samples=counts)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rows": source.num_rows, "output_rows": counts.output_rows(source.num_rows) if counts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write <out>.json and .md here")
    parser.add_argument("--phase", nargs=2, metavar=("PATH", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(scan(args.phase[0], args.phase[1] == "1")))
        return
    if args.write:
        write_inputs(Path(args.write), args.rows)
        return
    report_ = Report("scan_samples", args=args)
    print(report_.header())
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-scan-samples-") as tmp:
        # written by a child: Linux carries a process's peak memory into the children it starts
        subprocess.run([sys.executable, __file__, "--write", tmp, "--rows", str(args.rows)], check=True)
        inputs = {"jsonl": Path(tmp) / "rows.jsonl", "parquet": Path(tmp) / "rows.parquet"}
        for round_index in range(args.rounds):
            for name, path in inputs.items():
                arms = [False, True] if round_index % 2 == 0 else [True, False]
                for count in arms:
                    done = subprocess.run([sys.executable, __file__, "--phase", str(path), "1" if count else "0"],
                                          capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
                    record = {"round": round_index + 1, "format": name, "count_n": count,
                              **json.loads(done.stdout.splitlines()[-1])}
                    runs.append(record)
                    print(json.dumps(record), flush=True)
    report = {}
    for name in ("jsonl", "parquet"):
        for count in (False, True):
            mine = [r for r in runs if r["format"] == name and r["count_n"] == count]
            report[f"{name} {'with' if count else 'without'} the count"] = {
                **{f"{k}_s": round(v, 2) for k, v in summary(r["seconds"] for r in mine).items() if k != "n"},
                "peak_mb": round(max(r["peak_mb"] for r in mine)), "output_rows": mine[0]["output_rows"]}
    print(json.dumps({"rows": args.rows, "report": report}, indent=1))
    if args.out:
        report_.write(args.out, {"rows": args.rows, "report": report, "runs": runs},
                      markdown=table([{"arm": arm, **values} for arm, values in report.items()]))


if __name__ == "__main__":
    main()
