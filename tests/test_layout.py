"""The layering of the tree: `jobs -> pipeline -> spectr`, one package per job, nothing importing back up."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB_PACKAGES = ("pipeline.generate", "pipeline.benchmark", "pipeline.train_pair", "pipeline.train_draft")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_spectr_imports_only_torch_and_transformers():
    forbidden = ("ray", "mlflow", "hydra", "omegaconf", "pyarrow", "datasets", "pipeline", "jobs")
    code = (
        "import sys, spectr, spectr.planner, spectr.diagnostics, spectr.reference\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_spectr_source_never_names_the_job_stack():
    for path in package_files("spectr"):
        for module in imported_modules(path):
            assert module.split(".")[0] not in ("ray", "mlflow", "hydra", "omegaconf", "pyarrow", "pipeline"), (
                f"{path.relative_to(REPO)} imports {module}"
            )


def test_the_engine_never_imports_the_planner():
    """`spectr/planner` sits above the engine: only the planner itself and the public entry point above both
    (`spectr/api.py`, re-exported by `spectr/__init__.py`) may import it."""
    above = {REPO / "spectr" / "api.py", REPO / "spectr" / "__init__.py"}
    for path in package_files("spectr"):
        if path in above or (REPO / "spectr" / "planner") in path.parents:
            continue
        for module in imported_modules(path):
            assert not module.startswith("spectr.planner"), f"{path.relative_to(REPO)} imports {module}"
            assert module != "spectr.api", f"{path.relative_to(REPO)} imports {module}"


def test_shared_pipeline_modules_do_not_import_a_job_package():
    shared = [p for p in (REPO / "pipeline").glob("*.py")]
    assert shared
    for path in shared:
        for module in imported_modules(path):
            assert not module.startswith(JOB_PACKAGES), f"{path.relative_to(REPO)} imports {module}"


def test_job_packages_do_not_import_each_other():
    for package in JOB_PACKAGES:
        folder = package.replace(".", "/")
        others = tuple(p for p in JOB_PACKAGES if p != package)
        for path in package_files(folder):
            for module in imported_modules(path):
                assert not module.startswith(others), f"{path.relative_to(REPO)} imports {module}"


def test_no_function_over_sixty_lines_in_the_packages():
    long = []
    for folder in ("spectr", "pipeline", "jobs"):
        for path in package_files(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_benchmark_results_hold_data_not_scripts():
    """benchmarks/results/ holds data and READMEs; the scripts that make them live in scripts/."""
    found = [str(p.relative_to(REPO)) for p in (REPO / "benchmarks" / "results").rglob("*")
             if p.suffix in (".py", ".sh")]
    assert found == [], f"scripts under benchmarks/results/ (move them to scripts/): {found}"


def test_benchmark_scripts_share_the_harness():
    """Every benchmark script in scripts/ (bench_*, measure_*) takes its machine, rounds and report from
    scripts/harness.py rather than its own copy."""
    scripts = sorted((REPO / "scripts").glob("bench_*.py")) + sorted((REPO / "scripts").glob("measure_*.py"))
    assert scripts
    missing = [p.name for p in scripts if "from harness import" not in p.read_text()]
    assert missing == [], f"benchmark scripts not on scripts/harness.py: {missing}"
