"""The project itself: README commands, docs links, CI entry, packaging, and the device check scripts.

Project invariants: library layering, and the README and CI running the same test command.

`scripts/device_adamw_check.py --dry-run`: the device script's plumbing on the CPU (every
section, the JSON written after each case, the deadline), so that the run on a GPU machine, which
CI does not have, is not its first.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).parents[1]


CORE = ROOT / "src" / "cotangent"


README_TEST_MARK = "<!-- test-command -->"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_library_core_imports_only_torch_and_the_standard_library():
    core_files = [p for p in CORE.glob("*.py")]
    assert core_files
    for path in core_files:
        for name in _imports(path):
            top = name.split(".")[0]
            assert top in ("torch", "cotangent") or top in sys.stdlib_module_names, (path, name)
            if path.name == "_entry.py":  # the command's entry point dispatches to the harness
                assert name in ("cotangent.harness.cli", "__future__", "sys"), (path, name)
            else:
                assert not name.startswith("cotangent.harness"), (path, name)


def test_the_command_entry_point_imports_the_harness_only_when_run():
    """`cotangent._entry` (the console script) must import without the harness extra: its only
    harness import sits inside `main`, where a missing extra becomes a one-line message."""
    tree = ast.parse((CORE / "_entry.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert {a.name for n in top_level for a in n.names} <= {"annotations", "sys"}


def _private_torch_uses(path: Path) -> list[str]:
    """`torch._x` / `torch.a._b` attribute chains and imports from private torch modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                if any(part.startswith("_") and not part.startswith("__") for part in chain):
                    found.append(".".join(["torch", *reversed(chain)]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                    a.name.startswith("_") for a in node.names):
                found.append(node.module)
    return found


def test_private_torch_apis_only_in_compat():
    assert _private_torch_uses(CORE / "_compat.py"), "the detector must see _compat's uses"
    for path in CORE.glob("*.py"):
        if path.name != "_compat.py":
            assert _private_torch_uses(path) == [], path.name


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    i = lines.index(README_TEST_MARK)
    block = lines[i + 1:]
    assert block[0].startswith("```")
    return block[1].strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines(), "the README test command must appear verbatim in .ci/run"
    assert "torch==2.13.0" in ci and "COTANGENT_DATA_DIR=../shared/data/wikitext-2" in ci


def test_readme_is_short_and_its_links_resolve():
    """The README stays a front page (at most 300 lines: what it is, the two set-up commands,
    usage, the guarantee, links); every relative link in it and in docs/ names a file that
    exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 8
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)
    for page in pages[1:]:
        assert f"(docs/{page.name})" in readme, f"README links every docs page: {page.name}"


def test_bitwise_edit_table_names_tests_that_exist():
    """Every test the "What Cotangent notices" table (docs/bitwise.md) cites exists (a `*` is a
    prefix)."""
    import re

    text = (ROOT / "docs" / "bitwise.md").read_text()
    table = text[text.index("## What Cotangent notices"):]
    table = table[:table.index("\n\n", table.index("| Edit"))]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    defined = {m.group(1) for path in (ROOT / "tests").glob("test_*.py")
               for m in re.finditer(r"^def (test_\w+)", path.read_text(), re.M)}
    cited = [c.split("::")[-1] for row in rows[1:] for c in re.findall(r"`([^`]+)`", row.split("|")[3])]
    cited = [c for c in cited if c.startswith("test_") and not c.endswith(".py")]
    assert len(cited) >= 15
    for name in cited:
        prefix = name.rstrip("*")
        assert any(d == name or (name.endswith("*") and d.startswith(prefix)) for d in defined), name


REPO_ROOT = Path(__file__).resolve().parents[1]


SCRIPT = REPO_ROOT / "scripts" / "device_adamw_check.py"


def _run(tmp_path, *args):
    out = tmp_path / "adamw.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
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
