"""`cotangent analyze`: a campaign's statistics."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze", help="paired statistics of a finished campaign",
        description="Per pair: time-to-target (censored when not reached), fixed-budget "
                    "training-time and update-phase reductions, test BPB difference, identical "
                    "final hash; paired Student-t intervals at the protocol's level, "
                    "non-inferiority, 2x2 factorial contrasts, seed-bootstrap cross-check. "
                    "Writes RUNS/analysis/{results.json,pairs.csv,runs.csv,manifest.json}.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory")


def run(args) -> int:
    from pathlib import Path

    from cotangent.harness.analysis import analyze, format_results

    print(format_results(analyze(Path(args.runs))))
    return 0
