"""`jobs.benchmark` end to end on the tiny random pair: the real configs (bench=smoke), real models,
real HF generate / assisted generation, real MLflow (a SQLite file under tmp_path).

What is checked is the plumbing and the bookkeeping, never a speed: every configuration ran, the
files and plots exist, token counts and block efficiencies obey their definitions, the goals are
printed with PASS/MISS/N/A, and the MLflow run holds the artifacts.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from jobs.benchmark import benchmark
from pipeline.benchmark.config import bench_config_from_omegaconf, expand_grid
from pipeline.errors import JobInputError
from spectr.steps import StepConfig

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def composed(tiny_pair, prompts, *overrides: str):
    base = [
        "bench=smoke",
        f"model.target={tiny_pair['target']}",
        f"model.draft={tiny_pair['draft']}",
        f"data.path={prompts}",
        "progress=false",
        "threads=1",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="benchmark", overrides=base + list(overrides))


def test_smoke_benchmark_end_to_end(tiny_pair, prompts_jsonl, tmp_path):
    from mlflow.tracking import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "bench"
    cfg = composed(tiny_pair, prompts_jsonl, f"output_dir={out}", f"mlflow.tracking_uri={tracking_uri}")
    config = bench_config_from_omegaconf(cfg)
    report = benchmark(cfg, command="python -m jobs.benchmark bench=smoke")

    assert report.exit_code == 0, [r.error for r in report.results if r.error]
    cases = expand_grid(config.bench)
    assert [r.case for r in report.results] == cases
    g = config.bench
    for r in report.results:
        # EOS ignored: every repeat of every configuration generates exactly max_new_tokens per prompt
        prompts = sum(len(b) for b in _batches(config, r.case.batch_size))
        assert r.generated_tokens == g.repeats * prompts * g.max_new_tokens, r.case
        assert len(r.runs) == g.repeats and r.tokens_per_second > 0
        if r.case.method in ("hf_generate", "autoregressive"):
            assert r.block_efficiency == 1.0
        else:
            assert 1.0 <= r.block_efficiency <= r.case.draft_length + 1
        if r.case.method in ("speculative", "spectr", "specinfer"):
            assert len(r.acceptance_per_position) == r.case.draft_length
            assert r.predicted_tokens_per_second > 0
            split = r.time_split
            assert sum(split.values()) == pytest.approx(1.0) and split["draft"] > 0 and split["target"] > 0
        assert r.peak_memory_bytes > 0
    by_case = {(r.case.method, r.case.batch_size): r for r in report.results}
    assert by_case[("autoregressive", 1)].speedup_vs_autoregressive == pytest.approx(1.0)
    assert by_case[("hf_generate", 2)].speedup_vs_hf_generate == pytest.approx(1.0)

    # files
    for name in ("results.md", "results.csv", "optimality.csv", "latencies.csv", "results.json", "benchmark.log"):
        assert (out / name).stat().st_size > 0, name
    for name in ("block_efficiency_vs_k.png", "speedup_vs_k.png", "optimality.png", "cost_model.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(cases) and {row["method"] for row in rows} == {c.method for c in cases}
    with open(out / "optimality.csv") as f:
        optimality = list(csv.DictReader(f))
    assert [int(row["K"]) for row in optimality] == [1, 2, 3]
    first = optimality[0]
    assert float(first["kseq"]) == pytest.approx(float(first["optimum"])) == pytest.approx(float(first["specinfer"]))
    for row in optimality:
        assert float(row["kseq"]) <= float(row["optimum"]) + 1e-9
        assert float(row["specinfer"]) <= float(row["optimum"]) + 1e-9

    # the printed report: table, best configuration, goals with a status each
    text = report.text
    assert "tok/s" in text and "Best configuration per batch size" in text and "B=2: fastest is" in text
    goal_lines = [line for line in text.splitlines() if line.strip().startswith("[")]
    assert len(goal_lines) == 4 and all(line.strip()[:6] in ("[PASS]", "[MISS]", "[N/A] ") for line in goal_lines)
    markdown = (out / "results.md").read_text()
    assert "hf_assisted ¹" in markdown and "batch size 1 only" in markdown and "## Cost model" in markdown

    # MLflow: one finished run with the files as artifacts and per-configuration metrics
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(report.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["bench.max_new_tokens"] == str(g.max_new_tokens)
    assert run.data.metrics["block_efficiency/autoregressive_K0_L0_B1"] == 1.0
    assert "tokens_per_s/spectr_K2_L2_B2" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(report.run_id)}
    assert {"results.md", "results.csv", "benchmark.log", "speedup_vs_k.png", "cost_model.png"} <= artifacts
    # one child run per configuration, with its method, K, L and batch as params (MLflow's compare view)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{report.run_id}'"
    )
    assert len(children) == len(cases) and all(c.info.status == "FINISHED" for c in children)
    by_label = {c.info.run_name: c for c in children}
    spectr = by_label["spectr K=2 L=2 B=2"]
    assert {k: spectr.data.params[k] for k in ("method", "K", "L", "batch")} == {
        "method": "spectr", "K": "2", "L": "2", "batch": "2",
    }  # fmt: skip
    assert spectr.data.metrics["tokens_per_s"] == run.data.metrics["tokens_per_s/spectr_K2_L2_B2"]
    assert spectr.data.metrics["block_efficiency"] >= 1.0 and "speedup_vs_autoregressive" in spectr.data.metrics
    assert by_label["autoregressive B=1"].data.metrics["speedup_vs_autoregressive"] == pytest.approx(1.0)


def _batches(config, batch_size):
    from pipeline.benchmark.job import batches_for

    needed = [list(range(100))] * 100  # only the shapes matter here
    return batches_for(needed, batch_size, config.bench.num_prompts)


def test_too_few_prompts_is_refused_before_measuring(tiny_pair, prompts_jsonl, tmp_path):
    cfg = composed(tiny_pair, prompts_jsonl, f"output_dir={tmp_path / 'out'}", "mlflow.enabled=false",
                   "bench.num_prompts=64", "data.limit=10")
    with pytest.raises(JobInputError, match=r"gives 10 prompt\(s\).*needs 64"):
        benchmark(cfg)
    assert not (tmp_path / "out").exists()


def test_missing_model_dir_is_refused(tiny_pair, prompts_jsonl, tmp_path):
    cfg = composed(tiny_pair, prompts_jsonl, "mlflow.enabled=false", f"model.draft={tmp_path / 'nope'}")
    with pytest.raises(JobInputError, match="model.draft: no such model directory"):
        benchmark(cfg)


def test_repeats_run_round_robin_and_a_failed_configuration_is_isolated(tiny_pair, prompts_jsonl, monkeypatch):
    """Repeat r of every configuration runs before repeat r + 1 of any (a drift in the machine's speed
    spreads over all of them); a configuration that raises is reported and skipped, the others finish."""
    import torch

    from pipeline.benchmark import job as bench

    config = bench_config_from_omegaconf(composed(tiny_pair, prompts_jsonl, "mlflow.enabled=false", "bench.repeats=2"))
    g = config.bench
    assert g.repeats == 2
    pair = bench.load_pair(config, torch.device("cpu"))
    prompts, _ = bench.load_prompts(config, pair.tokenizer)
    cases = [c for c in expand_grid(g) if c.method in ("autoregressive", "speculative", "spectr")][:3]
    broken = cases[1]
    calls = []
    real_run_case = bench.run_case

    def recording_run_case(pair_, case, batches, settings, seed):
        calls.append((case, settings.max_new_tokens))
        if case == broken and settings.max_new_tokens == g.max_new_tokens:
            raise RuntimeError("injected failure")
        return real_run_case(pair_, case, batches, settings, seed)

    monkeypatch.setattr(bench, "run_case", recording_run_case)
    results = bench.measure_cases(config, pair, cases, lambda c: bench.batches_for(prompts, c.batch_size, g.num_prompts))

    warmups = [(c, g.warmup_tokens) for c in cases]
    timed = [(c, g.max_new_tokens) for _ in range(g.repeats) for c in cases if c != broken]
    assert calls[: len(cases)] == warmups
    assert calls[len(cases) :] == [(cases[0], g.max_new_tokens), (broken, g.max_new_tokens)] + timed[1:]
    assert results[1].error == "RuntimeError: injected failure" and not results[1].runs
    assert all(r.ok and len(r.runs) == g.repeats for r in (results[0], results[2]))


def test_single_draft_grid_gets_a_cost_model(tiny_pair, prompts_jsonl, tmp_path):
    """K = 1 only: the narrowest draft tree still fits every latency measurement (commit included)."""
    cfg = composed(tiny_pair, prompts_jsonl, f"output_dir={tmp_path / 'out'}", "mlflow.enabled=false",
                   "bench.methods=[autoregressive,speculative]", "bench.num_drafts=[1]",
                   "bench.optimality.enabled=false")
    report = benchmark(cfg)
    assert report.exit_code == 0, report.phase_errors
    assert not report.phase_errors
    assert all(r.predicted_tokens_per_second for r in report.results)


def test_auto_learns_on_its_timed_runs_next_to_the_fixed_grid_and_plots_its_timeline(tiny_pair, prompts_jsonl,
                                                                                      tmp_path):
    out = tmp_path / "out"
    cfg = composed(tiny_pair, prompts_jsonl, f"output_dir={out}", "mlflow.enabled=false",
                   "bench.methods=[autoregressive,speculative,spectr,auto]", "bench.num_drafts=[1,2]",
                   "bench.draft_lengths=[2]", "bench.optimality.enabled=false", "bench.cost_model.enabled=false")
    config = bench_config_from_omegaconf(cfg)
    report = benchmark(cfg)
    assert report.exit_code == 0, [r.error for r in report.results if r.error]
    g = config.bench
    autos = [r for r in report.results if r.case.method == "auto"]
    assert [r.case.batch_size for r in autos] == list(g.batch_sizes)
    for r in autos:
        prompts = sum(len(b) for b in _batches(config, r.case.batch_size))
        assert r.generated_tokens == g.repeats * prompts * g.max_new_tokens
        assert sum(r.auto.tokens_by_config.values()) == r.generated_tokens  # every token is kept and counted
        assert r.auto.wasted_seconds == 0.0 and r.auto.generation_seconds > 0
        for label in r.auto.tokens_by_config:  # within the grid's bounds K <= 2, L <= 2
            config_ = StepConfig.parse(label)
            assert config_.num_drafts <= 2 and config_.draft_length <= 2
        assert r.auto.timeline and r.auto.description.startswith("auto: ")
        assert 1.0 <= r.block_efficiency <= 3
    goal_names = [goal.name for goal in report.goals]
    assert any(name.startswith("auto >=") for name in goal_names)
    assert any("auto's wasted seconds" in name for name in goal_names)
    with open(out / "results.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["method"] == "auto"]
    assert len(rows) == len(autos) and all(row["auto_choice"].startswith("auto: ") for row in rows)
    assert (out / "planner_timeline.png").read_bytes()[:8] == PNG_MAGIC
    with open(out / "planner_timeline.csv") as f:
        assert {int(row["batch_size"]) for row in csv.DictReader(f)} == set(g.batch_sizes)
