"""`method=traversal` through the pipeline: the job's config (the real Hydra configs), the Ray Data stage
(called directly, no Ray: the same actor code as the job's workers) and the benchmark job's grid and run."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
from hydra import compose, initialize_config_dir
from tiny_pair_support import WORDS

from jobs.benchmark import benchmark
from pipeline.benchmark.config import bench_config_from_omegaconf, expand_grid
from pipeline.generate.config import from_omegaconf
from pipeline.generate.shards import row_seed
from pipeline.ray_data import SpecTrProcessorConfig, SpecTrStage

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def test_the_job_config_takes_traversal_with_k_drafts():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="generate", overrides=["spectr.method=traversal", "spectr.num_drafts=3",
                                                          "spectr.draft_length=6"])
    spectr = from_omegaconf(cfg).spectr
    assert (spectr.method, spectr.num_drafts, spectr.draft_length) == ("traversal", 3, 6)  # K kept, unlike block


def test_the_ray_data_stage_generates_spectr_generates_tokens(tiny_pair):
    import spectr

    engine = {"method": "traversal", "num_drafts": 3, "draft_length": 3, "batch_size": 4, "max_new_tokens": 8,
              "dtype": "float32"}
    stage = SpecTrStage(SpecTrProcessorConfig(model_source=str(tiny_pair["target"]),
                                              draft_model_source=str(tiny_pair["draft"]), batch_size=4,
                                              engine_kwargs=engine, should_continue_on_error=True))
    assert stage.generator.spectr.num_drafts == 3
    rng = random.Random(2)
    rows = [{"id": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(5))} for i in range(4)]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    g = stage.generator
    for row in out:
        assert row["finish_reason"] in ("eos", "stop", "length") and row["target_calls"] >= 1
        expected = spectr.generate(g.target, g.draft, [row["prompt_token_ids"]], method="traversal", num_drafts=3,
                                   draft_length=3, max_new_tokens=8, eos_token_id=g.eos_token_id,
                                   seed=row_seed(0, row["id"]))
        assert row["generated_tokens"] == expected.tokens[0]


def composed_benchmark(tiny_pair, prompts, *overrides: str):
    base = ["bench=smoke", f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
            f"data.path={prompts}", "progress=false", "threads=1"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="benchmark", overrides=base + list(overrides))


def test_the_benchmark_measures_traversal_for_k_drafts_with_its_cost_model(tiny_pair, prompts_jsonl, tmp_path):
    cfg = composed_benchmark(tiny_pair, prompts_jsonl, f"output_dir={tmp_path / 'out'}", "mlflow.enabled=false",
                             "bench.methods=[autoregressive,block,traversal]", "bench.batch_sizes=[2]",
                             "bench.optimality.enabled=false")
    cases = expand_grid(bench_config_from_omegaconf(cfg).bench)
    # K = 1 traversal is block verification: measured once, as block
    assert [c.label for c in cases] == ["autoregressive B=2", "block K=1 L=2 B=2", "traversal K=2 L=2 B=2"]
    report = benchmark(cfg)
    assert report.exit_code == 0 and not report.phase_errors, report.phase_errors
    traversal = report.results[-1]
    assert 1.0 <= traversal.block_efficiency <= 3.0 and traversal.predicted_tokens_per_second > 0
