"""Throughput of the generation job with 1 vs 2 CPU actors, and the fixed overhead of a small job.

    python scripts/bench_scaling.py                      # embedded pair, 200 prompts, then a 20-prompt job
    python scripts/bench_scaling.py --prompts 256 --repeats 2 --out bench_out/scaling.json

Each run is the real job (`pipeline.generate.job.run_generate` on the composed default config, a fresh local Ray
and a fresh output directory) with only the listed overrides. Throughput is generated tokens divided by
the generation phase (first shard handed out -> last shard written), so Ray start and model loading are
left out of the ratio and reported separately. Runs alternate 1, 2, 2, 1, ... actors so that drifting
background load hits both sides alike; the load average is printed, because other processes on the
machine take CPU from the actors.

The second part runs a 20-prompt job with MLflow on (SQLite) and splits its wall time into start
(checks, Ray, model loading, MLflow run), generation, and finish (writing is inside generation; the
final MLflow logging is the finish).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from pipeline.config import PROJECT_ROOT
from pipeline.generate.config import from_omegaconf
from pipeline.generate.job import run_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, load_average, summary, table  # noqa: E402


def run(overrides: list[str]):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    return run_generate(from_omegaconf(cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of (1 actor, 2 actors) runs")
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--overhead-prompts", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench_out/scaling.json"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.target=...")
    args = parser.parse_args()
    report_ = Report("scaling", args=args)
    print(report_.header())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    common = [
        f"data.limit={args.prompts}", f"shard_size={args.shard_size}",
        f"spectr.max_new_tokens={args.max_new_tokens}", "ray.cpus_per_actor=1", "ray.local_num_cpus=2",
        "mlflow.enabled=false", "progress=false", *args.overrides,
    ]  # fmt: skip
    order = ([1, 2, 2, 1] * args.repeats)[: 2 * args.repeats]
    results = []
    for i, actors in enumerate(order):
        load_before = load_average()[0]
        report = run([*common, f"ray.num_actors={actors}", f"output_dir={work}/run{i}-actors{actors}"])
        s = report.summary
        results.append(
            {
                "actors": actors,
                "tokens_per_s": s.throughput_tokens_per_s,
                "generated_tokens": s.generated_tokens,
                "generation_s": s.generation_s,
                "startup_s": s.startup_s,
                "block_efficiency": s.block_efficiency,
                "load_avg_before": load_before,
                "load_avg_after": load_average()[0],
            }
        )
        print(
            f"{actors} actor(s): {s.throughput_tokens_per_s:8.1f} tokens/s  ({s.generated_tokens} tokens in "
            f"{s.generation_s:.1f} s; start {s.startup_s:.1f} s; block efficiency {s.block_efficiency:.2f}; "
            f"load {load_before:.1f} -> {load_average()[0]:.1f})",
            flush=True,
        )

    def mean(actors: int) -> float:
        values = [r["tokens_per_s"] for r in results if r["actors"] == actors]
        return sum(values) / len(values)

    ratio = mean(2) / mean(1)
    medians = [{"actors": n, **summary(r["tokens_per_s"] for r in results if r["actors"] == n)} for n in (1, 2)]
    print(f"2 actors / 1 actor throughput: {ratio:.2f}x")

    started = time.perf_counter()
    small = run(
        [
            f"data.limit={args.overhead_prompts}", f"spectr.max_new_tokens={args.max_new_tokens}",
            "ray.local_num_cpus=2", f"output_dir={work}/overhead", "progress=false",
            f"mlflow.tracking_uri=sqlite:///{work}/mlflow.db", *args.overrides,
        ]
    )  # fmt: skip
    total = time.perf_counter() - started
    s = small.summary
    finish = max(0.0, small.total_s - s.startup_s - s.generation_s)
    overhead = {
        "prompts": args.overhead_prompts,
        "total_s": total,
        "startup_s": s.startup_s,
        "generation_s": s.generation_s,
        "finish_s": finish,
        "mlflow_logging_s": small.logging_s,
        "beyond_generation_s": total - s.generation_s,
    }
    print(
        f"{args.overhead_prompts}-prompt job: {total:.1f} s = start {s.startup_s:.1f} s (checks, Ray, model "
        f"loading, MLflow run) + generation {s.generation_s:.1f} s (incl. writing) + finish {finish:.1f} s "
        f"(MLflow logging {small.logging_s:.1f} s); beyond generation: {total - s.generation_s:.1f} s"
    )
    report_.write(args.out, {"runs": results, "ratio_2_over_1": ratio, "overhead": overhead},
                  markdown=table(medians) + f"\n2 actors / 1 actor (means): {ratio:.2f}x\n\n" + table([overhead]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
