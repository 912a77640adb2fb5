"""The `cotangent` command."""

from __future__ import annotations

import argparse
import os
import sys

from cotangent.harness.data import embedded_corpus, load_wikitext2
from cotangent.harness.model import MODELS
from cotangent.harness.train import TrainConfig, format_comparison, result_json, run_train

DATA_ENV = "COTANGENT_DATA_DIR"


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train", help="train one seed with the native and the Cotangent update phase",
        description="Train the same seed twice, interleaved: arm `native` (clip_grad_norm_ + "
                    "torch.optim.AdamW fused) and arm `cotangent` (cotangent.AdamW), then compare "
                    "final model hashes, update-phase and whole-step time, and validation BPB.")
    p.add_argument("--model", default=d.model, choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=d.steps, help=f"updates per arm (default {d.steps})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda", "mps"])
    p.add_argument("--precision", default=d.precision, choices=["auto", "fp32", "bf16"],
                   help="auto: fp32 on CPU, bf16 autocast (fp32 weights) on cuda/mps")
    p.add_argument("--val-bytes", type=int, default=d.val_bytes,
                   help=f"validate on the first N bytes of valid, 0 = all (default {d.val_bytes})")
    p.add_argument("--data-dir", default=None,
                   help=f"WikiText-2 directory (default: ${DATA_ENV}; if unset, an embedded "
                        "corpus of Python standard-library sources)")
    p.add_argument("--out", default=d.out, help="parent directory for run records")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_train(args) -> int:
    data_dir = args.data_dir or os.environ.get(DATA_ENV)
    if data_dir:
        corpus = load_wikitext2(data_dir)
        print(f"data: {corpus.name} from {data_dir} "
              f"({', '.join(f'{s} {len(b):,} B' for s, b in corpus.splits.items())})")
    else:
        corpus = embedded_corpus()
        print(f"data: no WikiText-2 directory given (--data-dir or ${DATA_ENV}); using the "
              f"{corpus.note}")
    cfg = TrainConfig(model=args.model, steps=args.steps, seed=args.seed,
                      batch_size=args.batch_size, device=args.device, precision=args.precision,
                      val_bytes=args.val_bytes, out=args.out)
    result = run_train(cfg, corpus)
    print(format_comparison(result))
    if args.json:
        print(result_json(result))
    return 0 if result["identical_final_hash"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cotangent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {"train": cmd_train}[args.command](args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
