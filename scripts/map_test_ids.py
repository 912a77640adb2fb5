"""Map every test id of an earlier checkout to its id now: a test moved into another file or
renamed keeps its coverage, and nothing may be lost on the way.

Usage (ids from ``pytest --collect-only -q``, one per line; REV an earlier commit, e.g.
3c467fd, the last before the test files were merged)::

    git worktree add /tmp/before REV
    (cd /tmp/before && PYTHONPATH=src pytest --collect-only -q tests/ | grep ::) > before.txt
    pytest --collect-only -q tests/ | grep :: > after.txt
    python scripts/map_test_ids.py before.txt after.txt

Prints how many old ids map to a new id and exits 1 when an old id maps to nothing (or two old
ids to one new id). `MOVED` and `RENAMED` record the moves of issue 27's restructuring (test
files merged by subject: 45 -> 29).
"""

from __future__ import annotations

import re
import sys
from collections import Counter

MOVED = {  # old file -> the file that holds its tests now
    "tests/test_singlepass_adversarial.py": "tests/test_singlepass_findings.py",
    "tests/test_singlepass_register_adversarial.py": "tests/test_singlepass_findings.py",
    "tests/test_singlepass_bf16_adversarial.py": "tests/test_singlepass_findings.py",
    "tests/test_singlepass_split_adversarial.py": "tests/test_singlepass_findings.py",
    "tests/test_muon_adamw.py": "tests/test_muon.py",
    "tests/test_norms.py": "tests/test_clip.py",
    "tests/test_clip_order.py": "tests/test_clip.py",
    "tests/test_calibration_keys.py": "tests/test_calibration.py",
    "tests/test_probe_steps.py": "tests/test_calibration.py",
    "tests/test_device_script.py": "tests/test_project.py",
    "tests/test_train_distributed.py": "tests/test_train.py",
    "tests/test_bench_muon.py": "tests/test_bench.py",
    "tests/test_compile.py": "tests/test_patterns.py",
    "tests/test_recurrent.py": "tests/test_model.py",
    "tests/test_parity.py": "tests/test_behaviour.py",
    "tests/test_properties.py": "tests/test_behaviour.py",
    "tests/test_schema.py": "tests/test_cli.py",
    "tests/test_contention.py": "tests/test_stats.py",
}
RENAMED = {  # (old file, old test function) -> new test function (names that collided)
    ("tests/test_singlepass_bf16_adversarial.py", "test_attack_held"): "test_bf16_attack_held",
    ("tests/test_singlepass_split_adversarial.py",
     "test_control_the_comparison_sees_another_lr"): "test_split_control_sees_another_lr",
}


def new_id(old: str) -> str:
    """The id `old` has now (itself where nothing moved)."""
    path, _, rest = old.partition("::")
    name = re.match(r"[A-Za-z_0-9]+", rest).group(0)
    renamed = RENAMED.get((path, name))
    if renamed is not None:
        rest = renamed + rest[len(name):]
    return f"{MOVED.get(path, path)}::{rest}"


def main(before_path: str, after_path: str) -> int:
    before = [line.strip() for line in open(before_path) if "::" in line]
    after = {line.strip() for line in open(after_path) if "::" in line}
    mapped = {old: new_id(old) for old in before}
    lost = [old for old, new in mapped.items() if new not in after]
    doubled = [new for new, n in Counter(mapped.values()).items() if n > 1]
    extra = sorted(after - set(mapped.values()))
    moved = sum(old != new for old, new in mapped.items())
    print(f"{len(before)} ids before, {len(after)} now: {len(before) - len(lost)} mapped "
          f"({moved} moved or renamed), {len(lost)} lost, {len(extra)} new")
    for old in lost:
        print(f"LOST {old} (expected {mapped[old]})")
    for new in doubled:
        print(f"TWO OLD IDS -> {new}")
    for new in extra:
        print(f"new {new}")
    return 1 if lost or doubled else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
