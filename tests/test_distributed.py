"""`cotangent.AdamW` under DistributedDataParallel (2 gloo ranks on 127.0.0.1, 1 thread each),
bitwise equal on every rank to the native loop with the same DDP arguments:
`DDP(model)` -> backward -> `clip_grad_norm_(model.parameters(), max_norm)` -> AdamW step.

Each configuration crosses: fused / for-loop AdamW, `gradient_as_bucket_view` off / on,
`find_unused_parameters` with a globally unused parameter and one used on rank 0 only (or a
model without them), `no_sync()` accumulation, and the optimizer built before / after wrapping.
Workers report through a queue read with a timeout, so a crashed rank fails the test instead of
hanging it. CPU, torch 2.13.0.
"""

from __future__ import annotations

import copy
import itertools
import os
import queue
import socket
import traceback

import pytest
import torch
import torch.nn as nn

CONFIGS = [dict(impl=impl, bucket_view=bv, unused=unused, no_sync=ns, opt_before=ob)
           for impl, bv, unused, ns, ob in itertools.product(
               ("fused", "for-loop"), (False, True), (False, True), (False, True), (False, True))
           if ob == (bv == ns)]  # half of the before/after crossings keep the run short


class Net(nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        if extra:
            self.unused = nn.Linear(4, 4)  # used by no rank
            self.rank0 = nn.Linear(8, 8)  # used by rank 0 only

    def forward(self, x, use_rank0: bool):
        h = self.b(torch.tanh(self.a(x)))
        return h + self.rank0(x) if use_rank0 else h


def _run_config(rank: int, cfg: dict) -> list[str]:
    """Train native and Cotangent side by side on this rank; return the differences."""
    import cotangent
    from torch.nn.parallel import DistributedDataParallel as DDP
    from cotangent.verify import first_difference

    flags = {"fused": dict(fused=True), "for-loop": dict(foreach=False)}[cfg["impl"]]
    torch.manual_seed(0)
    base = Net(cfg["unused"])
    sides = []
    for kind in ("native", "cotangent"):
        model = copy.deepcopy(base)
        opt = None
        if kind == "cotangent" and cfg["opt_before"]:
            opt = cotangent.AdamW(model.parameters(), lr=1e-2, max_norm=0.05, **flags)
        ddp = DDP(model, gradient_as_bucket_view=cfg["bucket_view"],
                  find_unused_parameters=cfg["unused"])
        if opt is None:
            opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, **flags) if kind == "native"
                   else cotangent.AdamW(model.parameters(), lr=1e-2, max_norm=0.05, **flags))
        gen = torch.Generator().manual_seed(rank)
        norms = []
        for step in range(4):
            opt.zero_grad()
            micro = 2 if cfg["no_sync"] else 1
            for k in range(micro):
                x = torch.randn(4, 8, generator=gen)
                last = k == micro - 1
                with (ddp.no_sync() if not last else torch.enable_grad()):
                    ddp(x, cfg["unused"] and rank == 0).square().mean().backward()
            if kind == "native":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
            if kind == "cotangent":
                norms.append(opt.last_total_norm)
        sides.append((model, opt, norms))
    (m1, o1, n1), (m2, o2, n2) = sides
    problems = []
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        for what, a, b in ((f"{name}", p.detach(), q.detach()), (f"grad of {name}", p.grad,
                                                                  q.grad)):
            if (d := first_difference(a, b)) is not None:
                problems.append(f"{what}: {d}")
        s1, s2 = o1.state.get(p, {}), o2.state.get(q, {})
        if set(s1) != set(s2):
            problems.append(f"state keys of {name}: {sorted(s1)} vs {sorted(s2)}")
        for key in set(s1) & set(s2):
            if (d := first_difference(s1[key], s2[key])) is not None:
                problems.append(f"{key} of {name}: {d}")
    for i, (a, b) in enumerate(zip(n1, n2)):
        if (d := first_difference(a, b)) is not None:
            problems.append(f"total norm {i}: {d}")
    return [f"{cfg}: {p}" for p in problems]


def _worker(rank: int, world: int, port: int, results) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        problems = []
        for cfg in CONFIGS:
            problems += _run_config(rank, cfg)
        dist.destroy_process_group()
        results.put((rank, problems))
    except Exception:  # reported, never swallowed: the test fails with the traceback
        results.put((rank, [traceback.format_exc()]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_loops_are_bitwise_equal_to_native_on_every_rank():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    world, port = 2, _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, results)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        reports = []
        for _ in procs:
            try:
                reports.append(results.get(timeout=240))
            except queue.Empty:
                pytest.fail("a rank reported nothing within 240 s (crashed or hung)")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(CONFIGS) == 16
    problems = [f"rank {rank}: {p}" for rank, ps in reports for p in ps]
    assert not problems, "\n".join(problems[:5])
