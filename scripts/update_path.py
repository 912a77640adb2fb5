"""How much code one `cotangent.AdamW.step()` runs: the library functions it enters, their
source lines, the files they live in and the deepest stack of library frames.

    python scripts/update_path.py [--impl for-loop|foreach|fused] [--full] [--verbose]

A steady-state step (the fourth, after three that created the state and proved the single
pass: a step that replays the third's plan, `cotangent.replay`; with ``--full``, the full step
that plans) of a 4-layer MLP (8 tensors, one param group, float32, CPU, clip on) runs under
`sys.settrace`; every function of the `cotangent` package it enters counts with all its
source lines (docstring included; a comprehension counts as the lines of its function, once).
This is the measure of issue 27's "lines read to follow one update from step() to the
arithmetic": what a reader who opens every function the step calls reads. Beside it, the
distinct source lines the step executes (`sys.settrace` line events): what a reader who stops
at each early return reads of those functions, without their docstrings.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys

import torch

import cotangent


def trace_step(impl: str, full: bool = False) -> tuple[dict, int, dict, dict]:
    """(function -> its source lines, the deepest library stack, the step's update_path,
    file -> the line numbers executed)."""
    torch.manual_seed(0)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True)}[impl]
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = cotangent.AdamW(model.parameters(), lr=1e-3, max_norm=1.0, **flags)

    def backward():
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()

    for _ in range(3):
        backward()
        opt.step()
    backward()
    package = os.path.dirname(cotangent.__file__)
    entered: dict = {}
    executed: dict = collections.defaultdict(set)
    stack: list = []
    deepest = 0

    def trace(frame, event, arg):
        nonlocal deepest
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return None  # (no line events inside torch)
        if event == "call":
            stack.append(code)
            deepest = max(deepest, len(stack))
            entered[(code.co_filename, code.co_firstlineno, code.co_name)] = code
        elif event == "return" and stack:
            stack.pop()
        elif event == "line":
            executed[os.path.relpath(code.co_filename, package)].add(frame.f_lineno)
        return trace

    if full:
        opt._replay = None  # (the full step: gather, clip, plan, run, and a plan for the next)
    sys.settrace(trace)
    try:
        opt.step()
    finally:
        sys.settrace(None)
    lines = {}
    for (path, _, name), code in entered.items():
        if name.startswith("<"):  # a comprehension or lambda: its function's lines
            continue
        source, first = inspect.getsourcelines(code)
        lines[(os.path.relpath(path, package), first, name)] = range(first, first + len(source))
    return lines, deepest, opt.update_path(), executed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("for-loop", "foreach", "fused"), default=None,
                        help="one implementation (default: all three)")
    parser.add_argument("--full", action="store_true",
                        help="trace the full step (default: the replayed one)")
    parser.add_argument("--verbose", action="store_true", help="list every function")
    args = parser.parse_args(argv)
    for impl in [args.impl] if args.impl else ["for-loop", "foreach", "fused"]:
        lines, deepest, path, executed = trace_step(impl, args.full)
        per_file: dict = collections.defaultdict(set)
        for (file, _, _), span in lines.items():
            per_file[file].update(span)
        total = sum(map(len, per_file.values()))
        print(f"{impl}: {len(lines)} functions, {total} lines in {len(per_file)} files, "
              f"{sum(map(len, executed.values()))} of them executed, {deepest} library frames "
              f"deep (path: {path['path']}, clip in pass: {path['clip_in_pass']}, "
              f"replayed: {path['replayed']})")
        for file, span in sorted(per_file.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(span):5d} {len(executed.get(file, ())):5d}  {file}")
        if args.verbose:
            for (file, first, name), span in sorted(lines.items()):
                print(f"        {file}:{first} {name} ({len(span)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
