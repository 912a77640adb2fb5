"""`cotangent report`: figures and the report of a campaign."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="figures and a Markdown/HTML report of an analysed campaign",
        description="Writes RUNS/report/: four PNG figures (five when the campaign ran the "
                    "four arms of the 2x2 factorial), report.md, a self-contained report.html "
                    "and a manifest.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory (after `cotangent analyze`)")


def run(args) -> int:
    from pathlib import Path

    from cotangent.harness.report import build_report

    build_report(Path(args.runs))
    return 0
