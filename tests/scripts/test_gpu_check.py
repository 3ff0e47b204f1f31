"""scripts/gpu_check.py in its smoke mode: the same code paths as on the GPU, on CPU in seconds.

The smoke run is one subprocess (the script as the GPU machine runs it), shared by the structure
tests below. A few in-process tests cover the pieces a smoke run cannot show: the time budget
skipping and recording units (and interrupting one that overruns), the chi-square tail against
scipy, and the negative-control injection restoring the selector registry.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import spectr
from spectr.selection import TOKEN_SELECTORS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
SECTIONS = ("exactness", "greedy", "pair_acceptance", "speed", "device_map")


def load_script():
    """The script as a module (registered in sys.modules, as its dataclasses need), loaded once."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert (out / "results.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return dict(run=run, out=out, results=json.loads((out / "results.json").read_text()))


def test_smoke_run_passes_and_writes_json_and_markdown(smoke):
    run, results = smoke["run"], smoke["results"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert results["passed"] is True
    markdown = (smoke["out"] / "results.md").read_text()
    for heading in ("## 1. Exactness", "## 2. Greedy", "## 3. Embedded pair", "## 4. Speed", "## 5. PREDICTED"):
        assert heading in markdown
    assert "## Summary" in run.stdout  # the tables are printed too


def test_every_section_and_the_environment_are_recorded(smoke):
    results = smoke["results"]
    for section in SECTIONS:
        assert section in results and results[section]["status"] != "error", results.get(section)
        assert results[section]["seconds"] >= 0
    env = results["environment"]
    for key in ("date", "command", "device_name", "torch", "transformers"):
        assert env[key]
    assert env["known_methods"] == spectr.known_methods()


def test_the_device_map_section_splits_on_the_cpu_in_the_smoke_run_and_is_skipped_without_two_gpus(smoke, tmp_path):
    section = smoke["results"]["device_map"]
    assert section["status"] == "passed" and section["measured"] is False  # both "GPUs" are the CPU
    assert len(section["models"]["groups"]) == 2 and all(row["identical_tokens"] for row in section["rows"])
    gpu_check = load_script()
    assert gpu_check.main(["--sections", "device_map", "--device", "cpu", "--out", str(tmp_path)]) == 0
    skipped = json.loads((tmp_path / "results.json").read_text())["device_map"]
    assert skipped["status"] == "skipped" and skipped["reason"] == "skipped: 0 GPUs"


def test_every_method_is_exact_in_both_dtypes_and_every_control_is_rejected(smoke):
    section = smoke["results"]["exactness"]
    assert section["status"] == "passed" and not section["skipped_for_time"]
    cases = {(c["dtype"], c["method"]): c for c in section["cases"] if not c.get("compiled")}
    assert set(cases) == {(d, m) for d in ("float32", "bfloat16") for m in spectr.known_methods()}
    for case in cases.values():
        assert case["passed"] and case["p_value"] > section["accept_p"], case
        assert case["control"]["rejected"] and case["control"]["p_value"] < section["reject_p"], case
        if case["method"] in TOKEN_SELECTORS:
            assert "TOKEN_SELECTORS" in case["control"]["kind"]


def test_greedy_equals_hf_for_every_architecture_and_method(smoke):
    section = smoke["results"]["greedy"]
    assert section["status"] == "passed"
    pairs = {(c["arch"], c["method"]) for c in section["cases"] if c["equal"]}
    assert pairs == {(a, m) for a in ("llama", "qwen2", "gpt_neox") for m in spectr.known_methods()}


def test_speed_rows_have_throughput_syncs_and_ratios(smoke):
    results = smoke["results"]
    rows = results["speed"]["rows"]
    assert not results["speed"]["skipped_for_time"]
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert {r["batch"] for r in rows} == {1, 2}
    assert {r["kind"] for r in rows} == {"ours", "hf", "hf_static", "hf_assisted"}
    for row in rows:
        assert row["tokens_per_s"] > 0
    ours = [r for r in rows if r["kind"] == "ours"]
    assert {r["method"] for r in ours} >= {"autoregressive", "speculative", "spectr"}
    for row in ours:
        assert isinstance(row["host_syncs_per_iteration"], float) and math.isfinite(row["host_syncs_per_iteration"])
        assert row["iteration_ms"] >= 0  # 0: the decode time was lost in timing noise (smoke mode)
        assert set(row["per_iteration_ms"]) == {"draft", "target", "selection", "other"}
        assert row["vs_hf"]["ratio"] > 0 and row["speedup_vs_our_autoregressive"] > 0
        assert row["vs_hf_static_compiled"] > 0
    predictions = results["predictions"]
    assert predictions["status"] == "predicted" and 0 < predictions["alpha"] <= 1
    assert len(predictions["rows"]) == len([r for r in ours if r["method"] != "autoregressive"])


def test_a_spent_budget_skips_units_and_records_them(tmp_path):
    gpu_check = load_script()
    code = gpu_check.main(["--smoke", "--budget-s", "0", "--sections", "greedy", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 1 and results["passed"] is False
    assert results["greedy"]["status"] == "failed"
    assert results["greedy"]["skipped_for_time"] == list(gpu_check.GREEDY_ARCHS)
    assert results["predictions"]["status"] == "skipped"


def test_chi_square_tail_matches_scipy():
    chi2 = pytest.importorskip("scipy.stats").chi2
    gpu_check = load_script()
    for statistic, dof in ((0.5, 1), (10.0, 7), (63.0, 63), (400.0, 200), (1e4, 500)):
        assert gpu_check.chi_square_sf(statistic, dof) == pytest.approx(chi2.sf(statistic, dof), rel=1e-6, abs=1e-300)


def test_the_negative_control_is_injected_and_then_removed():
    gpu_check = load_script()
    before = dict(TOKEN_SELECTORS)
    with gpu_check.broken_selection("spectr") as names:
        assert names == ["spectr"] and TOKEN_SELECTORS["spectr"] is not before["spectr"]
        assert all(TOKEN_SELECTORS[n] is before[n] for n in before if n != "spectr")
    assert TOKEN_SELECTORS == before
    with gpu_check.broken_selection("a-planner") as names:  # not a selector itself: every selector is broken
        assert sorted(names) == sorted(before)
    assert TOKEN_SELECTORS == before
    # the broken rule differs from the real one exactly where every draft was rejected
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    tokens, alive = torch.tensor([[0], [0]]), torch.ones(2, 1, dtype=torch.bool)
    uniforms = torch.tensor([[0.99, 0.9], [0.0, 0.1]], dtype=torch.float64)
    broken = gpu_check.skip_residual(TOKEN_SELECTORS["speculative"])
    token, accepted = broken(tokens, alive, probs[[0, 0]], probs[[0, 1]], uniforms)
    assert accepted.tolist() == [True, False] and token.tolist() == [0, 2]


def test_a_unit_far_past_its_share_is_interrupted():
    gpu_check = load_script()
    with pytest.raises(gpu_check.SectionTimeout):
        with gpu_check.hard_deadline(0.05):
            time.sleep(5)
    with gpu_check.hard_deadline(5):  # a block that ends in time is left alone, and the timer is cleared
        pass
    time.sleep(0.1)


def test_a_row_whose_iteration_time_is_lost_in_noise_is_skipped_not_divided_by():
    gpu_check = load_script()
    stats = {"draft": 0.0, "target": 0.0, "selection": 0.0, "other": 0.0}
    rows = [
        dict(kind="ours", method="autoregressive", batch=1, name="ar", iteration_ms=0.0, per_iteration_ms=stats),
        dict(kind="ours", method="spectr", batch=1, name="spectr K=2 L=2", num_drafts=2, draft_length=2,
             iteration_ms=0.0, per_iteration_ms=stats),
    ]
    result = gpu_check.predict({"status": "measured", "rows": rows}, {"alpha": 0.6})
    assert result["status"] == "predicted"
    assert [p.get("skipped") for p in result["rows"]] == ["iteration time not measurable above timing noise"]
    assert gpu_check.markdown_predictions(result)  # the table still renders


def test_a_section_cut_for_time_keeps_the_results_it_had(tmp_path, monkeypatch):
    """--smoke with a tiny budget: the first unit is measured, the second overruns and is cut by the alarm."""
    gpu_check = load_script()
    target = gpu_check.random_llama(gpu_check.TINY_LLAMA, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    stats = spectr.generate(target, None, [[5, 6, 7]], method="autoregressive", max_new_tokens=3).stats

    def instant_ours(pair, prompts, run, new_tokens, device):  # canned, so that the first unit takes no time
        return dict(wall_s=1.0, tokens=3, tokens_per_s=3.0, stats=stats, iterations=3, peak_memory_mib=None)

    def overrunning_hf(pair, prompts, run, new_tokens, device):  # instant at batch 1 (its warm-up), stuck at 2
        if run.batch == 2:
            time.sleep(60)  # interrupted by the section's alarm (SIGALRM) after --budget-s + --grace-s
        return dict(wall_s=1.0, tokens=3, tokens_per_s=3.0, peak_memory_mib=None)

    first, second = gpu_check.SpeedRun("ours", 1), gpu_check.SpeedRun("hf", 2)
    monkeypatch.setattr(gpu_check, "speed_units", lambda plan, methods, compiles: [((first,), 1), ((second,), 1)])
    monkeypatch.setattr(gpu_check, "run_ours", instant_ours)
    monkeypatch.setattr(gpu_check, "run_hf", overrunning_hf)
    start = time.perf_counter()
    code = gpu_check.main(["--smoke", "--sections", "speed", "--budget-s", "1", "--grace-s", "0", "--out", str(tmp_path)])
    assert time.perf_counter() - start < 30  # the 60 s unit was interrupted
    speed = json.loads((tmp_path / "results.json").read_text())["speed"]
    assert speed["status"] == "partial" and speed["cut_for_time"] is True and "SectionTimeout" in speed["error"]
    assert [(r["name"], r["batch"]) for r in speed["rows"]] == [("ours autoregressive", 1)]
    assert speed["rows"][0]["tokens_per_s"] == 3.0 and code == 0  # a cut measurement is no failed check
    assert "## 4. Speed" in (tmp_path / "results.md").read_text()


def test_a_cut_check_section_fails_and_an_error_before_any_result_is_an_error():
    gpu_check = load_script()
    cut = gpu_check.cut_section("greedy", {"cases": [1], "status": "incomplete"}, gpu_check.SectionTimeout("late"))
    assert cut["status"] == "failed" and cut["cases"] == [1] and cut["cut_for_time"]
    assert gpu_check.cut_section("speed", None, gpu_check.SectionTimeout("late"))["status"] == "error"
    assert gpu_check.cut_section("speed", {"rows": [1]}, ValueError("bug"))["status"] == "error"
    assert not issubclass(gpu_check.SectionTimeout, Exception)  # per-unit `except Exception` cannot swallow it


def test_compiled_runs_appear_only_when_the_engine_takes_compile_and_are_timed_interleaved(monkeypatch):
    gpu_check = load_script()
    real = spectr.generate
    units = gpu_check.speed_units(gpu_check.SMOKE, spectr.known_methods(), compiles=False)
    assert not any(run.compiled for group, _ in units for run in group)
    calls = []

    def compiling_generate(target, draft, prompts, *, compile="auto", **kwargs):  # the compiled engine's signature
        calls.append(compile)
        return real(target, draft, prompts, **{k: v for k, v in kwargs.items() if k != "compile"})

    monkeypatch.setattr(spectr, "generate", compiling_generate)
    assert gpu_check.engine_compiles()
    headline = gpu_check.speed_units(gpu_check.SMOKE, spectr.known_methods(), compiles=True)[0][0]
    assert [run.name for run in headline] == [
        "ours autoregressive", "ours spectr K=2 L=2", "ours autoregressive compiled", "ours spectr K=2 L=2 compiled",
        "HF generate (sampling)", "HF generate static cache + compile"]
    target = gpu_check.random_llama(gpu_check.TINY_LLAMA, seed=0, device=torch.device("cpu"), dtype=torch.bfloat16)
    draft = gpu_check.draft_from_target(target, gpu_check.TINY_LLAMA, 1)
    order = []
    real_run_once = gpu_check.run_once
    monkeypatch.setattr(gpu_check, "run_once", lambda pair, prompts, run, n, device: (
        order.append(run.name), real_run_once(pair, prompts, run, n, device))[1])
    group = (gpu_check.SpeedRun("ours", 2), gpu_check.SpeedRun("ours", 2, compiled=True),
             gpu_check.SpeedRun("hf_static", 2))
    prompts = gpu_check.speed_prompts(2, (4, 8), 512, seed=0)
    rows = gpu_check.measure_group((target, draft), prompts, group, gpu_check.SMOKE, torch.device("cpu"), 2)
    names = [run.name for run in group]
    assert order == names[1:] + names + names  # the compiled runs' warm-up, then 2 interleaved rounds
    assert calls[:5] == [True, False, True, False, True]  # eager runs pass compile=False explicitly
    gpu_check.add_ratios(rows)
    eager, compiled, hf_static = rows
    assert eager["warmup_s"] is None and compiled["warmup_s"] > 0 and hf_static["warmup_s"] > 0
    assert compiled["compiled_vs_eager"] == pytest.approx(compiled["tokens_per_s"] / eager["tokens_per_s"])
    assert compiled["speedup_vs_our_compiled_autoregressive"] == 1.0
    assert eager["vs_hf_static_compiled"] == pytest.approx(eager["tokens_per_s"] / hf_static["tokens_per_s"])


def test_the_last_compiled_units_time_masked_against_flex_attention_and_restore_it():
    """Where the engine compiles, the last speed units (run only if time is left) compare the compiled core's
    attention, masked against FlexAttention, interleaved, under names of their own; their rows get
    `flex_vs_masked` and a `compiled_vs_eager` against the eager run; the runs set `spectr.native.ATTENTION`
    and restore it."""
    import spectr.native as native

    gpu_check = load_script()
    units = gpu_check.speed_units(gpu_check.SMOKE, spectr.known_methods(), compiles=True)
    tail = units[-len(gpu_check.SMOKE.speed_batches):]
    for (masked, flex), _ in tail:
        assert masked.compiled and flex.compiled and (masked.attention, flex.attention) == ("masked", "flex")
        assert (masked.name, flex.name) == ("ours spectr K=2 L=2 compiled masked", "ours spectr K=2 L=2 compiled flex")
    names = [(run.batch, run.name) for group, _ in units for run in group]
    assert len(names) == len(set(names))  # no row twice
    rows = [dict(name=name, kind="ours", batch=2, method="spectr", draft_length=2, tokens_per_s=tps,
                 compiled="compiled" in name, attention=name.split()[-1] if "compiled " in name else "")
            for name, tps in [("ours autoregressive", 100.0), ("ours spectr K=2 L=2", 50.0),
                              ("ours spectr K=2 L=2 compiled masked", 80.0), ("ours spectr K=2 L=2 compiled flex", 60.0)]]
    gpu_check.add_ratios(rows)
    assert rows[3]["flex_vs_masked"] == pytest.approx(0.75) and rows[3]["compiled_vs_eager"] == pytest.approx(1.2)
    assert "flex / masked attention 0.75x" in "\n".join(gpu_check.markdown_speed({"rows": rows}))
    with gpu_check.attention("flex"):
        assert native.ATTENTION == "flex"
    assert native.ATTENTION == "masked"
