"""scripts/gpu_speed.py in its smoke mode: the units the GPU times, on the CPU with a tiny Llama.

The default suite runs a light smoke run once, in-process (the batch-1 headline unit, our compiled
autoregressive against HF static cache, and ours speculative against HF assisted), and checks what it
wrote; unit tests cover the order of the units (the headline first), a spent budget (every unit skipped and
recorded, exit 0), a unit that raises (an error row, the run goes on, exit 0), the interleaved timing and the
ratios and headline figures. The whole smoke run, every unit, as the GPU machine runs it (a subprocess), is
marked slow (about a minute).
"""

from __future__ import annotations

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

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "gpu_speed.py"
LIGHT = "headline B=1: ours,ours speculative vs HF assisted"


def load_script():
    return script_support.load_script("gpu_speed")


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    gpu_speed = load_script()
    out = tmp_path_factory.mktemp("gpu_speed")
    code = gpu_speed.main(["--smoke", "--only", LIGHT, "--out", str(out)], started=time.perf_counter())
    torch._dynamo.reset()
    return dict(code=code, out=out, results=json.loads((out / "speed.json").read_text()))


def test_the_light_smoke_run_measures_the_headline_and_writes_json_and_markdown(light):
    results = light["results"]
    assert light["code"] == 0
    assert [(u["name"], u["status"]) for u in results["units"]] == [
        ("headline B=1: ours compiled autoregressive vs HF static cache + compile", "measured"),
        ("B=1: ours speculative vs HF assisted", "measured")]
    top = results["summary"]["headline"]
    versus_hf = top["compiled_autoregressive_vs_hf_static_compiled"]
    assert [v["batch"] for v in versus_hf] == [1, 2]
    assert versus_hf[0]["ratio"] > 0 and versus_hf[1]["ratio"] is None  # B=2 was not selected
    best = top["best_exact_vs_autoregressive_b1"]
    assert best["best"] == "ours speculative L=2" and best["autoregressive"] == "ours autoregressive compiled"
    assert best["ratio"] == pytest.approx(best["best_tokens_per_s"] / best["autoregressive_tokens_per_s"])
    markdown = (light["out"] / "speed.md").read_text()
    assert "## Headline" in markdown and "Best exact method at B=1: ours speculative L=2" in markdown
    compiled = [r for u in results["units"] for r in u["rows"] if r.get("compiled") and r["kind"] == "ours"]
    assert compiled and all(r["warmup_s"] > 0 and r["compile_s"] >= 0 for r in compiled)  # compile time apart


def test_one_pool_per_model_is_reserved_for_the_plans_largest_configuration():
    """Every compiled run of the script reads one static pool per model, sized up front for the plan's largest
    batch, prompt + new tokens and tree, so no timed run waits for a new pool (and on CUDA a re-recording)."""
    import spectr.native as native

    gpu_speed = load_script()
    plan = gpu_speed.SMOKE
    (target, draft), _ = gpu_speed.build_pair(plan, torch.device("cpu"))
    widest = max(max(plan.grid_drafts) * max(plan.grid_lengths), plan.headline_spectr[0] * plan.headline_spectr[1])
    capacity = plan.prompt_lengths[1] + plan.speed_new_tokens + 2 + widest
    for model in (target, draft):
        assert native.model_state(model).reserved == (max(plan.speed_batches), capacity)


def test_rows_have_throughput_costs_syncs_and_ratios(light):
    (compiled, hf_static), (speculative, assisted) = [u["rows"] for u in light["results"]["units"]]
    assert compiled["ran_compiled"] is True and compiled["compile_fallbacks"] == 0 and compiled["warmup_s"] > 0
    assert compiled["prefill_removed"] is False and "host_syncs_per_iteration" not in compiled  # no extra runs
    assert compiled["vs_hf_static_compiled"] == pytest.approx(compiled["tokens_per_s"] / hf_static["tokens_per_s"])
    assert hf_static["warmup_s"] > 0 and hf_static["tokens_per_s"] > 0 and assisted["tokens_per_s"] > 0
    assert speculative["prefill_removed"] is True and speculative["iteration_ms"] >= 0
    assert isinstance(speculative["host_syncs_per_iteration"], float)
    assert set(speculative["per_iteration_ms"]) == {"draft", "target", "selection", "other"}
    assert speculative["vs_hf"]["hf_run"] == "HF assisted L=2" and speculative["vs_hf"]["ratio"] > 0


def smoke_units(gpu_speed):
    return gpu_speed.speed_units(gpu_speed.SMOKE, gpu_speed.auto_available(), tuple(spectr.known_methods()))


def test_the_headline_units_come_first_and_no_row_is_timed_twice_in_a_unit():
    gpu_speed = load_script()
    units = gpu_speed.speed_units(gpu_speed.FULL, True, tuple(spectr.known_methods()))
    assert [(u.group[0].batch, [r.name for r in u.group]) for u in units[:3]] == [
        (b, ["ours autoregressive compiled", "HF generate static cache + compile"]) for b in (1, 16, 64)]
    assert [r.name for r in units[3].group] == ["ours autoregressive compiled", "ours spectr K=2 L=4 compiled",
                                                "ours block L=4 compiled", "ours speculative L=4 compiled"]
    assert all(u.name.startswith("headline") for u in units[:4])
    assert not any(u.name.startswith("headline") for u in units[4:])
    assert len({u.name for u in units}) == len(units)
    assert all(len({r.name for r in u.group}) == len(u.group) for u in units)
    assert {run.batch for u in units for run in u.group} == {1, 16, 64}


def test_a_spent_budget_skips_every_unit_and_exits_zero(tmp_path):
    gpu_speed = load_script()
    assert gpu_speed.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "speed.json").read_text())
    assert [u["name"] for u in results["units"]] == [u.name for u in smoke_units(gpu_speed)]
    assert all(u["status"] == "skipped" and "budget of 0 s spent" in u["reason"] for u in results["units"])
    assert results["summary"]["counts"]["skipped"] == len(results["units"])
    assert "skipped for time" in (tmp_path / "speed.md").read_text()


def canned_runs(gpu_speed, monkeypatch, failing_kind: str | None = None):
    """Stand-ins for the timed calls (no model runs): each returns fixed figures; `failing_kind` raises."""
    target = gpu_speed.random_llama(gpu_speed.TINY_LLAMA, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    stats = spectr.generate(target, None, [[5, 6, 7]], method="autoregressive", max_new_tokens=3).stats
    order = []

    def run_once(pair, prompts, run, new_tokens, device):
        order.append(run.name)
        if run.kind == failing_kind:
            raise RuntimeError("out of memory (stand-in)")
        result = dict(wall_s=1.0, tokens=3 * new_tokens, tokens_per_s=3.0 * new_tokens, peak_memory_mib=None)
        return dict(result, stats=stats, iterations=new_tokens) if run.kind == "ours" else result

    monkeypatch.setattr(gpu_speed, "run_once", run_once)
    monkeypatch.setattr(gpu_speed, "run_ours", run_once)
    monkeypatch.setattr(gpu_speed, "warm_up", lambda pair, prompts, device: None)
    return order


def test_a_unit_that_raises_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    gpu_speed = load_script()
    canned_runs(gpu_speed, monkeypatch, failing_kind="hf")
    code = gpu_speed.main(["--smoke", "--only", "B=2: eager,headline B=2", "--out", str(tmp_path)],
                          started=time.perf_counter())
    results = json.loads((tmp_path / "speed.json").read_text())
    assert code == 0
    assert [(u["name"], u["status"]) for u in results["units"]] == [
        ("headline B=2: ours compiled autoregressive vs HF static cache + compile", "measured"),
        ("B=2: eager, HF generate, SpecTr compiled", "partial")]
    errors = [r for r in results["units"][1]["rows"] if "error" in r]
    assert [r["name"] for r in errors] == ["HF generate (sampling)"] and "out of memory" in errors[0]["error"]
    assert "error: RuntimeError: out of memory" in (tmp_path / "speed.md").read_text()


def test_runs_are_timed_interleaved_after_the_compiled_warm_ups(monkeypatch):
    gpu_speed = load_script()
    order = canned_runs(gpu_speed, monkeypatch)
    SpeedRun = gpu_speed.SpeedRun
    group = (SpeedRun("ours", 2), SpeedRun("ours", 2, compiled=True), SpeedRun("hf_static", 2))
    rows = gpu_speed.measure_group((None, None), [[1, 2]] * 2, group, gpu_speed.SMOKE, torch.device("cpu"), 2)
    names = [run.name for run in group]
    # the compiled runs' warm-up, 2 interleaved rounds, then the eager row's one-token and two sync runs
    assert order[:8] == names[1:] + names + names and len(order) == 8 + 3
    eager, compiled, hf_static = rows
    assert eager["warmup_s"] is None and compiled["warmup_s"] == 1.0 and hf_static["warmup_s"] == 1.0
    assert compiled["repeats"] == 2 and "host_syncs_per_iteration" in eager


def test_ratios_prefer_the_same_unit_and_the_headline_takes_the_fastest_exact_method():
    gpu_speed = load_script()

    def row(unit, name, tokens_per_s, method="autoregressive", compiled=False, kind="ours", batch=1):
        return dict(unit=unit, name=name, batch=batch, kind=kind, method=method, compiled=compiled, attention="",
                    draft_length=4, tokens_per_s=tokens_per_s)

    versus = gpu_speed.versus_hf_unit(1)
    rows = [row(versus, "ours autoregressive compiled", 100.0, compiled=True),
            row(versus, "HF generate static cache + compile", 50.0, method="hf_static", kind="hf_static"),
            row("exact", "ours autoregressive compiled", 120.0, compiled=True),
            row("exact", "ours spectr K=2 L=4 compiled", 180.0, method="spectr", compiled=True),
            row("grid", "ours spectr K=4 L=6", 90.0, method="spectr")]
    gpu_speed.add_ratios(rows)
    assert rows[0]["vs_hf_static_compiled"] == 2.0  # its own unit's HF row
    assert rows[3]["speedup_vs_our_compiled_autoregressive"] == 1.5  # the AR row of its own unit (120)
    assert rows[4]["speedup_vs_our_compiled_autoregressive"] == 0.75  # no AR in its unit: the last measured
    top = gpu_speed.headline(rows, [1, 16])
    assert top["compiled_autoregressive_vs_hf_static_compiled"][0]["ratio"] == 2.0
    assert top["compiled_autoregressive_vs_hf_static_compiled"][1]["ratio"] is None
    best = top["best_exact_vs_autoregressive_b1"]
    assert best["best"] == "ours spectr K=2 L=4 compiled" and best["ratio"] == 1.5  # vs the fastest AR run


def test_the_attention_units_name_masked_and_flex_apart_and_restore_it():
    import spectr.native as native

    gpu_speed = load_script()
    units = gpu_speed.speed_units(gpu_speed.SMOKE)
    tail = units[-len(gpu_speed.SMOKE.speed_batches):]
    for unit in tail:
        masked, flex = unit.group
        assert (masked.attention, flex.attention) == ("masked", "flex") and masked.compiled and flex.compiled
        assert (masked.name, flex.name) == ("ours spectr K=2 L=2 compiled masked", "ours spectr K=2 L=2 compiled flex")
    rows = [dict(name=name, kind="ours", batch=2, method="spectr", draft_length=2, tokens_per_s=tps,
                 compiled="compiled" in name, attention=name.split()[-1] if "compiled " in name else "")
            for name, tps in [("ours autoregressive", 100.0), ("ours spectr K=2 L=2", 50.0),
                              ("ours spectr K=2 L=2 compiled masked", 80.0), ("ours spectr K=2 L=2 compiled flex", 60.0)]]
    gpu_speed.add_ratios(rows)
    assert rows[3]["flex_vs_masked"] == pytest.approx(0.75) and rows[3]["compiled_vs_eager"] == pytest.approx(1.2)
    assert "flex / masked attention 0.75x" in "\n".join(gpu_speed.markdown_rows(rows))
    with gpu_speed.attention("flex"):
        assert native.ATTENTION == "flex"
    assert native.ATTENTION == "masked"


@pytest.mark.slow
def test_the_whole_smoke_run_as_the_gpu_machine_runs_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--budget-s", "600", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "speed.json").read_text())
    assert all(u["status"] == "measured" for u in results["units"]), [u for u in results["units"]
                                                                       if u["status"] != "measured"]
    gpu_speed = load_script()
    assert [u["name"] for u in results["units"]] == [u.name for u in smoke_units(gpu_speed)]
    top = results["summary"]["headline"]
    assert all(v["ratio"] > 0 for v in top["compiled_autoregressive_vs_hf_static_compiled"])
    assert top["best_exact_vs_autoregressive_b1"]["ratio"] > 0
    rows = [row for unit in results["units"] for row in unit["rows"]]
    assert {r["kind"] for r in rows} == {"ours", "hf", "hf_static", "hf_assisted"}
    assert all(r["compile_fallbacks"] == 0 for r in rows if r["kind"] == "ours")
    assert "## Headline" in run.stdout
