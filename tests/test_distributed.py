"""`cotangent.AdamW` under DistributedDataParallel (2 gloo ranks on 127.0.0.1, 1 thread each),
bitwise equal on every rank to the native loop with the same DDP arguments:
`DDP(model)` -> backward -> `clip_grad_norm_(model.parameters(), max_norm)` -> AdamW step.

Each configuration crosses: fused / for-loop AdamW, `gradient_as_bucket_view` off / on,
`find_unused_parameters` with a globally unused parameter and one used on rank 0 only (or a
model without them), `no_sync()` accumulation, and the optimizer built before / after wrapping.
Workers report through a queue read with a timeout, so a crashed rank fails the test instead of
hanging it. CPU, torch 2.13.0.

ZeRO-1 (against native AdamW and torch's ZeroRedundancyOptimizer) and FSDP2 (`fully_shard`,
HSDP meshes, DCP checkpoints) are compared the same way. Every native-vs-Cotangent run on a rank
goes through the one model-level driver (`cases.drive`, or `cases.lockstep_params` for lists of
parameters): each training loop is a pattern, both sides compared after every step (a ZeRO-1
side's state for its share, DTensors by their local shards); a rank reports its first
difference per configuration as a finding instead of raising.
"""

from __future__ import annotations

import copy
import itertools
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

CONFIGS = [dict(impl=impl, bucket_view=bv, unused=unused, no_sync=ns, opt_before=ob)
           for impl, bv, unused, ns, ob in itertools.product(
               ("fused", "for-loop"), (False, True), (False, True), (False, True), (False, True))
           if ob == (bv == ns)]  # half of the before/after crossings keep the run short
# `.grad` reset to None behind the optimizer's back (`model.zero_grad()`): DDP then hands the
# next backward's gradients over in tensors of its own
CONFIGS += [dict(impl=impl, bucket_view=bv, unused=True, no_sync=False, opt_before=False,
                 module_zero_grad=True) for impl in ("fused", "for-loop") for bv in (False, True)]


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


def _driven(label: str, pattern, native, ours) -> list[str]:
    """`cases.drive` on this rank, its first difference returned as a finding (the rank goes on
    to its next check) rather than raised."""
    from cases import drive

    try:
        drive(pattern, native, ours, label)
    except AssertionError as e:
        return [str(e)]
    return []


def _run_config(rank: int, cfg: dict) -> list[str]:
    """Train native and Cotangent side by side on this rank (`cases.drive`: every parameter,
    gradient, state entry and total norm compared after every step); return the
    differences."""
    import cotangent
    from cases import Side
    from torch.nn.parallel import DistributedDataParallel as DDP

    flags = {"fused": dict(fused=True), "for-loop": dict(foreach=False)}[cfg["impl"]]
    torch.manual_seed(0)
    base = Net(cfg["unused"])
    sides, wrapped = [], {}
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
        sides.append(Side(model, kind == "native", opts=(opt,)))
        wrapped[model] = ddp

    def loop(side):
        model, opt, ddp = side.model, side.opts[0], wrapped[side.model]
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):
            if cfg.get("module_zero_grad"):
                model.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            micro = 2 if cfg["no_sync"] else 1
            for k in range(micro):
                x = torch.randn(4, 8, generator=gen)
                last = k == micro - 1
                with (ddp.no_sync() if not last else torch.enable_grad()):
                    ddp(x, cfg["unused"] and rank == 0).square().mean().backward()
            side.step(opt, max_norm=0.05)
            yield step

    return _driven(str(cfg), loop, *sides)


def _worker(rank: int, world: int, port: int, checks: str, results) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))  # a stuck collective raises
        problems = CHECKS[checks](rank, world)
        dist.destroy_process_group()
        results.put((rank, problems))
    except Exception:  # reported, never swallowed: the test fails with the traceback
        results.put((rank, [traceback.format_exc()]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(checks: str, world: int = 2, timeout_s: float = 240) -> list[tuple[int, list]]:
    """Run `CHECKS[checks]` on `world` gloo ranks; returns each rank's (rank, findings)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, checks, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        reports = []
        deadline = time.monotonic() + timeout_s
        while len(reports) < world:
            try:
                reports.append(results.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            # a rank that died without reporting (segfault, os._exit, killed) fails the test
            # now, instead of leaving the others in a collective until the deadline
            dead = [(i, p.exitcode) for i, p in enumerate(procs)
                    if p.exitcode is not None and i not in {r for r, _ in reports}]
            if dead:
                pytest.fail(f"rank(s) {dead} (rank, exit code) ended without a report")
            if time.monotonic() > deadline:
                pytest.fail(f"a rank reported nothing within {timeout_s} s (hung)")
    finally:
        for p in procs:
            p.join(timeout=3)
            if p.is_alive():  # e.g. left in a collective by a crashed peer
                p.kill()
    return sorted(reports, key=lambda r: r[0])


def _ddp_checks(rank: int, world: int) -> list[str]:
    problems = []
    for cfg in CONFIGS:
        problems += _run_config(rank, cfg)
    return problems


ZERO_CONFIGS = [
    dict(impl="fused", norms="all", unused=False, amsgrad=False),
    dict(impl="fused", norms="share", unused=True, amsgrad=False),
    dict(impl="for-loop", norms="share", unused=False, amsgrad=True),
    dict(impl="foreach", norms="all", unused=True, amsgrad=False),
]
FLAGS = {"fused": dict(fused=True), "for-loop": dict(foreach=False),
         "foreach": dict(foreach=True)}


class _WithExtra(nn.Module):
    """A model and a parameter outside it (added to the optimizer later), compared together."""

    def __init__(self, model: nn.Module, extra: nn.Parameter) -> None:
        super().__init__()
        self.model, self.extra = model, extra


def _zero_loop(rank: int, unused: bool, inputs: list, wrapped: dict):
    """The pattern (`cases.drive`) of DDP training under ZeRO: per input, zero_grad, the DDP
    backward (`wrapped`: model -> its DDP), a parameter outside the model (`_WithExtra`) given
    the same gradient on every rank, native's clip_grad_norm_ of every parameter or the
    optimizer's own clip, the step; a point after every step."""
    def loop(side):
        holder = side.model
        model = holder.model if isinstance(holder, _WithExtra) else holder
        opt = side.opts[0]
        for i, x in enumerate(inputs):
            opt.zero_grad()
            wrapped[model](x, unused and rank == 0).square().mean().backward()
            if isinstance(holder, _WithExtra):
                extra = holder.extra
                extra.grad = torch.linspace(-1.0, 1.0, extra.numel()).reshape(extra.shape) * (i + 1)
            # (native clips the model's parameters, then the added one: param-group order)
            side.step(opt, list(model.parameters()) + (
                [holder.extra] if isinstance(holder, _WithExtra) else []), 0.05)
            yield i
    return loop


def _state_dict_differences(a: dict, b: dict) -> list[str]:
    """Two native-format optimizer state dicts: same groups and every state tensor's bytes."""
    from cotangent.verify import first_difference

    problems = [] if a["param_groups"] == b["param_groups"] else ["param_groups differ"]
    if set(a["state"]) != set(b["state"]):
        return problems + [f"state keys {sorted(a['state'])} vs {sorted(b['state'])}"]
    for i in a["state"]:
        if set(a["state"][i]) != set(b["state"][i]):
            problems.append(f"state[{i}] keys differ")
            continue
        for key, value in a["state"][i].items():
            if (d := first_difference(value, b["state"][i][key])) is not None:
                problems.append(f"state[{i}][{key!r}]: {d}")
    return problems


def _zero_config(rank: int, world: int, cfg: dict) -> list[str]:
    import cotangent
    from cotangent.verify import first_difference
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=cfg["amsgrad"], **FLAGS[cfg["impl"]])
    torch.manual_seed(0)
    base = Net(cfg["unused"])
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 8, generator=gen) for _ in range(6)]
    label = f"ZeRO-1 {cfg}"
    wrapped: dict = {}  # model -> its DDP

    def arm(kind: str, model=None):
        """A `cases.Side`: native AdamW, torch's ZeroRedundancyOptimizer, or Cotangent's."""
        from cases import Side

        model = model if model is not None else copy.deepcopy(base)
        wrapped[model] = DDP(model, find_unused_parameters=cfg["unused"])
        if kind == "native":
            opt = torch.optim.AdamW(model.parameters(), **kw)
        elif kind == "native-zero":  # (its param groups keep only the arguments it was
            # given: not compared)
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
            return Side(model, True, opts=(zero,), share=True, groups=False)
        else:
            # clip order stated: a second param group joins later (native clips the groups)
            opt = cotangent.AdamW(model.parameters(), max_norm=0.05, shard="zero1",
                                  shard_norms=cfg["norms"], clip_order="param_groups", **kw)
        return Side(model, kind == "native", opts=(opt,), share=kind != "native")

    def loop(part):
        return _zero_loop(rank, cfg["unused"], part, wrapped)

    # torch's ZeRO against native AdamW (the shares' state), then Cotangent's
    native, zero = arm("native"), arm("native-zero")
    problems = _driven(f"{label} native ZeRO vs native", loop(inputs[:4]), native, zero)
    native, ours = arm("native"), arm("cotangent")
    problems += _driven(f"{label} cotangent vs native", loop(inputs[:4]), native, ours)
    m1, o1, m3, o3 = native.model, native.opts[0], ours.model, ours.opts[0]

    # shard_norms="share": the total norm from the gathered per-tensor norms is the one from
    # every norm computed here
    if cfg["norms"] == "share":
        from cotangent import sharding
        from cotangent.clip import tensor_norms

        torch.manual_seed(rank)  # gradients that differ per rank would show in the result
        grads = [torch.randn(q.shape) for q in m3.parameters()]
        for g in grads:
            torch.distributed.broadcast(g, 0)
        shares = [o3.share_of(q) for q in m3.parameters()]
        got = sharding.share_total_norm(grads, shares, o3._shares.zero, 2.0,
                                        lambda part: tensor_norms(part, 2.0))
        want = torch.nn.utils.get_total_norm(grads, 2.0)
        if (d := first_difference(want, got)) is not None:
            problems.append(f"{label}: total norm from gathered per-tensor norms: {d}")
        if len(set(shares)) != world:
            problems.append(f"{label}: shares {shares} leave a rank without parameters")

    # the share: state for the owned parameters only, buffers covering exactly their windows
    owned = [q for q in m3.parameters() if o3.state.get(q)]
    sizes = [torch.tensor([o3.state_bytes()])]
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    torch.distributed.all_gather(gathered, sizes[0])
    native_bytes = sum(v.numel() * v.element_size() for st in o1.state.values()
                       for v in st.values())
    if sum(int(g) for g in gathered) < native_bytes or len(owned) == len(list(m3.parameters())):
        problems.append(f"{label}: state bytes per rank {[int(g) for g in gathered]} against "
                        f"{native_bytes} native, {len(owned)} parameters held on rank {rank}")

    # consolidation: the unsharded native format, on every rank (to=None) and on rank 0; a
    # stale entry assigned on a rank that does not own the parameter is not gathered
    strays = [q for q in m3.parameters() if o3.share_of(q) != rank]
    for q in strays:
        o3.state[q] = {"step": torch.tensor(99.0), "exp_avg": torch.ones_like(q),
                       "exp_avg_sq": torch.ones_like(q)}
    o3.consolidate_state_dict(to=None)
    if any(q in o3.state for q in strays):
        problems.append(f"{label}: a stray entry stayed in state through consolidation")
    problems += [f"{label} consolidated (all): {p}"
                 for p in _state_dict_differences(o1.state_dict(), o3.state_dict())]
    o3.consolidate_state_dict(to=0)
    if rank == 0:
        problems += [f"{label} consolidated (to=0): {p}"
                     for p in _state_dict_differences(o1.state_dict(), o3.state_dict())]
    else:
        try:
            o3.state_dict()
            problems.append(f"{label}: state_dict() on rank {rank} without consolidation")
        except RuntimeError as exc:
            if "consolidate_state_dict" not in str(exc):
                problems.append(f"{label}: unclear error {exc}")

    # resume: the native state dict into a fresh sharded optimizer, two more steps each
    saved = copy.deepcopy(o1.state_dict())  # (a loaded tensor of equal dtype is shared)
    resumed = arm("cotangent", copy.deepcopy(m1))
    resumed.opts[0].load_state_dict(saved)
    native.norms.clear()
    problems += _driven(f"{label} resumed from native", loop(inputs[4:]), native, resumed)

    m4, o4 = resumed.model, resumed.opts[0]
    # negative control: the comparison sees one ULP in a moment, then in a parameter
    from cases import compare

    q = next(q for q in m4.parameters() if o4.state.get(q))
    moment = o4.state[q]["exp_avg"]
    kept = (q.detach().clone(), moment.clone())
    for what, nudged in (("exp_avg of", moment.view(-1)), ("parameter", q.detach().view(-1))):
        with torch.no_grad():
            nudged[0] = torch.nextafter(nudged[0], torch.tensor(float("inf")))
        try:
            compare(native, resumed, "control")
            problems.append(f"{label}: a 1-ULP change of a {what!r} went unseen")
        except AssertionError as e:
            if what not in str(e) or "1 ULP" not in str(e):
                problems.append(f"{label}: a 1-ULP change of a {what!r} seen as {e}")
    with torch.no_grad():  # undone: the run goes on
        q.copy_(kept[0])
        moment.copy_(kept[1])

    # a param group added on every rank: ownership moves, the state moves with it (the added
    # parameter compared with the model's: `_WithExtra`)
    owned_before = {id(q) for q in o4.state}
    extras = [torch.nn.Parameter(torch.linspace(0.0, 1.0, 400)) for _ in range(2)]
    o1.add_param_group({"params": [extras[0]]})
    o4.add_param_group({"params": [extras[1]]})
    if {id(q) for q in o4.state} == owned_before:
        problems.append(f"{label}: adding a 400-element parameter moved no state")
    native.model, resumed.model = _WithExtra(m1, extras[0]), _WithExtra(m4, extras[1])
    native.norms.clear()
    resumed.norms.clear()
    problems += _driven(f"{label} after add_param_group", loop(inputs[:2]), native, resumed)
    return problems


def _zero_error_checks(rank: int, world: int) -> list[str]:
    """A norm that fails on one share only (the inf-norm of an empty gradient, which native
    refuses) raises on every rank instead of leaving the others in the gather; entries
    assigned for another rank's parameters leave `state` at the next zero_grad()/step()."""
    import cotangent

    problems = []
    params = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(8)),
              torch.nn.Parameter(torch.ones(64))]
    for norms in ("all", "share"):
        opt = cotangent.AdamW(params, max_norm=1.0, norm_type=float("inf"), shard="zero1",
                              shard_norms=norms)
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        try:
            opt.step()
            problems.append(f"inf-norm of an empty gradient, shard_norms={norms}: no error")
        except RuntimeError as exc:
            owner = params[0] in opt.state or rank == 0
            if owner and "infinity norm" not in str(exc) or (
                    not owner and "rank(s) [0]" not in str(exc) and "infinity" not in str(exc)):
                problems.append(f"shard_norms={norms}: unclear error {exc}")
    opt = cotangent.AdamW(params[1:], lr=0.1, max_norm=1.0, shard="zero1")
    for p in params[1:]:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    foreign = [p for p in params[1:] if opt.share_of(p) != rank]
    for p in foreign:
        opt.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.ones_like(p),
                        "exp_avg_sq": torch.ones_like(p)}
    opt.zero_grad()
    if any(p in opt.state for p in foreign):
        problems.append("state assigned for another rank's parameter stayed in opt.state")
    if world > 1 and not foreign:
        problems.append(f"rank {rank} owns every parameter: the check above checked nothing")
    return problems


def _zero_in_place_checks(rank: int, world: int) -> list[str]:
    """ZeRO-1 reads everything where it is (issue 26): parameters keep their storage, after a
    backward ``p.grad`` is autograd's tensor and the clip multiplies it in place, after
    `zero_grad()` every ``.grad`` is None; a gradient tensor the user assigned once and refills
    in place is read afresh every step; a bad state entry on one rank's share raises on every
    rank (nothing modified) instead of leaving the other rank in the broadcast; parameters that
    share memory are refused before anything is modified."""
    import cotangent
    from cases import lockstep_params, Side
    from cotangent.verify import first_difference
    from torch.nn.parallel import DistributedDataParallel as DDP

    problems = []
    torch.manual_seed(0)
    base = Net(False)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 8, generator=gen) for _ in range(3)]
    models = [copy.deepcopy(base) for _ in range(2)]
    native = torch.optim.AdamW(models[0].parameters(), lr=1e-2, fused=True)
    ours = cotangent.AdamW(models[1].parameters(), lr=1e-2, fused=True, max_norm=0.05,
                           shard="zero1")
    wrapped = {m: DDP(m) for m in models}
    ptrs = [q.data_ptr() for q in models[1].parameters()]

    def in_place(side):  # (a pattern for `cases.drive`)
        model, opt = side.model, side.opts[0]
        for i, x in enumerate(inputs):
            opt.zero_grad()
            if any(q.grad is not None for q in model.parameters()):
                problems.append("a .grad survived zero_grad()")
            wrapped[model](x, False).square().mean().backward()
            grads = [q.grad for q in model.parameters()]
            side.step(opt, max_norm=0.05)
            if not side.native:
                if any(g is not q.grad for g, q in zip(grads, model.parameters())):
                    problems.append("step() replaced a .grad (autograd's tensor must stay)")
            yield i

    problems += _driven("in place", in_place, Side(models[0], True, opts=(native,)),
                        Side(models[1], False, opts=(ours,), share=True))
    if [q.data_ptr() for q in models[1].parameters()] != ptrs:
        problems.append("a parameter moved")

    # a gradient assigned once and refilled in place (zero_grad(set_to_none=False) + copy_)
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, n)) for n in (64, 96, 32)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    o_native = torch.optim.AdamW(ps, lr=0.1, foreach=False)
    o_ours = cotangent.AdamW(qs, lr=0.1, foreach=False, max_norm=0.5, shard="zero1")
    held = [torch.zeros_like(q) for q in qs]
    for q, g in zip(qs, held):
        q.grad = g

    def refilled(side):  # (native: assigned, then refilled; Cotangent: `held`, refilled)
        params, opt = list(side.model.parameters()), side.opts[0]
        for i in range(3):
            opt.zero_grad(set_to_none=False)
            for p, g in zip(params, held):
                fill = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1))
                if side.native:
                    p.grad = fill.clone() if p.grad is None else p.grad.copy_(fill)
                else:
                    g.copy_(fill)
            side.step(opt, params, 0.5)
            yield i

    problems += _driven("refilled gradients", refilled,
                        Side(nn.ParameterList(ps), True, opts=(o_native,)),
                        Side(nn.ParameterList(qs), False, opts=(o_ours,), share=True))

    # what the broadcast sends: a parameter sent as it is (>= 1 MiB), one not contiguous, an
    # empty one, two dtypes (buckets split by owner and dtype), small ones bucketed
    def odd_params():
        gen = torch.Generator().manual_seed(7)
        big = torch.randn(300_000, generator=gen)
        wide = torch.randn(40, 24, generator=gen).t()  # (24, 40), strides (1, 24)
        return [torch.nn.Parameter(t) for t in (
            torch.randn(5, generator=gen), big, wide, torch.zeros(0),
            torch.randn(33, generator=gen, dtype=torch.float64), torch.randn(7, 3, generator=gen),
            torch.randn(1000, generator=gen))]
    ps, qs = odd_params(), odd_params()
    o_native = torch.optim.AdamW(ps, lr=0.1, foreach=False)
    o_ours = cotangent.AdamW(qs, lr=0.1, foreach=False, max_norm=1.0, clip_order=qs,
                             shard="zero1")
    if sorted(set(o_ours.share_of(q) for q in qs)) != list(range(world)):
        problems.append("the odd parameters were not spread over every rank")

    def cosines(i):
        return [torch.cos(torch.arange(p.numel(), dtype=p.dtype) * (i + 1)).reshape(p.shape)
                for p in ps]

    try:
        lockstep_params(ps, o_native, qs, o_ours, 2, "odd parameters", grads=cosines,
                        max_norm=1.0, share=True)
    except AssertionError as e:
        problems.append(str(e))
    # one rank's own state is bad: both ranks raise, nothing is modified
    mine = next(q for q in qs if o_ours.share_of(q) == rank and q.numel())
    if rank == 0:
        o_ours.state[mine]["exp_avg"] = torch.zeros(3)
    before = [q.detach().clone() for q in qs]
    try:
        o_ours.step()
        problems.append("a bad state entry on rank 0's share: no error")
    except RuntimeError as exc:
        if rank == 0 and "exp_avg" not in str(exc) or rank != 0 and "rank(s) [0]" not in str(exc):
            problems.append(f"bad state on rank 0: unclear error on rank {rank}: {exc}")
    if any(first_difference(a, b.detach()) is not None for a, b in zip(before, qs)):
        problems.append("a parameter changed although the step raised")

    # parameters sharing memory: refused at construction and at add_param_group
    flat = torch.zeros(100)
    views = [torch.nn.Parameter(flat[:60]), torch.nn.Parameter(flat[50:])]
    try:
        cotangent.AdamW(views, shard="zero1")
        problems.append("parameters sharing memory: no error")
    except ValueError as exc:
        if "share no memory" not in str(exc):
            problems.append(f"parameters sharing memory: unclear error {exc}")
    opt = cotangent.AdamW([views[0]], shard="zero1")
    try:
        opt.add_param_group({"params": [views[1]]})
        problems.append("add_param_group with shared memory: no error")
    except ValueError:
        if len(opt.param_groups) != 1:
            problems.append("the refused param group was kept")
    return problems


def _native_vs_zero(rank: int, make, norms: str, steps: int = 2, **kw) -> list[str]:
    """`make()` parameters (with gradients set per step by `grads(step)`) stepped by
    clip_grad_norm_ + torch.optim.AdamW and by ZeRO-1 (`cases.lockstep_params`)."""
    import cotangent
    from cases import lockstep_params

    (ps, grads), (qs, _) = make(), make()
    native = torch.optim.AdamW(ps, lr=0.1, **kw)
    ours = cotangent.AdamW(qs, lr=0.1, max_norm=0.5, shard="zero1", shard_norms=norms, **kw)
    try:
        lockstep_params(ps, native, qs, ours, steps, "ZeRO-1", grads=grads, max_norm=0.5,
                        share=True)
    except AssertionError as e:
        return [str(e)]
    return []


def _same_on_every_rank(tensors: list) -> bool:
    """Whether every rank holds these tensors' bytes (an all-gather of their hashes)."""
    import hashlib

    digest = hashlib.sha256(b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                     for t in tensors)).hexdigest()
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, digest)
    return len(set(every)) == 1


def _zero_review_checks(rank: int, world: int) -> list[str]:
    """The break-it review's findings against the first in-place ZeRO-1 (each a kind):
    gathered norms of mixed widths and of complex gradients; an error native raises inside the
    update, on one rank's share; state of a parameter removed, stepped without, and added back
    under another owner; a clip multiply that raises on another rank's gradient; a parameter
    that overlaps itself."""
    import cotangent
    from cotangent.verify import first_difference

    problems = []

    def mixed():  # a 2-byte norm between 4-byte ones, a complex gradient (its norm is real)
        gen = torch.Generator().manual_seed(1)
        shapes = [(100, torch.float32), (3, torch.bfloat16), (100, torch.float32),
                  (10, torch.complex64), (40, torch.float64), (7, torch.float16)]
        made = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dt)) for n, dt in shapes]

        def grads(step):
            g = torch.Generator().manual_seed(10 + step)
            return [torch.randn(p.shape, generator=g).to(p.dtype) for p in made]
        return made, grads

    for norms in ("share", "all"):
        problems += [f"mixed widths, shard_norms={norms}: {p}"
                     for p in _native_vs_zero(rank, mixed, norms, foreach=False)]

    # an error native raises inside the update (a step count of -1: a zero bias correction's
    # ZeroDivisionError) on rank 0's share only: every rank raises, the ranks still agree
    ps = [torch.nn.Parameter(torch.ones(100)) for _ in range(2)]
    opt = cotangent.AdamW(ps, max_norm=0.5, shard="zero1", foreach=False)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    mine = next(p for p in ps if opt.share_of(p) == rank)
    if rank == 0:
        opt.state[mine]["step"] = torch.tensor(-1.0)
    try:
        opt.step()
        problems.append("a step count of -1 on rank 0: no error")
    except (ZeroDivisionError, RuntimeError) as exc:
        if rank != 0 and "rank(s) [0]" not in str(exc):
            problems.append(f"a step count of -1 on rank 0: unclear error on rank {rank}: {exc}")
    if not _same_on_every_rank(ps):
        problems.append("after an error inside the update the ranks' parameters differ")

    # removed, stepped without, added back under another owner: the state follows
    def run(opt, params):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.param_groups[0]["params"].pop(0)
        opt.step()
        opt.add_param_group({"params": [params[0]]})
        opt.step()
    a = [torch.nn.Parameter(torch.ones(40)) for _ in range(4)]
    b = [torch.nn.Parameter(torch.ones(40)) for _ in range(4)]
    native = torch.optim.AdamW(a, foreach=False)
    ours = cotangent.AdamW(b, foreach=False, max_norm=1e9, clip_order="param_groups",
                           shard="zero1")
    first = ours.share_of(b[0])
    run(native, a)
    run(ours, b)
    if ours.share_of(b[0]) == first:
        problems.append("the parameter added back kept its owner: the case checked nothing")
    if ours.share_of(b[0]) == rank:
        got = ours.state[b[0]]["step"]
        if float(got) != float(native.state[a[0]]["step"]):
            problems.append(f"state of a parameter added back: step {float(got)}, native "
                            f"{float(native.state[a[0]]['step'])}")
    if any(first_difference(x.detach(), y.detach()) is not None for x, y in zip(a, b)):
        problems.append("parameters differ after a parameter was removed and added back")

    # native's clip multiply raises on an expanded gradient before any update: so on every rank
    ps = [torch.nn.Parameter(torch.ones(100)) for _ in range(2)]
    opt = cotangent.AdamW(ps, max_norm=0.5, shard="zero1", foreach=False)
    ps[0].grad = torch.full((100,), 2.0)
    ps[1].grad = torch.full((1,), 3.0).expand(100)
    before = [p.detach().clone() for p in ps]
    try:
        opt.step()
        problems.append("an expanded gradient: no error")
    except RuntimeError:
        pass
    if any(first_difference(x, y.detach()) is not None for x, y in zip(before, ps)):
        problems.append("an expanded gradient: a parameter changed before the error")

    try:
        cotangent.AdamW([torch.nn.Parameter(torch.zeros(1).expand(100))], shard="zero1")
        problems.append("a parameter overlapping itself: no error")
    except ValueError as exc:
        if "overlaps itself" not in str(exc):
            problems.append(f"a parameter overlapping itself: unclear error {exc}")
    return problems


def _zero_checks(rank: int, world: int) -> list[str]:
    problems = (_zero_error_checks(rank, world) + _zero_in_place_checks(rank, world)
                + _zero_review_checks(rank, world))
    for cfg in ZERO_CONFIGS:
        problems += _zero_config(rank, world, cfg)
    return problems


def _crash_checks(rank: int, world: int) -> list[str]:
    """Rank 1 dies without a word; rank 0 waits for it in a collective."""
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()
    return []


# ---------------------------------------------------------------- FSDP2 (fully_shard)

FSDP2_CONFIGS = [
    dict(impl="fused"), dict(impl="foreach"), dict(impl="for-loop"), dict(impl="default"),
    dict(impl="fused", reshard=False, nested=False),
    dict(impl="foreach", accumulate=True, frozen=True),
    dict(impl="for-loop", amsgrad=True, maximize=True, max_norm=None),
    dict(impl="fused", amsgrad=True, max_norm=1e4),  # the clip inactive
    dict(impl="fused", bf16=True),  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    dict(impl="foreach", hsdp=True),  # a (replicate, shard) mesh: (Replicate(), Shard(0))
    # a (2, 1) mesh: every rank a replica (gradients all-reduced over the replicate dimension)
    dict(impl="fused", hsdp="replicate"),
    dict(impl="for-loop", hsdp="replicate", accumulate=True),
    dict(impl="fused", explicit_clip=True),  # opt.clip_grad_norm_() apart, then step()
    dict(impl="for-loop", norm_type=float("inf")),
]


class Blocks(nn.Module):
    """Uneven shards on 2 ranks: 7 and 5 rows (4 + 3, 3 + 2), a LayerNorm of 5."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 8))
                                     for _ in range(3)])
        self.head = nn.Linear(8, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.norm(self.head(x))


def _fsdp2_model(cfg: dict, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Blocks()
    if cfg.get("frozen"):
        model.blocks[1].requires_grad_(False)
    kw = dict(reshard_after_forward=cfg.get("reshard", True))
    if cfg.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if cfg.get("hsdp"):
        shape = {"replicate": (world, 1), "2x2": (2, world // 2)}.get(cfg["hsdp"], (1, world))
        kw["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    if cfg.get("nested", True):
        for block in model.blocks:
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp2_optimizer(model: nn.Module, cfg: dict, kind: str):
    import cotangent

    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True),
             "for-loop": dict(foreach=False), "default": {}}[cfg["impl"]]
    hp = dict(lr=1e-2, weight_decay=0.1, amsgrad=cfg.get("amsgrad", False),
              maximize=cfg.get("maximize", False), **flags)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "native":
        return torch.optim.AdamW(params, **hp)
    return cotangent.AdamW(params, max_norm=cfg.get("max_norm", 0.05),
                           norm_type=cfg.get("norm_type", 2.0), **hp)


def _fsdp2_loop(rank: int, cfg: dict, steps: int = 3, resume: tuple | None = None):
    """The pattern (`cases.drive`) of `steps` training steps of a side's fully_shard model:
    native (clip_grad_norm_ then torch.optim.AdamW) or Cotangent (cotangent.AdamW(max_norm=...)),
    each micro-batch's loss and each step's total norm (local tensors) recorded, a point after
    every step. `resume` = (world, first, then): Cotangent's side instead runs two steps with
    `first`'s optimizer, a torch.distributed.checkpoint state dict (`get_state_dict`), a fresh
    model and `then`'s optimizer loading it (`set_state_dict`), and two more steps."""
    from cotangent import dtensor

    max_norm, norm_type = cfg.get("max_norm", 0.05), cfg.get("norm_type", 2.0)

    def steps_of(side, kind, gen, count):
        model, opt = side.model, side.opts[0]
        params = [p for p in model.parameters() if p.requires_grad]
        for step in range(count):
            micro = 2 if cfg.get("accumulate") else 1
            for k in range(micro):
                if cfg.get("accumulate"):
                    model.set_requires_gradient_sync(k == micro - 1)
                loss = model(torch.randn(4, 8, generator=gen)).square().mean()
                loss.backward()
                side.extra[f"loss {k}"] = loss.detach().clone()
            norm = None
            if kind == "native":
                if max_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            elif cfg.get("explicit_clip"):
                norm = opt.clip_grad_norm_()
            opt.step()
            if kind != "native" and max_norm is not None and not cfg.get("explicit_clip"):
                norm = opt.last_total_norm
            if norm is not None:
                side.norms.append(dtensor.local(norm).clone())
            yield step
            opt.zero_grad()

    def loop(side):
        gen = torch.Generator().manual_seed(rank)
        if resume is None or side.native:
            yield from steps_of(side, "native" if side.native else "cotangent", gen, steps)
            return
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        world, first, then = resume
        side.model = _fsdp2_model(cfg, world)
        side.opts = [_fsdp2_optimizer(side.model, cfg, first)]
        yield from steps_of(side, first, gen, 2)
        model_sd, optim_sd = get_state_dict(side.model, side.opts[0])
        side.model = _fsdp2_model(cfg, world)
        side.opts = [_fsdp2_optimizer(side.model, cfg, then)]
        set_state_dict(side.model, side.opts[0], model_state_dict=model_sd,
                       optim_state_dict=optim_sd)
        yield from steps_of(side, then, gen, 2)
    return loop


def _fsdp2_side(world: int, cfg: dict, kind: str):
    from cases import Side

    model = _fsdp2_model(cfg, world)
    return Side(model, kind == "native", opts=(_fsdp2_optimizer(model, cfg, kind),))


def _fsdp2_compared(rank: int, world: int, cfg: dict, *, ours=None, steps: int = 3,
                    resume: tuple | None = None):
    """(Cotangent's side, the differences from native on this rank: `cases.drive` on
    `_fsdp2_loop`). `ours`: Cotangent's side's config (default: `cfg`)."""
    native = _fsdp2_side(world, cfg, "native")
    side = _fsdp2_side(world, ours or cfg, "cotangent")
    label = f"{ours or cfg}" + (f" resumed {resume[1]} -> {resume[2]}" if resume else "")
    return side, _driven(label, _fsdp2_loop(rank, ours or cfg, steps, resume), native, side)


def _fsdp2_control(rank: int, world: int, cfg: dict) -> list[str]:
    """The comparison sees another implementation's bits: a foreach run differs from a fused
    native one."""
    if not _fsdp2_compared(rank, world, cfg, ours=dict(cfg, impl="foreach"))[1]:
        return ["control: fused and foreach runs compared equal"]
    return []


def _fsdp2_checks(rank: int, world: int) -> list[str]:
    from cotangent.verify import first_difference

    problems = []
    for cfg in FSDP2_CONFIGS:
        ours, found = _fsdp2_compared(rank, world, cfg)
        problems += found
        path = ours.opts[0].update_path()
        if path["path"] != "single-pass" or path["clip_in_pass"] != (
                path["single_pass"] if cfg.get("max_norm", 0.05) == 0.05
                and not cfg.get("explicit_clip") else 0):
            problems.append(f"{cfg}: update path {path}")  # (the shards took the single pass)
        if cfg is FSDP2_CONFIGS[0]:
            problems += _fsdp2_control(rank, world, cfg)
            # the drop-in clip functions on DTensor gradients: native's own code
            import cotangent
            from cotangent import dtensor

            model = _fsdp2_model(cfg, world)
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
            grads = [p.grad for p in model.parameters()]
            ref = torch.nn.utils.get_total_norm(grads)
            got = cotangent.get_total_norm(grads)
            if (d := first_difference(dtensor.local(ref), dtensor.local(got))) is not None:
                problems.append(f"cotangent.get_total_norm on DTensors: {d}")
            # checkpoints (torch.distributed.checkpoint's get/set_state_dict) both ways: a run
            # resumed is the uninterrupted native one
            for first, then in (("cotangent", "native"), ("native", "cotangent")):
                problems += _fsdp2_compared(rank, world, cfg, steps=4,
                                            resume=(world, first, then))[1]
    return problems


# 4 ranks on a (2, 2) (replicate, shard) mesh: gradients reduce-scattered over the shard
# dimension and all-reduced over the replicate one; the clip's norm reduced over the shard one
HSDP_2X2_CONFIGS = [dict(impl="fused", hsdp="2x2"), dict(impl="foreach", hsdp="2x2"),
                    dict(impl="for-loop", hsdp="2x2", accumulate=True, max_norm=1e4)]


def _hsdp_checks(rank: int, world: int) -> list[str]:
    problems = []
    for cfg in HSDP_2X2_CONFIGS:
        ours, found = _fsdp2_compared(rank, world, cfg)
        problems += found
        if cfg is HSDP_2X2_CONFIGS[0]:
            problems += _fsdp2_control(rank, world, cfg)
        if ours.opts[0].update_path()["path"] != "single-pass":
            problems.append(f"{cfg}: update path {ours.opts[0].update_path()}")
    return problems


CHECKS = {"ddp": _ddp_checks, "zero1": _zero_checks, "crash": _crash_checks,
          "fsdp2": _fsdp2_checks, "hsdp": _hsdp_checks}


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_test_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"rank\(s\) \[\(1, 3\)\]"):
        run_ranks("crash")
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_zero1_is_bitwise_equal_to_native_ddp_and_to_zero_redundancy_optimizer():
    reports = run_ranks("zero1")
    problems = [f"rank {rank}: {p}" for rank, ps in reports for p in ps]
    assert not problems, "\n".join(problems[:8])



@pytest.mark.slow
def test_fsdp2_is_bitwise_equal_to_native_on_every_rank():
    """`cotangent.AdamW(max_norm=...)` on a fully_shard model (2 gloo ranks, uneven shards)
    against native clip_grad_norm_ + torch.optim.AdamW: losses, total norms, local parameter
    shards, moments and steps byte for byte on every rank, for every configuration of
    FSDP2_CONFIGS (for-loop, foreach, fused, default; reshard_after_forward off, root-only
    sharding, accumulation without gradient sync, frozen parameters, amsgrad, maximize, the
    clip off or inactive, bf16 mixed precision, (1, 2) and (2, 1) HSDP meshes, the clip called
    apart, the inf norm); a fused-vs-foreach control differs; a run checkpointed with
    torch.distributed.checkpoint's get_state_dict and resumed with set_state_dict, Cotangent to
    native and native to Cotangent, equals the uninterrupted run."""
    reports = run_ranks("fsdp2")
    problems = [f"rank {rank}: {p}" for rank, ps in reports for p in ps]
    assert not problems, "\n".join(problems[:8])


@pytest.mark.slow
def test_fsdp2_on_a_2x2_hsdp_mesh_is_bitwise_equal_to_native_on_every_rank():
    """4 gloo ranks, a (2, 2) (replicate, shard) mesh, placements (Replicate(), Shard(0)) with
    uneven shards: losses, total norms, local shards, moments and steps byte for byte on every
    rank (fused, foreach, for-loop with accumulation and the clip inactive); a fused-vs-foreach
    control differs."""
    reports = run_ranks("hsdp", world=4)
    assert len(reports) == 4
    problems = [f"rank {rank}: {p}" for rank, ps in reports for p in ps]
    assert not problems, "\n".join(problems[:8])


@pytest.mark.slow
def test_ddp_loops_are_bitwise_equal_to_native_on_every_rank():
    reports = run_ranks("ddp")
    assert len(CONFIGS) == 20
    problems = [f"rank {rank}: {p}" for rank, ps in reports for p in ps]
    assert not problems, "\n".join(problems[:5])


# ---------------------------------------------------------------- one process: arguments, plan


def test_zero1_arguments_are_checked_before_anything_is_modified():
    import cotangent

    model = nn.Linear(4, 4)
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="init_process_group"):
        cotangent.AdamW(model.parameters(), shard="zero1")
    with pytest.raises(ValueError, match="shard must be one of"):
        cotangent.AdamW(model.parameters(), shard="zero3")
    with pytest.raises(ValueError, match="shard_norms must be one of"):
        cotangent.AdamW(model.parameters(), shard_norms="half")
    with pytest.raises(ValueError, match="process_group is only used"):
        cotangent.AdamW(model.parameters(), process_group=object())
    assert [p.data_ptr() for p in model.parameters()] == before  # nothing moved
    opt = cotangent.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="not sharded"):
        opt.consolidate_state_dict()


def test_zero1_on_one_rank_is_plain_adamw_and_refuses_pickling(single_rank_group):
    import pickle

    import cotangent
    from bitwise import assert_same_update
    from cotangent.reference import ReferenceUpdate

    torch.manual_seed(0)
    native_model, our_model = nn.Linear(8, 16), nn.Linear(8, 16)
    our_model.load_state_dict(native_model.state_dict())
    native = ReferenceUpdate(list(native_model.parameters()), max_norm=0.1, lr=1e-2, fused=True)
    ours = cotangent.AdamW(our_model.parameters(), max_norm=0.1, lr=1e-2, fused=True,
                           shard="zero1", shard_norms="share")
    for _ in range(3):
        x = torch.randn(4, 8)
        for model in (native_model, our_model):
            model(x).square().mean().backward()
        native.step()
        ours.step()
        native.optimizer.zero_grad()
        ours.zero_grad()
    assert_same_update(native_model.parameters(), native.optimizer.state,
                       our_model.parameters(), ours.state, "ZeRO-1 on one rank", grads=False)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        ours.state_dict()
    with pytest.raises(ValueError, match="to must be a rank"):
        ours.consolidate_state_dict(to=1)
    ours.consolidate_state_dict()
    assert set(ours.state_dict()["state"]) == {0, 1}
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ours)


def test_zero1_shares_are_contiguous_size_balanced_and_whole_parameters():
    from cotangent.sharding import shares_of

    sizes = [3, 700, 64, 64, 64, 1000, 5, 128, 900, 17]
    for world in (1, 2, 3, 4):
        shares = shares_of(sizes, world)
        assert len(shares) == len(sizes) and shares == sorted(shares)  # contiguous runs
        assert set(shares) <= set(range(world)) and shares[0] == 0
        load = [sum(n for n, s in zip(sizes, shares) if s == r) for r in range(world)]
        # balanced: no share exceeds its fair part by more than the largest parameter
        assert max(load) <= sum(sizes) / world + max(sizes)
    assert shares_of(sizes, 2) == [0] * 6 + [1] * 4
    assert shares_of([0, 0], 3) == [0, 0] and shares_of([], 2) == []
