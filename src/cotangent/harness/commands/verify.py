"""`cotangent verify`: the built-in bitwise suite."""

from __future__ import annotations

import os


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="prove native == Cotangent bit for bit on the built-in model suite",
        description="Run native (clip_grad_norm_ + torch.optim.AdamW fused) and each Cotangent "
                    "configuration side by side on the four research model families (tiny "
                    "widths unless --full-width) in FP32 and BF16 autocast, comparing loss, "
                    "every gradient, the clip norm, every parameter and both moments byte for "
                    "byte after every update; exits non-zero on the first difference.")
    p.add_argument("--steps", type=int, default=4, help="updates per case (default 4)")
    p.add_argument("--full-width", action="store_true", help="the real model widths (slow)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")


def run(args) -> int:
    from cotangent.harness.verify_suite import run_suite, write_report

    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.json is not None and (not args.json or not os.path.isdir(
            os.path.dirname(os.path.abspath(args.json)))):
        raise ValueError(f"--json {args.json!r}: not a file path in an existing directory")
    print("verify: native vs cotangent, byte for byte, on CPU")
    result = run_suite(steps=args.steps, full_width=args.full_width,
                       compile_check=not args.no_compile)
    failed = [c for c in result["cases"] if not c["passed"]]
    print(f"{len(result['cases']) - len(failed)}/{len(result['cases'])} cases identical, "
          f"{result['steps']} update steps, {result['checks']} tensor comparisons")
    for case in failed:
        print(f"FAILED {case['model']} {case['precision']} {case['arm']}: {case['first_failure']}")
    if args.json:
        write_report(result, args.json)
    return 0 if result["passed"] else 1
