"""`cotangent bench`: the update-phase benchmark (single process, `--distributed N [--fsdp2]`,
`--muon`)."""

from __future__ import annotations


from cotangent.harness.train import check_device


def add_parser(sub) -> None:
    from cotangent.harness.bench import BATCH_SIZE, IMPLS, METHODS, SEQ_LEN, SHAPES
    from cotangent.harness.bench_muon import MATRIX_SETS as MUON_MATRIX_SETS

    p = sub.add_parser(
        "bench", help="update-phase benchmark: native vs Cotangent, with a bandwidth floor",
        description="Time the update phase (clip_grad_norm_ + AdamW step + zero_grad vs "
                    "cotangent.AdamW step + zero_grad) after a real forward + backward, per "
                    "shape and native AdamW implementation, interleaved in one process; "
                    "medians, bitwise check per row, memory, and a 10-pass floor.")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated, from {', '.join(SHAPES)} (default: all)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated, from {', '.join(IMPLS)} (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per arm (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="discarded repeats per arm (default 3)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument("--method", default=None, choices=METHODS,
                   help="how each repeat gets its gradients: real-backward (default: a "
                        "forward + backward of the model, as a training loop) or "
                        "synthetic-grads (torch.autograd.backward(params, grads) with fixed "
                        "gradients: no model compute, caches warmer than in training)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"real-backward: sequences per forward (default {BATCH_SIZE})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"real-backward: tokens per sequence, at most the model's context "
                        f"(default {SEQ_LEN})")
    p.add_argument("--distributed", type=int, default=None, metavar="N",
                   help="instead: the update phase under DistributedDataParallel on N CPU "
                        "ranks (gloo): native DDP, cotangent DDP, ZeroRedundancyOptimizer and "
                        "cotangent ZeRO-1 (default shapes: "
                        "many-small,transformer-small,causal-conv,gated-gqa; --impls default "
                        "fused)")
    p.add_argument("--fsdp2", action="store_true",
                   help="with --distributed N: FSDP2 (fully_shard per block and the root) "
                        "instead of DDP: native clip + AdamW on the DTensor parameters against "
                        "cotangent.AdamW, after a real forward and backward")
    p.add_argument("--muon", action="store_true",
                   help="instead: cotangent.Muon vs torch.optim.Muon on sets of equal-shape "
                        "matrices (--shapes picks matrix sets from "
                        f"{', '.join(MUON_MATRIX_SETS)}; default all)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args) -> int:
    from cotangent.harness import bench

    gradient_options = (args.method, args.batch_size, args.seq_len)
    if (args.muon or args.distributed is not None) and gradient_options != (None,) * 3:
        raise ValueError("--method, --batch-size and --seq-len apply to the plain bench only "
                         "(not --muon or --distributed)")
    if args.method == "synthetic-grads" and (args.batch_size, args.seq_len) != (None, None):
        raise ValueError("--batch-size and --seq-len apply to --method real-backward only")
    if args.muon:
        return _bench_muon(args)
    if args.fsdp2 and args.distributed is None:
        raise ValueError("--fsdp2 needs --distributed N (the number of CPU ranks)")
    if args.distributed is not None:
        return _bench_distributed(args)
    shapes, impls = _bench_choices(args, bench.SHAPES, tuple(bench.IMPLS))
    check_device(args.device)
    method = args.method or bench.METHODS[0]
    batch_size = bench.BATCH_SIZE if args.batch_size is None else args.batch_size
    seq_len = bench.SEQ_LEN if args.seq_len is None else args.seq_len
    print(f"update-phase benchmark on {args.device}: {len(shapes)} shapes x {len(impls)} native "
          f"implementations, {args.repeats} repeats (+{args.warmup} warm-up), interleaved; "
          f"{bench.method_line(method, batch_size, seq_len)}")
    result = bench.run_bench(shapes, impls, repeats=args.repeats, warmup=args.warmup,
                             method=method, batch_size=batch_size, seq_len=seq_len,
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


def _bench_choices(args, shapes_default, impls_default) -> tuple[list[str], list[str]]:
    """--shapes and --impls as lists, checked against the benchmark's shapes and
    implementations (ValueError naming the valid ones)."""
    from cotangent.harness import bench

    shapes = [s for s in (args.shapes or ",".join(shapes_default)).split(",") if s]
    impls = [i for i in (args.impls or ",".join(impls_default)).split(",") if i]
    bad_shapes = [s for s in shapes if s not in bench.SHAPES]
    if bad_shapes:
        raise ValueError(f"unknown shape(s) {', '.join(bad_shapes)} in --shapes; valid: "
                         f"{', '.join(bench.SHAPES)}")
    bad_impls = [i for i in impls if i not in bench.IMPLS]
    if bad_impls:
        raise ValueError(f"unknown implementation(s) {', '.join(bad_impls)} in --impls; valid: "
                         f"{', '.join(bench.IMPLS)}")
    if not shapes or not impls:
        raise ValueError("--shapes and --impls must each name at least one")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    return shapes, impls


def _bench_distributed(args) -> int:
    """`cotangent bench --distributed N`: four arms under DDP on N CPU ranks."""
    from cotangent.harness import bench, bench_distributed

    shapes, impls = _bench_choices(args, bench_distributed.DISTRIBUTED_SHAPES, ("fused",))
    if args.distributed < 1:
        raise ValueError(f"--distributed needs at least 1 rank, got {args.distributed}")
    if args.device != "cpu":
        raise ValueError("--distributed runs on cpu (gloo) only")
    print(f"distributed update-phase benchmark: {args.distributed} CPU ranks, {len(shapes)} "
          f"shapes x {len(impls)} native implementations, {args.repeats} repeats "
          f"(+{args.warmup} warm-up), arms interleaved")
    result = bench_distributed.run_distributed_bench(
        args.distributed, shapes, impls, repeats=args.repeats, warmup=args.warmup,
        fsdp2=args.fsdp2)
    print(result["table"])
    if args.json:
        print(bench.result_json(result))
    return 0 if all(r["bitwise"] for r in result["rows"]) else 1


def _bench_muon(args) -> int:
    """`cotangent bench --muon`: the Muon rows, cotangent.Muon vs torch.optim.Muon, one per
    matrix set named in --shapes (default all; harness/bench_muon.py)."""
    from cotangent.harness import bench_muon

    if args.distributed is not None or args.impls or args.device != "cpu":
        raise ValueError("--muon runs on cpu in one process; --distributed, --impls and "
                         "--device do not apply")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    names = [s for s in (args.shapes or "").split(",") if s]
    unknown = [n for n in names if n not in bench_muon.MATRIX_SETS]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)} in --shapes; valid with "
                         f"--muon: {', '.join(bench_muon.MATRIX_SETS)}")
    sets = names or list(bench_muon.MATRIX_SETS)
    print(bench_muon.muon_bench_header(sets, args.repeats, args.warmup))
    result = bench_muon.run_muon_bench(sets, repeats=args.repeats, warmup=args.warmup)
    print(result["table"])
    if args.json:
        print(bench_muon.muon_result_json(result))
    return 0 if bench_muon.muon_bench_ok(result) else 1
