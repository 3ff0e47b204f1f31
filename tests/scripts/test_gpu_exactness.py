"""scripts/gpu_exactness.py in its smoke mode: the units the GPU runs, on the CPU with tiny models.

The default suite runs a light smoke run once, in-process (float32: autoregressive compiled, greedy on
Llama eager, speculative eager), and checks what it wrote; unit tests cover the order of the units (compiled
greedy vs HF, then compiled fp32 traversal and spectr, then the rest), the time budget (a spent budget skips every
unit, in order, and the verdict is INCOMPLETE; under a too-small budget on the simulated GPU clock the smoke run
runs only what fits and ends INCOMPLETE; a unit longer than the time left is not begun; the results are rewritten
after every unit), the verdict's rules (FAILED beats INCOMPLETE; a skip of the rest still passes), the negative
control (rejected; a control that is not rejected fails its case) and a compiled case that fell back to eager
failing. The whole smoke run, every unit, as the GPU machine runs it (a subprocess), is marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import script_support
import torch

import spectr
from spectr.selection import TOKEN_SELECTORS
from spectr.sequence import SEQUENCE_RULES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_exactness.py"
LIGHT = "float32 autoregressive compiled,eager greedy llama,float32 speculative eager"
LIGHT_UNITS = ["chi-square float32 autoregressive compiled", "eager greedy llama",
               "chi-square float32 speculative eager"]
# the whole check's units, in order: (1) compiled greedy vs HF, (2) compiled fp32 traversal and spectr, (3) the rest
ORDER = (["compiled greedy llama", "compiled greedy qwen2", "chi-square float32 traversal compiled",
          "chi-square float32 spectr compiled"]
         + [f"chi-square float32 {m} compiled" for m in ["autoregressive"] + [m for m in spectr.known_methods()
                                                                         if m not in ("spectr", "traversal",
                                                                                      "autoregressive")]]
         + ["bf16 compiled self-check margins", "eager greedy llama", "eager greedy qwen2", "eager greedy gpt_neox"]
         + [f"chi-square float32 {m} eager" for m in spectr.known_methods()])


def load_script():
    return script_support.load_script("gpu_exactness")


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    gpu_exactness = load_script()
    out = tmp_path_factory.mktemp("gpu_exactness")
    code = gpu_exactness.main(["--smoke", "--only", LIGHT, "--out", str(out)], started=time.perf_counter())
    torch._dynamo.reset()
    return dict(code=code, out=out, results=json.loads((out / "exactness.json").read_text()))


def test_the_light_smoke_run_passes_in_order_and_writes_json_and_markdown(light):
    results = light["results"]
    assert light["code"] == 0, results["summary"]
    assert results["summary"]["verdict"] == "PASSED" and results["summary"]["complete"]
    assert [u["name"] for u in results["units"]] == LIGHT_UNITS  # compiled first, then greedy, then eager
    assert all(u["status"] == "passed" and u["seconds"] > 0 for u in results["units"])
    env = results["environment"]
    assert env["compile_backend"] == "eager" and env["known_methods"] == spectr.known_methods()
    markdown = (light["out"] / "exactness.md").read_text()
    assert "**PASSED**" in markdown and "## Chi-square" in markdown and "## Greedy" in markdown
    assert all(u["compile_s"] >= 0 and u["charged_s"] > 0 for u in results["units"])  # smoke: the GPU clock


def test_the_cases_pass_their_controls_are_rejected_and_compiled_cases_record_fallbacks(light):
    results = light["results"]
    compiled, greedy, eager = results["units"]
    for case in (compiled, eager):
        assert case["p_value"] > results["accept_p"], case
        assert case["control"]["rejected"] and case["control"]["p_value"] < results["reject_p"]
    assert "temperature x 1.25" in compiled["control"]["kind"]
    assert "TOKEN_SELECTORS" in eager["control"]["kind"] and 0.02 < eager["acceptance_rate"] < 0.98
    assert compiled["compiled_requested"] and compiled["compiled"] is True and compiled["compile_fallbacks"] == 0
    assert compiled["control"]["compiled"] is True and compiled["control"]["compile_fallbacks"] == 0
    assert eager["compiled_requested"] is False and eager["compiled"] is False
    assert results["summary"]["compiled_cases"] == {"chi-square float32 autoregressive compiled": 0}
    assert {c["method"] for c in greedy["cases"] if c["equal"]} == set(spectr.known_methods())


def test_a_spent_budget_skips_every_unit_in_order_and_the_verdict_is_incomplete(tmp_path):
    gpu_exactness = load_script()
    code = gpu_exactness.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "exactness.json").read_text())
    units = results["units"]
    assert code == 3 and results["summary"]["verdict"] == "INCOMPLETE" and not results["summary"]["passed"]
    assert [u["name"] for u in units] == ORDER
    assert all(u["status"] == "skipped" and "budget of 0 s spent" in u["reason"] for u in units)
    markdown = (tmp_path / "exactness.md").read_text()
    assert "**INCOMPLETE**" in markdown and f"{len(units)} SKIPPED" in markdown and "**PASSED**" not in markdown


def test_the_smoke_run_under_a_too_small_budget_runs_what_fits_in_order_and_ends_incomplete(tmp_path):
    """On the simulated GPU clock (the smoke default: startup + each run unit's GPU estimate) a budget of 25 s
    leaves 10 s after the startup: the units estimated above that are SKIPPED (the compiled greedy and compiled
    chi-square units the verdict needs among them), the first that fits runs and passes, and the verdict is
    INCOMPLETE, never PASSED. Deterministic: no wall time is read for the budget."""
    gpu_exactness = load_script()
    estimates = gpu_exactness.GPU_ESTIMATES_S
    budget = estimates["startup"] + estimates["greedy"]
    code = gpu_exactness.main(["--smoke", "--budget-s", str(budget), "--out", str(tmp_path)])
    results = json.loads((tmp_path / "exactness.json").read_text())
    units = results["units"]
    assert [u["name"] for u in units] == ORDER
    assert [u["group"] for u in units] == sorted(u["group"] for u in units) and units[3]["group"] == 2
    ran = [u["name"] for u in units if u["status"] != "skipped"]
    assert ran == ["eager greedy llama"] and units[ORDER.index("eager greedy llama")]["status"] == "passed"
    summary = results["summary"]
    assert summary["verdict"] == "INCOMPLETE" and code == 3
    assert summary["skipped_needed_for_verdict"] == ORDER[:4]
    assert "its GPU estimate is 60 s" in units[0]["reason"]
    assert "SKIPPED" in (tmp_path / "exactness.md").read_text()


def test_the_verdict_failed_beats_incomplete_and_a_skip_of_the_rest_still_passes():
    gpu_exactness = load_script()

    def verdict(*units):
        return gpu_exactness.summarize([dict(name=f"u{i}", group=g, status=s) for i, (g, s) in enumerate(units)])[
            "verdict"]

    assert verdict((1, "passed"), (2, "passed"), (3, "skipped")) == "PASSED"
    assert verdict((1, "passed"), (2, "skipped"), (3, "passed")) == "INCOMPLETE"
    assert verdict((1, "skipped"), (2, "passed")) == "INCOMPLETE"
    assert verdict((1, "skipped"), (3, "failed")) == "FAILED"
    assert verdict((1, "passed"), (2, "error")) == "FAILED"
    assert gpu_exactness.EXIT_CODES == {"PASSED": 0, "FAILED": 1, "INCOMPLETE": 3}


def test_a_unit_longer_than_the_time_left_is_not_begun_and_results_are_written_after_every_unit(tmp_path):
    gpu_exactness = load_script()
    seen = []

    def unit(index: int, seconds: float = 0.0, fail: bool = False):
        def run() -> dict:
            written = json.loads((tmp_path / "check.json").read_text())["units"] if index else []
            seen.append([u["name"] for u in written])  # what the file held when this unit began
            time.sleep(seconds)
            if fail:
                raise ValueError("broken unit")
            return dict(status="passed")
        return run

    Unit = gpu_exactness.Unit
    runner = gpu_exactness.UnitRunner(out=tmp_path, stem="check", budget_s=1.0, results={},
                                      summarize=gpu_exactness.summarize, render=gpu_exactness.markdown,
                                      prefix="test", started=time.perf_counter())
    runner.run_all([Unit("a", "fast", unit(0, fail=True)), Unit("b", "slow", unit(1, 0.6)),
                    Unit("c", "slow", unit(2)), Unit("d", "fast", unit(3)), Unit("e", "new", unit(4)),
                    Unit("f", "cheap", unit(5), estimate_s=0.0)])
    assert seen == [[], ["a"], ["a", "b", "c"], ["a", "b", "c", "d", "e"]]  # "c" and "e" were never begun
    results = json.loads((tmp_path / "check.json").read_text())
    status = {u["name"]: u["status"] for u in results["units"]}
    assert status == {"a": "error", "b": "passed", "c": "skipped", "d": "passed", "e": "skipped", "f": "passed"}
    assert "the last 'slow' unit took" in results["units"][2]["reason"]
    assert "the longest unit so far took" in results["units"][4]["reason"]  # a first unit of its kind
    assert results["summary"]["passed"] is False and "a: ValueError: broken unit" in results["summary"]["failures"]
    assert (tmp_path / "check.md").exists()


@pytest.fixture(scope="module")
def float32_pair():
    gpu_exactness = load_script()
    return gpu_exactness.ExactModels(torch.device("cpu"), gpu_exactness.SMOKE)


def test_a_negative_control_that_is_not_rejected_fails_its_case(float32_pair, monkeypatch):
    gpu_exactness = load_script()
    pair, law = float32_pair.pair("float32"), float32_pair.law("float32")
    monkeypatch.setattr(gpu_exactness, "broken_selection", lambda method: contextlib.nullcontext([method]))
    case = gpu_exactness.exactness_case(pair, law, "speculative", "float32", gpu_exactness.SMOKE, compiled=False)
    assert case["p_value"] > gpu_exactness.ACCEPT_P and not case["control"]["rejected"]
    assert case["status"] == "failed" and case["failures"][0].startswith("the negative control was not rejected")


def test_a_sequence_rule_without_a_broken_version_of_its_own_is_rejected_by_the_generic_control(float32_pair):
    gpu_exactness = load_script()
    method = next(m for m in SEQUENCE_RULES if m not in gpu_exactness.BROKEN_SEQUENCE_RULES)
    case = gpu_exactness.exactness_case(float32_pair.pair("float32"), float32_pair.law("float32"), method,
                                        "float32", gpu_exactness.SMOKE, compiled=False)
    assert case["status"] == "passed", case["failures"]
    assert case["control"]["rejected"] and "the first draft alone" in case["control"]["kind"]


def test_a_compiled_case_that_fell_back_to_eager_is_a_failure_of_the_compiled_path(float32_pair, monkeypatch,
                                                                                    tmp_path):
    gpu_exactness = load_script()
    real = spectr.generate

    def falling_back(*args, compile=False, **kwargs):  # the eager engine, reporting one fallback
        out = real(*args, compile=False, **kwargs)
        out.stats.compiled, out.stats.compile_fallbacks = True, 1
        return out

    monkeypatch.setattr(spectr, "generate", falling_back)
    case = gpu_exactness.exactness_case(float32_pair.pair("float32"), float32_pair.law("float32"), "speculative",
                                        "float32", gpu_exactness.SMOKE, compiled=True)
    assert case["status"] == "failed" and case["p_value"] > gpu_exactness.ACCEPT_P  # the tokens were right
    assert any("COMPILED PATH" in f and "compile_fallbacks" in f for f in case["failures"])
    units = [dict(case, name="chi-square float32 speculative compiled")]
    summary = gpu_exactness.summarize(units)
    assert not summary["passed"] and summary["compiled_path_failures"]
    assert summary["compiled_cases"] == {"chi-square float32 speculative compiled": 1}
    assert "## COMPILED PATH FAILED" in gpu_exactness.markdown(dict(units=units, summary=summary))
    assert gpu_exactness.compiled_path_failures("case", dict(compiled=False, compile_fallbacks=None))
    assert not gpu_exactness.compiled_path_failures("case", dict(compiled=True, compile_fallbacks=None))


def test_chi_square_tail_matches_scipy():
    chi2 = pytest.importorskip("scipy.stats").chi2
    gpu_exactness = load_script()
    for statistic, dof in ((0.5, 1), (10.0, 7), (63.0, 63), (400.0, 200), (1e4, 500)):
        assert gpu_exactness.chi_square_sf(statistic, dof) == pytest.approx(chi2.sf(statistic, dof), rel=1e-6,
                                                                            abs=1e-300)


def test_the_negative_control_is_injected_and_then_removed():
    gpu_exactness = load_script()
    before, rules = dict(TOKEN_SELECTORS), dict(SEQUENCE_RULES)
    with gpu_exactness.broken_selection("spectr") as names:
        assert names == ["spectr"] and TOKEN_SELECTORS["spectr"] is not before["spectr"]
        assert all(TOKEN_SELECTORS[n] is before[n] for n in before if n != "spectr")
    assert TOKEN_SELECTORS == before
    with gpu_exactness.broken_selection("a-planner") as names:  # not a selector itself: every selector is broken
        assert sorted(names) == sorted(before)
    assert TOKEN_SELECTORS == before
    for rule in SEQUENCE_RULES:
        with gpu_exactness.broken_selection(rule):
            assert SEQUENCE_RULES[rule] is not rules[rule]
    assert SEQUENCE_RULES == rules
    # the broken rule differs from the real one exactly where every draft was rejected
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    tokens, alive = torch.tensor([[0], [0]]), torch.ones(2, 1, dtype=torch.bool)
    uniforms = torch.tensor([[0.99, 0.9], [0.0, 0.1]], dtype=torch.float64)
    broken = gpu_exactness.skip_residual(TOKEN_SELECTORS["speculative"])
    token, accepted = broken(tokens, alive, probs[[0, 0]], probs[[0, 1]], uniforms)
    assert accepted.tolist() == [True, False] and token.tolist() == [0, 2]


def test_the_engine_settings_of_the_run_are_restored():
    import spectr.native as native

    gpu_exactness = load_script()
    before = (native.COMPILE_BACKEND, native.SELECTION_RULE, native.SELECTION_COMPILE_AFTER)
    with gpu_exactness.compiled_engine("eager"):
        assert (native.COMPILE_BACKEND, native.SELECTION_RULE, native.SELECTION_COMPILE_AFTER) == ("eager", "all", 0)
    assert (native.COMPILE_BACKEND, native.SELECTION_RULE, native.SELECTION_COMPILE_AFTER) == before


@pytest.mark.slow
def test_the_whole_smoke_run_as_the_gpu_machine_runs_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--budget-s", "600", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "exactness.json").read_text())
    assert results["summary"]["verdict"] == "PASSED" and results["summary"]["complete"]
    assert [u["name"] for u in results["units"]] == ORDER
    for unit in results["units"]:
        if unit["name"].endswith(" compiled"):
            assert unit["compiled"] is True and unit["compile_fallbacks"] == 0, unit
        if unit["name"].startswith("compiled greedy"):
            assert all(c["compiled"] and c["compile_fallbacks"] == 0 and c["equal"] for c in unit["cases"]), unit
    bf16 = results["units"][ORDER.index("bf16 compiled self-check margins")]
    assert bf16["comparisons"] > 0 and bf16["margin_max"] < 1
    assert "**PASSED**" in run.stdout and (tmp_path / "exactness.md").exists()
