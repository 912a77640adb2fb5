"""`cotangent memory`: the saved-tensor audit over the harness models."""

from __future__ import annotations


from cotangent.harness.model import MODEL_CONFIGS


def add_parser(sub) -> None:
    from cotangent.harness.memory_cli import DEMO_VARIANTS

    p = sub.add_parser(
        "memory", help="saved-tensor storage audit: activations that pin whole storages",
        description="Run one forward (+ loss) under torch.autograd.graph.saved_tensors_hooks "
                    "and list what autograd saves for backward, by storage: bytes, bytes its "
                    "saved views reference, pinned storages (less than half referenced) and "
                    "their remedies, size classes. --compare VARIANT audits a second variant "
                    "of the demo stack and prints the signed change per size class.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", default=None, choices=sorted(MODEL_CONFIGS),
                      help="a harness model (random bytes, batch --batch)")
    what.add_argument("--demo", action="store_true",
                      help="a stack of gated blocks whose 32-channel gate slice is saved "
                           f"(variants: {', '.join(DEMO_VARIANTS)})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compile", dest="compiled", action="store_true", default=False,
                      help="audit torch.compile(model) (inductor)")
    mode.add_argument("--eager", dest="compiled", action="store_false", help="(default)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="demo: parameter and input dtype; model: bf16 autocast (default fp32)")
    p.add_argument("--variant", default=None, choices=DEMO_VARIANTS,
                   help="demo gate variant (default slice)")
    p.add_argument("--compare", default=None, choices=DEMO_VARIANTS, metavar="VARIANT",
                   help=f"demo: also audit this variant and print the difference "
                        f"({', '.join(DEMO_VARIANTS)})")
    p.add_argument("--batch", type=int, default=4, help="B (default 4)")
    p.add_argument("--context", type=int, default=None, help="demo T (default 256)")
    p.add_argument("--width", type=int, default=None, help="demo d (default 256)")
    p.add_argument("--layers", type=int, default=None, help="demo gated blocks (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args) -> int:
    import torch

    from cotangent.harness import memory_cli

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    demo_only = {"--variant": args.variant, "--compare": args.compare,
                 "--context": args.context, "--width": args.width, "--layers": args.layers}
    if args.model is not None and any(v is not None for v in demo_only.values()):
        given = [k for k, v in demo_only.items() if v is not None]
        raise ValueError(f"{', '.join(given)}: demo settings; use them with --demo")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    try:
        if args.model is not None:
            report = memory_cli.run_model(args.model, batch=args.batch, compiled=args.compiled,
                                          dtype=dtype)
        else:
            shape = dict(batch=args.batch, context=args.context or 256,
                         width=args.width or 256, layers=args.layers or 2,
                         compiled=args.compiled, dtype=dtype)
            if min(shape["context"], shape["width"], shape["layers"]) < 1:
                raise ValueError("--context, --width and --layers must be >= 1")
            if shape["width"] < memory_cli.GATE_CHANNELS:
                raise ValueError(f"--width must be at least the {memory_cli.GATE_CHANNELS} "
                                 "gate channels")
            variant = args.variant or "slice"
            report = memory_cli.run_demo(variant, **shape)
            if args.compare is not None:
                print(f"baseline: demo variant {variant}")
                print(report.table())
                other = memory_cli.run_demo(args.compare, **shape)
                report.compare(other)
                print(f"\nvariant: {args.compare}")
                report = other
    except (RuntimeError, MemoryError) as exc:  # e.g. sizes beyond this machine's memory
        raise ValueError(f"the audited forward failed: {str(exc).splitlines()[0]}") from None
    print(report.table())
    if args.json:
        print(report.to_json())
    return 0
