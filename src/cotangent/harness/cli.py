"""cotangent: a bitwise-exact fast update phase (gradient clipping + AdamW) for PyTorch.

Commands: `train` (native vs Cotangent on a byte-level language model), `bench` (update-phase
benchmark), `calibrate` (show the bitwise calibration verdicts), `verify` (the built-in bitwise
suite), `data` (fetch or inspect WikiText-2), `campaign freeze|run|status` (paired-seed
campaigns), `analyze` (their statistics), `audit` (re-check them, standard library only),
`report` (figures and report)."""

from __future__ import annotations

import argparse
import os
import sys

from cotangent.harness.commands import (analyze, audit, bench, calibrate, campaign, data, memory,
                                        report, train, verify)
from cotangent.harness.train import OccurrenceSyncError, end_rank_process

# Each command is a module of `cotangent.harness.commands` with its parser (`add_parser`) and
# its body (`run(args) -> exit status`).
COMMANDS = {"train": train, "bench": bench, "calibrate": calibrate, "verify": verify,
            "data": data, "campaign": campaign, "analyze": analyze, "audit": audit,
            "memory": memory, "report": report}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cotangent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc N` starts its ranks with these arguments
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print("cotangent: interrupted (run directories of an unfinished run keep their "
              "INCOMPLETE marker)", file=sys.stderr)
        return 130
    except (OSError, ValueError) as exc:
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 2
    except OccurrenceSyncError as exc:  # a study arm's replicas diverged: the run failed
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    exit_code = main()
    if "LOCAL_RANK" in os.environ:  # started by torchrun or `train --nproc` as one rank
        end_rank_process(exit_code)
    sys.exit(exit_code)
