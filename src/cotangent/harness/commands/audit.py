"""`cotangent audit`: re-check a campaign's records with the standard library alone."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "audit", help="re-check a campaign's records and statistics (standard library only)",
        description="Verify every record's SHA-256 against the manifests, the job set against "
                    "the frozen protocol, shared init/schedule hashes, step-time sums, and "
                    "recompute every interval; the same as "
                    "`python3 src/cotangent/harness/audit.py RUNS`.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory (after `cotangent analyze`)")


def run(args) -> int:
    from cotangent.harness import audit

    return audit.main([args.runs])
