"""cotangent: a bitwise-exact fast update phase (gradient clipping + AdamW) for PyTorch.

Commands: `train` (native vs Cotangent on a byte-level language model), `bench` (update-phase
benchmark), `calibrate` (show the bitwise calibration verdicts)."""

from __future__ import annotations

import argparse
import os
import sys

from cotangent.harness.data import embedded_corpus, load_wikitext2
from cotangent.harness.model import MODELS
from cotangent.harness.train import (
    ARMS,
    TrainConfig,
    format_comparison,
    result_json,
    run_train,
)

DATA_ENV = "COTANGENT_DATA_DIR"


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train", help="train one seed with the native and the Cotangent update phase",
        description="Train the same seed twice, interleaved: arm `native` (clip_grad_norm_ + "
                    "torch.optim.AdamW fused) and arm `cotangent` (cotangent.AdamW), then compare "
                    "final model hashes, update-phase and whole-step time, and validation BPB.")
    p.add_argument("--model", default=d.model, choices=sorted(MODELS))
    p.add_argument("--arms", default=",".join(d.arms),
                   help=f"comma-separated arms from {', '.join(ARMS)}; the first is the baseline "
                        f"(default {','.join(d.arms)})")
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


def _check_device(name: str) -> None:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build sees no CUDA device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: this torch build sees no MPS device")


def cmd_train(args) -> int:
    for flag, value, low in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--val-bytes", args.val_bytes, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a directory")
    _check_device(args.device)
    data_dir = args.data_dir or os.environ.get(DATA_ENV)
    if data_dir:
        corpus = load_wikitext2(data_dir)
        print(f"data: {corpus.name} from {data_dir} "
              f"({', '.join(f'{s} {len(b):,} B' for s, b in corpus.splits.items())})")
    else:
        corpus = embedded_corpus()
        print(f"data: no WikiText-2 directory given (--data-dir or ${DATA_ENV}); using the "
              f"{corpus.note}")
    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"unknown arm(s) {', '.join(unknown) or '(none)'}; known: {', '.join(ARMS)}")
    cfg = TrainConfig(model=args.model, arms=arms, steps=args.steps, seed=args.seed,
                      batch_size=args.batch_size, device=args.device, precision=args.precision,
                      val_bytes=args.val_bytes, out=args.out)
    result = run_train(cfg, corpus)
    print(format_comparison(result))
    if args.json:
        print(result_json(result))
    return 0 if result["identical_final_hash"] else 1


def _bench_parser(sub) -> None:
    from cotangent.harness.bench import IMPLS, SHAPES

    p = sub.add_parser(
        "bench", help="update-phase benchmark: native vs Cotangent, with a bandwidth floor",
        description="Time the update phase (clip_grad_norm_ + AdamW step vs cotangent.AdamW "
                    "step) per shape and native AdamW implementation, interleaved in one "
                    "process; medians, bitwise check per row, memory, and a 10-pass floor.")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated: default,foreach,fused")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per arm (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="discarded repeats per arm (default 3)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_bench(args) -> int:
    from cotangent.harness import bench

    shapes = [s for s in args.shapes.split(",") if s]
    impls = [i for i in args.impls.split(",") if i]
    unknown = [s for s in shapes if s not in bench.SHAPES] + [i for i in impls
                                                             if i not in bench.IMPLS]
    if unknown:
        raise ValueError(f"unknown shape or implementation: {', '.join(unknown)}")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    _check_device(args.device)
    print(f"update-phase benchmark on {args.device}: {len(shapes)} shapes x {len(impls)} native "
          f"implementations, {args.repeats} repeats (+{args.warmup} warm-up), interleaved")
    result = bench.run_bench(shapes, impls, repeats=args.repeats, warmup=args.warmup,
                             device=args.device)
    print(result["table"])
    missed = [t for t in result["targets"] if not t["met"]]
    print(f"targets met: {len(result['targets']) - len(missed)}/{len(result['targets'])}")
    for t in missed:
        print(f"  missed: {t['target']} ({t['shape']}, {t['native_impl']}): {t['field']} = "
              f"{t['value']:.3f} > {t['bound']}" if isinstance(t["value"], float) else
              f"  missed: {t['target']} ({t['shape']}, {t['native_impl']}): {t['value']}")
    if args.json:
        print(bench.result_json(result))
    return 0 if all(r["bitwise"] for r in result["rows"]) else 1


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="run and show the bitwise calibration probes for a model",
        description="Build the model, pack it with cotangent.AdamW for each native AdamW "
                    "implementation, run the calibration probes, and list every verdict "
                    "(cached in memory and in the user cache file).")
    p.add_argument("--model", default="transformer-small", choices=sorted(MODELS))
    p.add_argument("--json", action="store_true")


def cmd_calibrate(args) -> int:
    import json

    import torch

    import cotangent
    from cotangent import calibration
    from cotangent.harness.model import build_model

    for flags in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        model = build_model(args.model, 0)
        params = list(model.parameters())
        opt = cotangent.AdamW(params, max_norm=1.0, **flags)
        torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
        opt.step()  # builds the merged AdamW calls (their probes run here)
        summary = opt.layout_summary()
        calls = opt.call_summary()
        print(f"{args.model} {flags}: {summary[0]['tensors']} tensors in "
              f"{summary[0]['buckets']} length buckets, {summary[0]['batched_buckets']} with "
              f"batched norms; AdamW in {calls['calls']} list elements for "
              f"{calls['parameters']} parameters")
    rows = calibration.table()
    print(f"cache: {calibration.cache_path() or 'off (memory only)'}")
    for r in rows:
        print(f"  {'yes' if r['verdict'] else 'no ':<4}{r['kind']:<20}{' '.join(r['args'])}  "
              f"[{r['machine']}, torch {r['torch']}, {r['threads']} threads]")
    if args.json:
        print(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cotangent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _bench_parser(sub)
    _calibrate_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {"train": cmd_train, "bench": cmd_bench, "calibrate": cmd_calibrate}[
            args.command](args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
