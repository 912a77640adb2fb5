"""`cotangent data fetch|info`: the WikiText-2 files."""

from __future__ import annotations

import os

from cotangent.harness.data import DATA_ENV


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="fetch or inspect the WikiText-2 files")
    dsub = p.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="download WikiText-2 (tokenized v1), verifying SHA-256")
    f.add_argument("dataset", choices=["wikitext-2"])
    f.add_argument("--dest", default="data/wikitext-2", help="directory to write (default "
                   "data/wikitext-2)")
    f.add_argument("--base-url", default=None, help="where the three files are (default: the "
                   "public pytorch/examples copy); file:// URLs work")
    i = dsub.add_parser("info", help="show which corpus would be used, from where, and hashes")
    i.add_argument("--data-dir", default=None, help=f"default: ${DATA_ENV}")


def run(args) -> int:
    from cotangent.harness import data

    if args.data_command == "fetch":
        if args.base_url is not None and not args.base_url.strip():
            raise ValueError("--base-url is empty")
        data.fetch_wikitext2(args.dest, args.base_url or data.WIKITEXT2_URL)
        print(f"use it with: cotangent train --data-dir {args.dest}")
        return 0
    print("\n".join(data.describe_corpus(args.data_dir or os.environ.get(DATA_ENV))))
    return 0
