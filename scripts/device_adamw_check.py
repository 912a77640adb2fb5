"""Device check for `cotangent.AdamW` (issue 29): one prepared script for a CUDA machine.

    PYTHONPATH=src python3 scripts/device_adamw_check.py --out $OUT/adamw-cuda.json --budget 460
    PYTHONPATH=src python3 scripts/device_adamw_check.py --dry-run --out /tmp/adamw-cpu.json

Sections, each case written to the JSON document (atomically) as soon as it is done, so that a
run stopped by its deadline keeps what it measured:
  facts    kernel facts on the device: `torch._foreach_norm` against itself over a reversed and a
           split list; batched row norms of a (B, K) view against `_foreach_norm` of its rows,
           per K; the clip multiply of signed zeros and NaNs by `_foreach_mul_` against `mul_`.
  parity   native (`clip_grad_norm_` + `torch.optim.AdamW`) against `cotangent.AdamW` on one
           model from one initial state, byte for byte after every step (loss, total norm,
           clipped gradients, parameters, moments, steps): default / foreach / fused x float32,
           bfloat16 parameters, bfloat16 autocast x clip active / inactive; GradScaler with a
           forced overflow (both recipes); a tensor lr on the CPU and on the device; amsgrad,
           maximize, weight decay 0; a NaN injected; gradient accumulation; a forward on a side
           stream; CUDA graph capture of `step()` (must be refused as native refuses it);
           DistributedDataParallel at world size 1 (NCCL on CUDA, gloo in the dry run).
  syncs    host-device synchronisations in steady steps (`torch.cuda.set_sync_debug_mode`).
  timing   per implementation: update phase (clip + step + zero_grad) and loop (backward +
           update) medians, arms interleaved; kernel launches per update (profiler); host time
           of `step()`; peak memory.
`--dry-run` runs the same plumbing on the CPU with small sizes (CI runs it: tests/test_project.py).
A fresh calibration cache (a temporary directory) is used, so every verdict is probed here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings

os.environ["COTANGENT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cotangent-device-")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cotangent  # noqa: E402
from cotangent.verify import first_difference  # noqa: E402

IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Report:
    """The JSON document, rewritten (atomically) after every case; the global deadline."""

    def __init__(self, path: str | None, budget_s: float, device: torch.device, dry: bool):
        self.path, self.deadline = path, time.monotonic() + budget_s
        self.doc = dict(device=str(device), dry_run=dry, torch=torch.__version__,
                        cotangent=cotangent.__version__, python=platform.python_version(),
                        gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                        budget_s=budget_s, sections={}, ended=None)
        self.write()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def case(self, section: str, name: str, fn, *args, reserve: float = 5.0, **kwargs) -> None:
        rows = self.doc["sections"].setdefault(section, [])
        if self.left() < reserve:
            rows.append(dict(case=name, status="skipped: budget"))
            self.write()
            return
        t0 = time.monotonic()
        try:
            out = fn(*args, **kwargs)
            row = dict(case=name, status="ok" if out.get("passed", True) else "FAILED", **out)
        except Exception as e:  # noqa: BLE001 - every failure is a result to report
            row = dict(case=name, status="error", error=repr(e),
                       trace=traceback.format_exc()[-2000:])
        row["seconds"] = round(time.monotonic() - t0, 3)
        rows.append(row)
        print(f"{section:7} {name:60} {row['status']} ({row['seconds']} s)", flush=True)
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, self.path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ facts

def fact_foreach_norm_order(device, n):
    gen = torch.Generator(device=device).manual_seed(0)
    ts = [torch.randn(k, device=device, generator=gen) for k in (1, 7, 64, 1000, n, 3 * n + 5)]
    whole = torch.stack(torch._foreach_norm(ts, 2.0))
    rev = torch.stack(torch._foreach_norm(ts[::-1], 2.0)).flip(0)
    split = torch.stack(list(torch._foreach_norm(ts[:3], 2.0)) + list(
        torch._foreach_norm(ts[3:], 2.0)))
    single = torch.stack([torch.linalg.vector_norm(t, 2.0) for t in ts])
    same = lambda a, b: first_difference(a, b) is None  # noqa: E731
    return dict(reversed_equal=same(whole, rev), split_equal=same(whole, split),
                vector_norm_equal=same(whole, single),
                passed=same(whole, rev) and same(whole, split))


def fact_row_norms(device, rows):
    gen = torch.Generator(device=device).manual_seed(1)
    out = {}
    for k in (1, 2, 3, 4, 8, 64, 4096):
        m = torch.randn(rows, k, device=device, generator=gen)
        batched = torch.linalg.vector_norm(m, 2.0, dim=1)
        each = torch.stack(torch._foreach_norm(list(m.unbind(0)), 2.0))
        out[str(k)] = first_difference(batched, each) is None
    return dict(equal_per_k=out)  # a fact to record, no pass or fail


def fact_clip_multiply(device):
    vals = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), 1e-40, 3.0],
                        device=device)
    out = {}
    for coef in (0.5, 1.0, 0.0, float("nan")):
        c = torch.tensor(coef, device=device)
        a, b = [vals.clone() for _ in range(3)], [vals.clone() for _ in range(3)]
        torch._foreach_mul_(a, c)
        for t in b:
            t.mul_(c)
        out[str(coef)] = all(first_difference(x, y) is None for x, y in zip(a, b))
    return dict(foreach_equals_mul=out, passed=all(out.values()))


# ------------------------------------------------------------------ parity

class Net(nn.Module):
    """Embedding, LayerNorm, two linears (one bias-free), a head: 7 tensors."""

    def __init__(self, width: int):
        super().__init__()
        self.emb = nn.Embedding(64, width)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width, bias=False)
        self.head = nn.Linear(width, 64)

    def forward(self, x):  # x: (B, T) int64 -> (B, T, 64)
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(h)


def loss_of(model, x, autocast, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, 64), x[:, 1:].reshape(-1))


def parity(device, width, steps, impl, *, dtype=torch.float32, autocast=False, max_norm=1.0,
           scaler=None, nan_at=None, micro=1, side_stream=False, **adamw):
    torch.manual_seed(0)
    m1 = Net(width).to(device=device, dtype=dtype)
    m2 = Net(width).to(device=device, dtype=dtype)
    m2.load_state_dict(m1.state_dict())
    kw = dict(HP, **IMPLS[impl], **adamw)
    kw2 = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}
    native = torch.optim.AdamW(m1.parameters(), **kw)
    ours = cotangent.AdamW(m2.parameters(), max_norm=max_norm, **kw2)
    scalers = None
    if scaler is not None:
        scalers = [torch.amp.GradScaler(device.type, init_scale=2.0 ** 16) for _ in range(2)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    checks, stream = 0, torch.cuda.Stream() if side_stream and device.type == "cuda" else None
    for step in range(steps):
        xs = [torch.randint(0, 64, (2, 17), generator=gen).to(device) for _ in range(micro)]
        totals = []
        for i, (m, o) in enumerate(((m1, native), (m2, ours))):
            o.zero_grad()
            for x in xs:
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        loss = loss_of(m, x, autocast, device) / micro
                    torch.cuda.current_stream().wait_stream(stream)
                else:
                    loss = loss_of(m, x, autocast, device) / micro
                if nan_at == step:
                    loss = loss * float("nan")
                if scalers is not None:
                    scalers[i].scale(loss * (1e30 if step == 1 else 1.0)).backward()  # overflow
                else:
                    loss.backward()
            if scalers is not None:
                s = scalers[i]
                total = None
                if o is native:  # native's recipe: unscale, clip, step
                    s.unscale_(o)
                    total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
                elif scaler == "unscale":  # the same recipe with Cotangent's clip
                    s.unscale_(o)
                    total = o.clip_grad_norm_()
                # "scaler alone": Cotangent unscales and clips inside step() (fused), or the
                # scaler unscales before step() (for-loop, foreach)
                s.step(o)
                s.update()
                totals.append(total)
            else:
                if o is native and max_norm is not None:
                    totals.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
                o.step()
                if o is ours and max_norm is not None:
                    totals.append(o.last_total_norm)
        if max_norm is not None and not (scalers is not None and scaler != "unscale"):
            diff = (None if totals[1] is None and totals[0] is None
                    else first_difference(totals[0], totals[1]) if totals[1] is not None
                    else "cotangent's total norm is None")
            if diff is not None:
                return dict(passed=False, step=step, first=f"total norm: {diff}", checks=checks)
            checks += 1
        for (n1, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
            pairs = [("param", p1, p2), ("grad", p1.grad, p2.grad)]
            pairs += [(k, native.state[p1][k], ours.state[p2][k]) for k in native.state[p1]]
            for what, a, b in pairs:
                diff = (None if a is None and b is None else "one is None" if a is None or
                        b is None else first_difference(a, b))
                if diff is not None:
                    return dict(passed=False, step=step, first=f"{n1} {what}: {diff}",
                                checks=checks)
                checks += 1
    return dict(passed=True, checks=checks, path=ours.update_path())


def graph_capture(device, width):
    """Capturing `step()` of a non-capturable optimizer in a CUDA graph: native refuses it
    (its graph-capture health check); so must Cotangent, with native's message."""
    if device.type != "cuda":
        return dict(skipped="CUDA only")
    messages = []
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        torch.manual_seed(0)
        m = Net(width).to(device)
        o = cls(m.parameters(), **HP)
        loss_of(m, torch.randint(0, 64, (2, 17), device=device), False, device).backward()
        o.step()  # state exists
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                o.step()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e).split("\n")[0])
    return dict(native=messages[0], cotangent=messages[1],
                passed=messages[0] is not None and messages[1] == messages[0])


def ddp_world_one(device, width, steps):
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m1, m2 = Net(width).to(device), Net(width).to(device)
        m2.load_state_dict(m1.state_dict())
        ids = [device.index] if device.type == "cuda" else None
        d1 = nn.parallel.DistributedDataParallel(m1, device_ids=ids)
        d2 = nn.parallel.DistributedDataParallel(m2, device_ids=ids)
        native = torch.optim.AdamW(m1.parameters(), **HP, fused=True)
        ours = cotangent.AdamW(m2.parameters(), **HP, fused=True, max_norm=0.5)
        gen = torch.Generator().manual_seed(2)
        for step in range(steps):
            x = torch.randint(0, 64, (2, 17), generator=gen).to(device)
            for d, o, m in ((d1, native, m1), (d2, ours, m2)):
                o.zero_grad()
                loss_of(d, x, False, device).backward()
                if o is native:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
            for a, b in zip(m1.parameters(), m2.parameters()):
                if first_difference(a, b) is not None:
                    return dict(passed=False, step=step, backend=backend)
        return dict(passed=True, backend=backend)
    finally:
        # every collective done, then the DDP wrappers freed while the group is still
        # registered: a Reducer dropping a gloo group's last reference joins the group's worker
        # threads under the GIL, which a worker freeing a finished work's Python state needs
        # (a hang seen once in a CPU dry run)
        dist.barrier()
        d1 = d2 = None
        gc.collect()
        dist.destroy_process_group()


# ------------------------------------------------------------------ syncs and timing

def syncs(device, width):
    if device.type != "cuda":
        return dict(skipped="CUDA only")
    out = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        m = Net(width).to(device)
        o = cotangent.AdamW(m.parameters(), **HP, **IMPLS[impl], max_norm=1.0)
        x = torch.randint(0, 64, (2, 17), device=device)
        for _ in range(3):  # warm: state, probes, verdicts
            o.zero_grad()
            loss_of(m, x, False, device).backward()
            o.step()
        loss_of(m, x, False, device).backward()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                o.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[impl] = sum("synchroniz" in str(w.message) for w in caught)
    return dict(syncs_per_step=out, passed=all(v == 0 for v in out.values()))


def timing(device, width, repeats, impl):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    m1, m2 = Net(width).to(device), Net(width).to(device)
    m2.load_state_dict(m1.state_dict())
    native = torch.optim.AdamW(m1.parameters(), **HP, **IMPLS[impl])
    ours = cotangent.AdamW(m2.parameters(), **HP, **IMPLS[impl], max_norm=1.0)

    def native_update():
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0)
        native.step()

    arms = {"native": (m1, native, native_update), "cotangent": (m2, ours, ours.step)}
    times = {a: {"update": [], "loop": [], "host_step": []} for a in arms}
    x = torch.randint(0, 64, (8, 65), device=device)
    order = list(arms)
    for i in range(repeats + 3):
        for name in order:
            m, o, update = arms[name]
            sync(device)
            t0 = time.perf_counter()
            loss_of(m, x, False, device).backward()
            sync(device)
            t1 = time.perf_counter()
            update()
            t_host = time.perf_counter()
            sync(device)
            o.zero_grad()
            sync(device)
            t2 = time.perf_counter()
            if i >= 3:
                times[name]["update"].append(t2 - t1)
                times[name]["loop"].append(t2 - t0)
                times[name]["host_step"].append(t_host - t1)
        order.reverse()
    launches = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, (m, o, update) in arms.items():
        loss_of(m, x, False, device).backward()
        with profile(activities=acts) as prof:
            update()
            sync(device)
        kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
                   and str(e.device_type).endswith("CUDA")]
        launches[name] = len(kernels) if device.type == "cuda" else None
        o.zero_grad()
    ms = {a: {k: 1e3 * statistics.median(v) for k, v in t.items()} for a, t in times.items()}
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    return dict(ms=ms, update_ratio=ms["cotangent"]["update"] / ms["native"]["update"],
                loop_ratio=ms["cotangent"]["loop"] / ms["native"]["loop"],
                launches_per_update=launches, peak_bytes=peak, path=ours.update_path())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="the JSON document (rewritten after each case)")
    ap.add_argument("--budget", type=float, default=460.0, help="global deadline, seconds")
    ap.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU, small")
    args = ap.parse_args(argv)
    if args.dry_run:
        device, width, steps, repeats, n = torch.device("cpu"), 8, 3, 2, 5000
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
            return 2
        device, width, steps, repeats, n = torch.device("cuda"), 256, 6, 20, 1 << 20
    rep = Report(args.out, args.budget, device, args.dry_run)
    rep.case("facts", "_foreach_norm: list order and splitting", fact_foreach_norm_order,
             device, n)
    rep.case("facts", "row norms of a (B, K) view vs _foreach_norm, per K", fact_row_norms,
             device, 64)
    rep.case("facts", "clip multiply: _foreach_mul_ vs mul_ on signed zeros and NaNs",
             fact_clip_multiply, device)
    for impl in IMPLS:
        for label, extra in (("fp32", {}), ("bf16 params", dict(dtype=torch.bfloat16)),
                             ("bf16 autocast", dict(autocast=True))):
            for clip, max_norm in (("clip active", 0.01), ("clip inactive", 1e6)):
                rep.case("parity", f"{impl} {label} {clip}", parity, device, width, steps, impl,
                         **dict(extra, max_norm=max_norm))
    for impl in ("default", "fused"):
        for recipe in ("unscale", "scaler alone"):
            rep.case("parity", f"{impl} GradScaler ({recipe}), overflow at step 1", parity,
                     device, width, steps, impl, scaler=recipe)
    rep.case("parity", "for-loop, tensor lr on the CPU", parity, device, width, steps,
             "default", lr=torch.tensor(1e-3))
    rep.case("parity", "fused, tensor lr on the device", parity, device, width, steps, "fused",
             lr=torch.tensor(1e-3, device=device))
    for impl in IMPLS:
        rep.case("parity", f"{impl} amsgrad, maximize, weight decay 0", parity, device, width,
                 steps, impl, amsgrad=True, maximize=True, weight_decay=0.0)
        rep.case("parity", f"{impl} NaN injected at step 1", parity, device, width, steps, impl,
                 nan_at=1)
        rep.case("parity", f"{impl} 3 micro-batches accumulated", parity, device, width, steps,
                 impl, micro=3)
    rep.case("parity", "forward on a side stream", parity, device, width, steps, "default",
             side_stream=True)
    rep.case("parity", "CUDA graph capture of step() is refused like native's", graph_capture,
             device, width)
    rep.case("parity", "DistributedDataParallel, world size 1", ddp_world_one, device, width,
             steps)
    rep.case("syncs", "host syncs in a steady step", syncs, device, width)
    for impl in IMPLS:
        rep.case("timing", impl, timing, device, width, repeats, impl, reserve=30.0)
    rows = [r for rows in rep.doc["sections"].values() for r in rows]
    failed = [r["case"] for r in rows if r["status"] in ("FAILED", "error")]
    rep.doc["ended"] = dict(cases=len(rows), failed=failed,
                            skipped=[r["case"] for r in rows if r["status"].startswith("skip")])
    rep.write()
    print(f"{len(rows)} cases, {len(failed)} failed or errors", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
