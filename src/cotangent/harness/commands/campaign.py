"""`cotangent campaign freeze|run|status`: paired-seed campaigns."""

from __future__ import annotations

import os

from cotangent.harness.data import DATA_ENV

from cotangent.harness.commands import train


def add_parser(sub) -> None:
    p = sub.add_parser(
        "campaign", help="paired-seed campaigns: freeze a protocol, run its jobs",
        description="A protocol (TOML; see protocols/) is frozen with its SHA-256 and the code "
                    "and data fingerprints before any job runs; `run` then executes every job "
                    "(one model, seed and arm of `cotangent train`) in the frozen order, each in "
                    "a fresh process, and can be resumed after a crash or Ctrl-C.")
    csub = p.add_subparsers(dest="campaign_command", required=True)
    f = csub.add_parser("freeze", help="validate a protocol and freeze it into a campaign dir")
    f.add_argument("protocol", help="protocol TOML file")
    f.add_argument("--out", default=None, help="campaign directory (default campaigns/<name>)")
    f.add_argument("--data-dir", default=None,
                   help=f"WikiText-2 directory (default ${DATA_ENV}; if unset, the embedded "
                        "corpus)")
    r = csub.add_parser("run", help="run (or resume) every unfinished job of a campaign")
    r.add_argument("campaign", help="campaign directory written by `campaign freeze`")
    r.add_argument("--data-dir", default=None,
                   help="where the data are now (default: the frozen path); hashes must match")
    r.add_argument("--retry-failed", action="store_true",
                   help="run failed jobs again as new attempts (their failures stay recorded)")
    r.add_argument("--max-jobs", type=int, default=None, help="stop after this many jobs")
    r.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="every job also writes its curve as TensorBoard scalars under DIR "
                        "(`cotangent train --tensorboard DIR`: DIR/<run directory name>/<arm>); "
                        "needs the tensorboard extra: pip install 'cotangent[tensorboard]'")
    s = csub.add_parser("status", help="count done, failed and pending jobs")
    s.add_argument("campaign")


def run(args) -> int:
    from pathlib import Path

    from cotangent.harness import campaign

    if args.campaign_command == "freeze":
        campaign.freeze(args.protocol, args.out, args.data_dir or os.environ.get(DATA_ENV))
        return 0
    if args.campaign_command == "status":
        print("\n".join(campaign.status_lines(Path(args.campaign))))
        return 0
    if args.max_jobs is not None and args.max_jobs < 1:
        raise ValueError("--max-jobs must be >= 1")
    train.check_tensorboard_dir(args.tensorboard)
    counts = campaign.run_campaign(Path(args.campaign), data_dir=args.data_dir,
                                   retry_failed=args.retry_failed, max_jobs=args.max_jobs,
                                   tensorboard=args.tensorboard)
    if counts["pending"] == 0:
        print(f"next: cotangent analyze {args.campaign}")
    return 0 if counts["failed"] == 0 else 1
