"""Parameter-aligned ZeRO-1: each rank keeps and updates the AdamW state of a share of whole
parameters, then every share's parameters are broadcast from their owner.

Shares are contiguous runs of the length-ordered flat buffers, balanced by size
(`cotangent.packing.plan_layouts` with ``shares = world size``), so one broadcast per (layout,
rank) moves a whole share. The total gradient norm is either computed from every gradient on
every rank (gradients are already all-reduced by DDP), or from the share's gradients only, the
per-tensor norms then all-gathered, as raw bytes, back into native order: both give
`clip_grad_norm_`'s bits. Everything here is a collective: every rank must make the same calls
in the same order (as with `torch.distributed.optim.ZeroRedundancyOptimizer`).

ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020 (stage 1 = optimizer-state partitioning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cotangent.norms import NormProgram, norm_program, run_norm_program
from cotangent.packing import FlatLayout, share_window
from cotangent.store import compact_state

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


@torch.no_grad()
def broadcast_params(flat_params: list[Tensor], layouts: list[FlatLayout],
                     detached: dict[int, tuple[Tensor, int]], zero: Zero1) -> None:
    """After the update: each share's range of every flat parameter buffer, from its owner,
    then each parameter that lives outside its buffer (`detached`: slot -> (tensor, share)),
    in slot order."""
    for flat, layout in zip(flat_params, layouts):
        for share in range(zero.world):
            start, end = share_window(layout, share)
            if end > start:
                dist.broadcast(flat.narrow(0, start, end - start), zero.source(share),
                               group=zero.group)
    for slot in sorted(detached):
        p, share = detached[slot]
        if p.is_contiguous():
            dist.broadcast(p, zero.source(share), group=zero.group)
        else:
            tmp = p.contiguous()
            dist.broadcast(tmp, zero.source(share), group=zero.group)
            p.copy_(tmp)


class ShardNorms:
    """Per-tensor gradient norms of one layout computed share by share and all-gathered.

    Each rank runs the norm program of its share's buckets (`cotangent.norms.norm_program`
    over the buckets of that share: the same calibrated calls as the whole buffer's program
    makes for them) and sends its norms in buffer order, as bytes (no arithmetic on the way),
    so that what a rank receives does not depend on the other ranks' calibration verdicts; the
    concatenation is then put into the order of this rank's whole-buffer program `full`."""

    def __init__(self, layout: FlatLayout, flat_grads: Tensor, full: NormProgram,
                 zero: Zero1) -> None:
        self.zero = zero
        self.counts = [sum(s.share == share for s in layout.segments)
                       for share in range(zero.world)]
        buckets = [b for b in layout.buckets if b.segments[0].share == zero.rank]
        part = FlatLayout(layout.device, layout.dtype, layout.size, buckets,
                          [s for b in buckets for s in b.segments])
        self.program = norm_program(part, flat_grads)
        # the program's output order -> buffer order within the share
        self.own_order = _inverse(self.program.order, layout.device)
        # buffer order -> the whole-buffer program's output order
        self.index = (None if list(full.order) == list(range(len(full.order)))
                      else torch.tensor(full.order, device=layout.device))
        self.dtype, self.device = layout.dtype, layout.device

    def run(self, norm_type: float) -> Tensor:
        """The per-tensor norms of the whole buffer in the full program's order (collective).

        Raises:
            What the native norm call raises on the rank whose share it fails on; on every
            other rank, a RuntimeError naming that rank (every rank takes part in the gather
            first, so none is left waiting in it).
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        n = self.counts[self.zero.rank]
        mine = torch.zeros(max(self.counts) * itemsize + 1, dtype=torch.uint8,
                           device=self.device)  # the norms' bytes, then a failure flag
        error = None
        try:
            if n:
                norms = run_norm_program(self.program, norm_type, None)
                if self.own_order is not None:
                    norms = norms.index_select(0, self.own_order)
                mine[:n * itemsize] = norms.view(torch.uint8)
        except Exception as exc:  # re-raised below, after the other ranks have been told
            error = exc
            mine[-1] = 1
        raw = [torch.empty_like(mine) for _ in range(self.zero.world)]
        dist.all_gather(raw, mine, group=self.zero.group)
        if error is not None:
            raise error
        failed = [r for r, part in enumerate(raw) if part[-1].item()]
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} raised while computing the gradient norms of their ZeRO-1 "
                "share (shard_norms='share'); see the error there")
        norms = torch.cat([part[:c * itemsize].view(self.dtype)
                           for part, c in zip(raw, self.counts)])
        return norms if self.index is None else norms.index_select(0, self.index)


def _inverse(order, device) -> Tensor | None:
    """The permutation that puts values listed in `order` (positions) back in position order;
    None when `order` is already that."""
    order = list(order)
    if order == list(range(len(order))):
        return None
    inverse = [0] * len(order)
    for i, pos in enumerate(order):
        inverse[pos] = i
    return torch.tensor(inverse, device=device)


def all_gather_states(local: dict[int, dict], zero: Zero1) -> dict[int, dict]:
    """Every rank's `local` (slot -> state dict) merged: a collective. Tensors travel as
    compact copies (`compact_state`: a view would carry its whole flat buffer into the pickle)."""
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
