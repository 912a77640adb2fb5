"""`scripts/device_adamw_check.py --dry-run`: the device script's plumbing on the CPU (every
section, the JSON written after each case, the deadline), so that the run on a GPU machine, which
CI does not have, is not its first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_adamw_check.py"


def _run(tmp_path, *args):
    out = tmp_path / "adamw.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_passes_every_case_and_writes_each_section(tmp_path):
    proc, doc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert doc["dry_run"] is True and doc["device"] == "cpu"
    assert set(doc["sections"]) == {"facts", "parity", "syncs", "timing"}
    rows = [r for rows in doc["sections"].values() for r in rows]
    assert doc["ended"]["cases"] == len(rows) and not doc["ended"]["failed"]
    parity = {r["case"]: r for r in doc["sections"]["parity"]}
    assert len([c for c in parity if "clip active" in c]) == 9  # 3 implementations x 3 kinds
    assert all(r["checks"] > 0 for r in parity.values() if "checks" in r)
    assert parity["CUDA graph capture of step() is refused like native's"]["skipped"]
    timing = doc["sections"]["timing"]
    assert [r["case"] for r in timing] == ["default", "foreach", "fused"]
    assert all(r["ms"]["native"]["update"] > 0 for r in timing)


@pytest.mark.slow
def test_a_spent_budget_skips_what_is_left_and_still_writes_the_document(tmp_path):
    proc, doc = _run(tmp_path, "--budget", "0")
    rows = [r for rows in doc["sections"].values() for r in rows]
    assert rows and all(r["status"] == "skipped: budget" for r in rows)
    assert proc.returncode == 0 and doc["ended"]["skipped"] == [r["case"] for r in rows]
