"""Parameter-aligned ZeRO-1 for `cotangent.AdamW(..., shard="zero1")`: each rank keeps and
updates the AdamW state of a share of whole parameters, then every parameter is broadcast from
its owner. Parameters, gradients and state stay where they are (nothing is moved; only small
parameters' values pass through broadcast buckets).

Shares are contiguous runs of the optimizer's parameter list (param groups concatenated),
balanced by element count (`shares_of`), so every rank computes the same plan from the
parameters' sizes alone. The total gradient norm is either computed from every gradient on
every rank (DDP has made them equal), or each rank norms its share's gradients and the
per-tensor norms travel as raw bytes into native order (`share_total_norm`): both give
`clip_grad_norm_`'s bits. Everything here is a collective: every rank must make the same calls
in the same order (as with `torch.distributed.optim.ZeroRedundancyOptimizer`).

ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020 (stage 1 = optimizer-state partitioning).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cotangent import _compat
from cotangent.spans import extent, overlapping_pair
from cotangent.state import compact_state

SHARD_MODES = (None, "zero1")
SHARD_NORMS = ("all", "share")


@dataclass(frozen=True, slots=True)
class Zero1:
    """Where this rank stands in a ZeRO-1 optimizer.

    Attributes:
        rank: this process's rank in `group` (= the share whose state it holds).
        world: the group's size (= the number of shares).
        group: the process group (None: the default group).
        norms: ``"all"`` (every rank norms every gradient) or ``"share"`` (norms of its share,
            all-gathered).
    """

    rank: int
    world: int
    group: object | None
    norms: str

    def source(self, share: int) -> int:
        """The global rank of the owner of `share` (broadcast sources are global ranks)."""
        return share if self.group is None else dist.get_global_rank(self.group, share)


def setup(shard: str | None, shard_norms: str, process_group) -> Zero1 | None:
    """Check the sharding arguments of `cotangent.AdamW`; None when not sharded.

    Raises:
        ValueError: an unknown `shard` or `shard_norms`; `shard="zero1"` without an initialised
            default process group (``torch.distributed.init_process_group``).
    """
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    if shard_norms not in SHARD_NORMS:
        raise ValueError(f"shard_norms must be one of {SHARD_NORMS}, got {shard_norms!r}")
    if shard is None:
        if process_group is not None:
            raise ValueError("process_group is only used with shard='zero1'")
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard='zero1' needs torch.distributed initialised first "
                         "(torch.distributed.init_process_group, e.g. under torchrun)")
    return Zero1(dist.get_rank(process_group), dist.get_world_size(process_group),
                 process_group, shard_norms)


def check_one_device(params: list[Tensor]) -> None:
    """ZeRO-1 needs one device: native AdamW's implementation choice (for-loop / foreach /
    fused) is made over a group's parameters, and a share of a mixed-device group could choose
    another one than the whole group does.

    Raises:
        ValueError: parameters on more than one device.
    """
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"shard='zero1' needs every parameter on one device, got "
                         f"{sorted(map(str, devices))}")


def shares_of(sizes: list[int], world: int) -> list[int]:
    """The share (rank) of each parameter, from the parameters' element counts in optimizer
    order: contiguous runs balanced by size, a parameter going to share
    ``floor(world * (elements before it + half its elements) / total)`` (so no share exceeds its
    fair part by more than about half the largest parameter on each side).

    Args:
        sizes: element count of each parameter (``p.numel()``), in optimizer order.
        world: number of shares (the process group's size), >= 1.
    Returns:
        One share index in ``0 .. world - 1`` per parameter, non-decreasing.
    """
    total = sum(sizes)
    out, before = [], 0
    for n in sizes:
        out.append(min(world - 1, world * (2 * before + n) // (2 * total)) if total else 0)
        before += n
    return out


BEFORE = "before the update (nothing was modified)"
DURING = ("during the update (as with native code, what was updated before the error stays "
          "updated; every parameter was still broadcast from its owner, so the ranks agree)")


def start_agree(error: BaseException | None, zero: Zero1, device: torch.device,
                when: str = BEFORE) -> tuple:
    """Whether every rank got through its checks: a collective started before anything is
    modified and waited for (`finish_agree`) before the first modification, so that a rank
    whose own share fails a check (a bad ``state`` entry of a parameter it owns) does not leave
    the others waiting in the broadcast. Returns the pending agreement."""
    flags = torch.zeros(zero.world, dtype=torch.int32, device=device)
    if error is not None:
        flags[zero.rank] = 1
    return dist.all_reduce(flags, group=zero.group, async_op=True), flags, error, when


def finish_agree(pending: tuple | None) -> None:
    """Wait for `start_agree`'s all-reduce (None: nothing to wait for).

    Raises:
        The checks' error on the rank that raised it; on every other rank, a RuntimeError
        naming the ranks that raised.
    """
    if pending is None:
        return
    work, flags, error, when = pending
    work.wait()
    if error is not None:
        raise error
    failed = flags.nonzero().flatten().tolist()
    if failed:
        raise RuntimeError(f"rank(s) {failed} of the ZeRO-1 group raised {when}; see the error "
                           "there")


_SLOT = 8  # bytes per norm in `share_total_norm`'s gather: the widest real dtype


def share_total_norm(grads: list[Tensor], shares: list[int], zero: Zero1, norm_type: float,
                     norms_of) -> Tensor:
    """`clip_grad_norm_`'s total norm of `grads`, each rank norming its share's gradients only
    (``shard_norms="share"``): a collective.

    Native's total norm is ``vector_norm(stack([n.to(first device) for n in norms]))`` with the
    per-tensor norms in its (device, dtype) group order (`torch.nn.utils.clip_grad`). Each rank
    computes the norms of the gradients it owns (``norms_of(list of one (device, dtype)) -> list
    of 0-dim norms``, native's bits), sends their bytes (no arithmetic on the way, so what a
    rank receives does not depend on the other ranks' calibration verdicts), and every rank
    stacks them in native order. Gradients of share ``-1`` (in the clip order, not in the
    optimizer) are normed on every rank.

    Args:
        grads: the clipped gradients, in clip order (equal on every rank).
        shares: the owner of each gradient's parameter (-1: none).
    Returns:
        The total norm: a 0-dim tensor on the first gradient's device.
    Raises:
        What the native norm call raises on the rank whose share it fails on; on every other
        rank, a RuntimeError naming that rank (every rank takes part in the gather first, so
        none is left waiting in it).
    """
    if not grads:
        return torch.tensor(0.0)
    groups = _compat.group_by_device_and_dtype(grads)
    order = [i for _, _, idx in groups for i in idx]
    first = grads[0].device
    # a norm is real: a complex gradient's has the dtype of its real part; each travels in a
    # slot of _SLOT bytes, so that every slot is aligned for any dtype's view
    dtypes = [g.real.dtype if g.is_complex() else g.dtype for g in grads]
    owned = [[i for i in order if shares[i] == r] for r in range(zero.world)]
    width = max(len(part) for part in owned) * _SLOT
    mine = torch.zeros(width + _SLOT, dtype=torch.uint8, device=first)  # slots, then a flag
    norms: dict[int, Tensor] = {}
    error = None
    try:
        for _, _, idx in groups:
            here = [i for i in idx if shares[i] in (zero.rank, -1)]
            for i, n in zip(here, norms_of([grads[i] for i in here])):
                if n.dtype != dtypes[i] or n.numel() != 1:
                    raise RuntimeError(f"the norm of gradient {i} is {n.dtype} {tuple(n.shape)}"
                                       f", not a {dtypes[i]} scalar")
                norms[i] = n
        for k, i in enumerate(owned[zero.rank]):
            raw = norms[i].reshape(1).view(torch.uint8)
            mine[k * _SLOT:k * _SLOT + raw.numel()] = raw
    except Exception as exc:  # re-raised below, after the other ranks have been told
        error = exc
        mine[-1] = 1
    parts = [torch.empty_like(mine) for _ in range(zero.world)]
    dist.all_gather(parts, mine, group=zero.group)
    if error is not None:
        raise error
    failed = [r for r, part in enumerate(parts) if part[-1].item()]
    if failed:
        raise RuntimeError(
            f"rank(s) {failed} raised while computing the gradient norms of their ZeRO-1 "
            "share (shard_norms='share'); see the error there")
    for r, part in enumerate(parts):
        if r == zero.rank:
            continue
        for k, i in enumerate(owned[r]):
            size = dtypes[i].itemsize
            norms[i] = part[k * _SLOT:k * _SLOT + size].view(dtypes[i]).reshape(())
    return torch.linalg.vector_norm(torch.stack([norms[i].to(first) for i in order]), norm_type)


BUCKET_BYTES = 1 << 22  # the most a broadcast bucket of small parameters holds (4 MiB)
DIRECT_BYTES = 1 << 20  # a contiguous parameter this large travels alone, as it is (1 MiB)


@torch.no_grad()
def start_broadcast(params: list[Tensor], shares: list[int], zero: Zero1) -> list:
    """After the update: issue, asynchronously, the broadcasts that send every parameter from
    its owner; `finish_broadcast` waits for them. A contiguous parameter of `DIRECT_BYTES` or
    more is sent and received as it is (no copy); consecutive smaller ones of one owner and
    dtype travel together in a flat bucket of at most `BUCKET_BYTES` (the owner concatenates
    them, the others copy them out on arrival), since on gloo a broadcast per small parameter
    costs more than the copy (`cotangent bench --distributed`). The parameters stay where they
    are: only their values are written.

    Returns:
        The pending broadcasts, for `finish_broadcast`.
    """
    buckets: list[tuple[int, list[Tensor]]] = []
    size = 0
    for p, share in zip(params, shares):
        last = buckets[-1] if buckets else None
        nbytes = p.numel() * p.element_size()
        if nbytes >= DIRECT_BYTES and p.is_contiguous():
            buckets.append((share, [p]))
            size = BUCKET_BYTES  # (nothing joins it)
        elif (last is None or last[0] != share or last[1][0].dtype != p.dtype
                or size + nbytes > BUCKET_BYTES):
            buckets.append((share, [p]))
            size = nbytes
        else:
            last[1].append(p)
            size += nbytes
    pending = []
    for share, ps in buckets:
        copy_out = None  # the parameters to fill from `flat` once it has arrived
        if len(ps) == 1 and ps[0].is_contiguous():
            flat = ps[0].view(-1)  # sent or received in place
        elif share == zero.rank:
            flat = torch.cat([p.reshape(-1) for p in ps])
        else:
            flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype,
                               device=ps[0].device)
            copy_out = ps
        work = dist.broadcast(flat, zero.source(share), group=zero.group, async_op=True)
        pending.append((work, copy_out, flat))
    return pending


@torch.no_grad()
def finish_broadcast(pending: list) -> None:
    """Wait for `start_broadcast`'s broadcasts, in order, copying each received bucket out."""
    for work, copy_out, flat in pending:
        work.wait()
        if copy_out is not None:
            for p, part in zip(copy_out, flat.split([p.numel() for p in copy_out])):
                p.copy_(part.view(p.shape))


@torch.no_grad()
def broadcast_shares(params: list[Tensor], shares: list[int], zero: Zero1) -> None:
    """Every parameter from its owner (`start_broadcast`, then `finish_broadcast`)."""
    finish_broadcast(start_broadcast(params, shares, zero))


def all_gather_states(local: dict[int, dict], zero: Zero1) -> dict[int, dict]:
    """Every rank's `local` (slot -> state dict) merged: a collective. Tensors travel as
    compact copies (`compact_state`: a view would carry its whole storage into the pickle)."""
    gathered: list = [None] * zero.world
    dist.all_gather_object(gathered, dict(compact_state(local)), group=zero.group)
    return _merged(gathered)


def gather_states(local: dict[int, dict], zero: Zero1, to: int) -> dict[int, dict] | None:
    """Every rank's `local` merged on rank `to` of the group (None elsewhere): a collective."""
    gathered = [None] * zero.world if zero.rank == to else None
    dist.gather_object(dict(compact_state(local)), gathered, zero.source(to), group=zero.group)
    return None if gathered is None else _merged(gathered)


def _merged(parts: list[dict[int, dict]]) -> dict[int, dict]:
    """The ranks' slot -> state dicts as one (shares are disjoint)."""
    merged: dict[int, dict] = {}
    for part in parts:
        merged.update(part)
    return merged


def check_disjoint(params: list[Tensor]) -> None:
    """ZeRO-1 needs parameters that share no memory: native updates shared memory once per
    parameter, in order, while two owners would each update it from the old values.

    Raises:
        ValueError: two parameters whose bytes overlap.
    """
    for i, p in enumerate(params):
        if _self_overlapping(p):
            raise ValueError(f"shard='zero1' needs parameters that share no memory; parameter {i} "
                             f"(shape {tuple(p.shape)}, stride {p.stride()}) overlaps itself")
    pair = overlapping_pair([p.data_ptr() for p in params], list(map(extent, params)))
    if pair is not None:
        raise ValueError(f"shard='zero1' needs parameters that share no memory; parameters "
                         f"{pair[0]} and {pair[1]} overlap (native updates that memory once per "
                         "parameter, two owners would not)")


def _self_overlapping(t: Tensor) -> bool:
    """Whether two indices of `t` reach one element (an expanded tensor, a stride-0 dimension)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    if t.numel() == 0:
        return False
    reach = 0  # elements the smaller dims span, minus one
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


class Shares:
    """The share plan of one `cotangent.AdamW(..., shard="zero1")`, kept in step with its param
    groups: who owns each parameter (`shares_of`), which state entries this rank keeps, and the
    consolidated state dict.

    Attributes:
        zero: where this rank stands (`Zero1`).
        params: the optimizer's parameters (param groups concatenated, each once).
        shares: the owner of each of them.
        updates: completed updates (a consolidated state dict is of one of them).
        consolidated: ``(updates, {slot: state entry})`` gathered onto this rank, or None.
    """

    def __init__(self, zero: Zero1) -> None:
        self.zero = zero
        self.key: tuple | None = None
        self.params: list[Tensor] = []
        self.shares: list[int] = []
        self.share_of: dict[int, int] = {}
        # id -> (weak reference, owner) of every parameter a plan held, kept after it leaves
        # the param groups (native keeps its state): a parameter added back finds its state
        self.history: dict[int, tuple] = {}
        self.updates = 0
        self.consolidated: tuple[int, dict] | None = None

    def refresh(self, groups: list[dict], state, exchange: bool = True) -> None:
        """Re-plan after the param groups changed (every rank sees the same change), moving the
        state entries whose parameter changed owner to the new owner when `exchange` (a
        collective, run only when some entry moves), then drop entries this rank does not own.

        Raises (before anything is modified):
            ValueError: parameters on two devices or sharing memory (`check_one_device`,
                `check_disjoint`).
        """
        seen: set[int] = set()
        params = [p for g in groups for p in g["params"]
                  if id(p) not in seen and not seen.add(id(p))]
        key = tuple((id(p), p.numel()) for p in params)
        if key != self.key:
            check_one_device(params)
            check_disjoint(params)
            shares = shares_of([p.numel() for p in params], self.zero.world)
            rank = self.zero.rank
            was = [self._last_owner(p) for p in params]
            moved = [s for s in range(len(params))
                     if was[s] is not None and was[s] != shares[s]] if exchange else []
            if moved:  # every rank computes the same list: all of them take part
                mine = {s: state[params[s]] for s in moved
                        if was[s] == rank and state.get(params[s])}
                for s, entry in all_gather_states(mine, self.zero).items():
                    if shares[s] == rank:
                        state[params[s]] = entry
            self.key, self.params, self.shares = key, params, shares
            self.share_of = {id(p): s for p, s in zip(params, shares)}
            self.history = {k: v for k, v in self.history.items() if v[0]() is not None}
            self.history.update((id(p), (weakref.ref(p), s)) for p, s in zip(params, shares))
            self.consolidated = None
        self.drop_foreign(state)

    def _last_owner(self, p: Tensor) -> int | None:
        """The owner `p` had in an earlier plan, or None (never planned)."""
        seen = self.history.get(id(p))
        return seen[1] if seen is not None and seen[0]() is p else None

    @property
    def device(self) -> torch.device:
        """Where this plan's collectives run: its parameters' one device (CPU when empty)."""
        return self.params[0].device if self.params else torch.device("cpu")

    def drop_foreign(self, state) -> None:
        """Remove the entries of parameters another rank owns (an entry assigned here would
        never be read by an update, and must not stand for the owner's). An entry of a
        parameter that left the param groups stays with its last owner, as native keeps it."""
        rank, share_of = self.zero.rank, self.share_of
        for p in [p for p in state if share_of.get(id(p), rank) != rank]:
            del state[p]

    def owns(self, p: Tensor) -> bool:
        return self.share_of.get(id(p), self.zero.rank) == self.zero.rank

    def consolidate(self, state, to: int | None) -> None:
        """Gather every rank's entries onto rank `to` of the group (None: every rank)."""
        zero = self.zero
        if to is not None and not (isinstance(to, int) and 0 <= to < zero.world):
            raise ValueError(f"to must be a rank in 0..{zero.world - 1} or None, got {to!r}")
        local = {s: state[p] for s, (p, share) in enumerate(zip(self.params, self.shares))
                 if share == zero.rank and state.get(p)}
        self.consolidated = None
        if to is None:
            self.consolidated = (self.updates, all_gather_states(local, zero))
            return
        merged = gather_states(local, zero, to)
        if merged is not None:
            self.consolidated = (self.updates, merged)

    def whole_state(self) -> dict:
        """The consolidated state keyed by parameter.

        Raises:
            RuntimeError: no `consolidate` onto this rank since the last update.
        """
        if self.consolidated is None or self.consolidated[0] != self.updates:
            raise RuntimeError(
                "a ZeRO-1 cotangent.AdamW holds one share of the state per rank: call "
                "opt.consolidate_state_dict(to=RANK) on every rank after the last step, then "
                "opt.state_dict() on RANK")
        whole = self.consolidated[1]
        return {p: whole[s] for s, p in enumerate(self.params) if s in whole}
