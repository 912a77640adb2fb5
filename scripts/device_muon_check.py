"""Device check for the Muon optimizers (run on a CUDA machine; `--small` runs it on CPU).

1. `cotangent.Muon` against `torch.optim.Muon` (same arguments): bytes of every parameter and
   momentum buffer after each step, the batched-probe verdict per batch, and the median step
   time of each (arms interleaved, gradients from a real backward before each step).
2. `cotangent.MuonAdamW` (its one path, the published stack/copy step; eager), one run: its
   in-place semantics after every step (each parameter keeps its storage, `data_ptr`; each
   `p.grad` is still the tensor autograd produced in that step's backward, bytes unchanged by
   the step; every parameter's values changed) and the median step time (and of the
   backward, of zero_grad, of step + zero_grad). Its former packed path is gone, so there is
   nothing to compare it with.

Writes one JSON document to the path given by --out (default: stdout only).
    PYTHONPATH=src python3 scripts/device_muon_check.py --out $OUT/muon-cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
from torch import nn

import cotangent
from cotangent.verify import first_difference


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mats(shapes, device, seed):
    torch.manual_seed(seed)
    return nn.ParameterList(nn.Parameter(torch.randn(r, c, device=device) / c ** 0.5)
                            for r, c in shapes)


def _loss(mats, x_by_cols):
    total = 0.0
    for w in mats:
        total = total + (x_by_cols[w.shape[1]] @ w.T).square().mean()
    return total


def muon_rows(groups, device, steps, repeats):
    out = []
    for name, shapes in groups.items():
        native, ours = _mats(shapes, device, 0), _mats(shapes, device, 0)
        opt_n = torch.optim.Muon(native.parameters(), lr=0.02)
        opt_o = cotangent.Muon(ours.parameters(), lr=0.02)
        gen = torch.Generator(device=device).manual_seed(1)
        cols = sorted({c for _, c in shapes})
        times = {"native": [], "cotangent": []}
        problem = None
        for step in range(steps + repeats):
            xs = {c: torch.randn(16, c, device=device, generator=gen) for c in cols}
            order = ((native, opt_n, "native"), (ours, opt_o, "cotangent"))
            for model, opt, arm in (order if step % 2 == 0 else order[::-1]):
                _loss(model, xs).backward()
                _sync(device)
                t0 = time.perf_counter()
                opt.step()
                _sync(device)
                times[arm].append(time.perf_counter() - t0)
                opt.zero_grad()
            for a, b in zip(native.parameters(), ours.parameters()):
                problem = problem or first_difference(a, b) or first_difference(
                    opt_n.state[a]["momentum_buffer"], opt_o.state[b]["momentum_buffer"])
        nat = statistics.median(times["native"][steps:]) * 1e3
        our = statistics.median(times["cotangent"][steps:]) * 1e3
        out.append({"batch": name, "shapes": shapes, "native_ms": nat, "cotangent_ms": our,
                    "ratio": our / nat, "bitwise": problem is None, "first_difference": problem,
                    "batched": [b["batched"] for b in opt_o.batch_summary()]})
        print(json.dumps(out[-1]), flush=True)
    return out


def muon_adamw_run(width, blocks, device, steps, repeats):
    """One MuonAdamW run (eager): in-place checks after every step, median times after the
    `steps` warm-up ones."""
    shapes = [(width, width)] * 4 * blocks + [(4 * width, width), (width, 4 * width)] * blocks
    torch.manual_seed(0)
    emb = nn.Parameter(torch.randn(256, width, device=device) * 0.02)
    mats = _mats(shapes, device, 0)
    params = [emb, *mats]
    names = ["emb"] + [f"mats.{i}" for i in range(len(mats))]
    opt = cotangent.MuonAdamW([{"params": [emb], "lr": 0.2}], list(mats))
    storage = [p.data_ptr() for p in params]
    produced = {}  # id(p) -> the gradient autograd accumulated into p.grad in this backward
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: produced.__setitem__(id(q), q.grad))
    gen = torch.Generator(device=device).manual_seed(1)
    parts = {k: [] for k in ("backward", "step", "zero", "update")}
    problems = []
    checks = 0
    for step in range(steps + repeats):
        idx = torch.randint(0, 256, (16,), device=device, generator=gen)
        x = emb[idx]
        for w in mats:
            x = x + torch.tanh(x @ w.T) if w.shape[0] == w.shape[1] else x
        loss = x.square().mean() + _loss(mats, {width: emb[idx], 4 * width: torch.ones(
            16, 4 * width, device=device)})
        produced.clear()
        _sync(device)
        tb = time.perf_counter()
        loss.backward()
        _sync(device)
        grads = [p.grad for p in params]
        grad_copies = [g.clone() for g in grads]
        before = [p.detach().clone() for p in params]
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        t1 = time.perf_counter()
        for name, p, ptr, g, g0, p0 in zip(names, params, storage, grads, grad_copies, before):
            checks += 1
            if p.data_ptr() != ptr:
                problems.append(f"step {step} {name}: parameter moved (data_ptr {ptr:#x} -> "
                                f"{p.data_ptr():#x})")
            if produced.get(id(p)) is not g:
                problems.append(f"step {step} {name}: p.grad after backward is not the "
                                "tensor autograd accumulated")
            if p.grad is not g:
                problems.append(f"step {step} {name}: step() replaced p.grad")
            diff = first_difference(g0, p.grad)
            if diff:
                problems.append(f"step {step} {name}: step() changed p.grad: {diff}")
            if torch.equal(p0, p.detach()):
                problems.append(f"step {step} {name}: step() left the parameter unchanged")
        del grads, grad_copies, before
        _sync(device)
        t2 = time.perf_counter()
        opt.zero_grad()
        _sync(device)
        t3 = time.perf_counter()
        for k, v in (("backward", t0 - tb), ("step", t1 - t0), ("zero", t3 - t2),
                     ("update", (t1 - t0) + (t3 - t2))):
            parts[k].append(v)
    row = {"model": f"{blocks} blocks x width {width}", "compile": False,
           "step_ms": statistics.median(parts["step"][steps:]) * 1e3,
           "in_place": not problems, "checks": checks, "problems": problems[:10],
           "problem_count": len(problems), "first_step_s": parts["step"][0],
           "median_ms": {k: statistics.median(v[steps:]) * 1e3 for k, v in parts.items()}}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if args.small:
        groups = {"3x48^2": [(48, 48)] * 3, "2x(32,96)": [(32, 96)] * 2}
        width, blocks, steps, repeats = 32, 2, 2, 3
    else:
        groups = {"8x384^2": [(384, 384)] * 8, "4x(64,256)": [(64, 256)] * 4,
                  "6x96^2": [(96, 96)] * 6, "12x768^2": [(768, 768)] * 12,
                  "12x(3072,768)": [(3072, 768)] * 12, "12x(768,3072)": [(768, 3072)] * 12}
        width, blocks, steps, repeats = 768, 12, 3, 20
    result = {"torch": torch.__version__, "python": platform.python_version(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else
              platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "muon": muon_rows(groups, device, steps, repeats),
              "muon_adamw": muon_adamw_run(width, blocks, device, steps, repeats)}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    ok = all(r["bitwise"] for r in result["muon"]) and result["muon_adamw"]["in_place"]
    print("Muon all bitwise, MuonAdamW in place" if ok else "DIFFERENCES FOUND", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
