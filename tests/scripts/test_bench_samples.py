"""scripts/bench_samples.py in its smoke mode: the three arms do the same rows; only the prefills differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_samples.py"


# slow: the measurement script end to end; the engine tests cover the shared prefill
@pytest.mark.slow
def test_samples_prefill_once_per_prompt_and_every_arm_generates_the_same_tokens(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--batch-size", "4", "--json", str(out)], check=True,
                   capture_output=True, timeout=600)
    summary = {row["arm"]: row for row in json.loads(out.read_text())["summary"]}
    assert {row["tokens"] for row in summary.values()} == {6 * 4 * 8}
    assert summary["samples"]["prefilled_rows"] == 6  # one prompt forward per prompt
    assert summary["unshared"]["prefilled_rows"] == 24 and summary["unshared"]["shared_prefill_rows"] == 0
    assert summary["copies"]["prefilled_rows"] > summary["samples"]["prefilled_rows"]  # copies far apart
