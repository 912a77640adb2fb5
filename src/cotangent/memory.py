"""Saved-tensor storage audit: what autograd keeps for backward, deduplicated by storage.

A tensor saved for backward keeps its whole storage alive, not only the elements it views: a
32-channel slice of a (B, T, d) activation that feeds a gate pins all B*T*d elements until the
backward. `audit` records every saved tensor through `torch.autograd.graph.saved_tensors_hooks`
(eager and `torch.compile`d code alike: the compiled graph's saved tensors go through the same
hooks), groups them by storage and computes, per storage, the exact number of bytes its saved
views reference (a union of byte intervals).

Definitions (fixed, so that other tools can read the numbers; all sizes in integer bytes):
- an *activation storage* is a unique storage (by data pointer) of a saved tensor that is not the
  storage of one of `params`; `activation_bytes` is the sum of their sizes;
- `referenced_bytes` (per storage and summed over activation storages): the bytes of the storage
  that at least one saved view reads;
- `saved_references`: saved views autograd still holds when the report is made;
- a storage is *pinned* when its saved views reference less than half of its bytes;
  `pinned_unreferenced_bytes` sums, over pinned storages, storage bytes minus referenced bytes.

The audit keeps no saved tensor alive: what it records is metadata (pointers, sizes, shapes,
strides); the pack hook hands autograd the tensor detached (so a saved output forms no
reference cycle with its own graph node) with its version, and the unpack hook makes the
in-place-modification check autograd skips for hooked tensors. A saved view counts while
autograd holds it: views released by a backward, or by a graph freed inside `fn`, drop out of
the report (and a freed address that a later storage reuses is not merged with it). The loss
and gradients are byte-equal with and without the audit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cotangent import _compat

SCHEMA_VERSION = 1
PINNED_BELOW = 0.5  # a storage is pinned when its saved views reference less than this fraction


@dataclass
class _Storage:
    """What the saved views of one storage are; a view counts while autograd still holds it
    (`_Saved` marks it released when the graph lets go of it)."""

    nbytes: int
    dtype: str
    device: str
    is_parameter: bool
    views: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)

    def live_views(self) -> list:
        return [v for v, alive in zip(self.views, self.live) if alive]

    def referenced_bytes(self) -> int:
        return _union_bytes(self.live_views(), self.nbytes)


class _Saved:
    """What the pack hook hands autograd: the tensor detached (no reference to its grad_fn,
    so a saved output does not form a reference cycle with its own node) and its version at
    save time (autograd skips its in-place check for hooked tensors; `_unpack` makes it)."""

    __slots__ = ("tensor", "version", "entry", "index")

    def __init__(self, tensor: Tensor, entry: _Storage | None, index: int) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.entry, self.index = entry, index

    def __del__(self) -> None:  # autograd released it: freed graph, or backward done
        if self.entry is not None:
            self.entry.live[self.index] = False


def _names_by_size(labels: dict[str, int]) -> dict[int, str]:
    """Size (bytes) -> the label(s) of that size, joined by " = " (e.g. "B,T,C = B,T,256")."""
    names: dict[int, list[str]] = {}
    for name, nbytes in labels.items():
        names.setdefault(nbytes, []).append(name)
    return {n: " = ".join(v) for n, v in names.items()}


def _view_intervals(offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                    itemsize: int) -> tuple[Tensor, int]:
    """Start byte offsets (1-D int64) and the common byte length of the contiguous runs that a
    strided view reads: dimensions of stride 1 (and those that continue them contiguously) make
    the run, the others enumerate its starts."""
    # size-1 dims and broadcast (stride-0) dims add no bytes
    dims = sorted(((st, n) for n, st in zip(shape, stride) if n != 1 and st != 0), reverse=True)
    run = 1
    while dims and dims[-1][0] == run:  # innermost dims that extend the run contiguously
        st, n = dims.pop()
        run *= n
    starts = torch.tensor([offset], dtype=torch.int64)
    for st, n in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return starts * itemsize, run * itemsize


def _union_bytes(views, nbytes: int) -> int:
    """Bytes of a storage of `nbytes` covered by the union of `views` ((element offset, shape,
    stride, itemsize) each), clipped to the storage."""
    starts, ends = [], []
    for offset, shape, stride, itemsize in views:
        if 0 in shape:
            continue
        s, length = _view_intervals(offset, shape, stride, itemsize)
        starts.append(s)
        ends.append(s + length)
    if not starts:
        return 0
    start, order = torch.cat(starts).clamp(0, nbytes).sort()
    end = torch.cat(ends).clamp(0, nbytes)[order]
    reach = torch.cummax(end, 0).values  # the furthest byte covered by intervals 0..i
    before = torch.cat([torch.zeros(1, dtype=torch.int64), reach[:-1]])
    return int((end - torch.maximum(start, before)).clamp(min=0).sum())


class MemoryReport:
    """The result of `audit`: `as_dict()` is the JSON document described in the module
    docstring; `table()` the human-readable report."""

    def __init__(self, meta: dict, storages: list[dict], errors: list[str],
                 saved_references: int, labels: dict[str, int] | None) -> None:
        self.meta = meta
        self.storages = storages
        self.errors = errors
        self.saved_references = saved_references
        self.labels = dict(labels or {})
        self.diff: dict | None = None
        self.result = None  # what the audited callable returned (set by `audit`)

    @property
    def summary(self) -> dict:
        """Totals over the report (integer bytes and counts, module docstring's definitions):
        ``saved_references``, ``unique_storages``, ``activation_bytes``, ``referenced_bytes``,
        ``pinned_storages``, ``pinned_unreferenced_bytes``, ``hook_errors``; recomputed from
        `storages` at each read."""
        acts = [s for s in self.storages if not s["is_parameter"]]
        pinned = [s for s in acts if s["pinned"]]
        return dict(
            saved_references=self.saved_references, unique_storages=len(self.storages),
            activation_bytes=sum(s["nbytes"] for s in acts),
            referenced_bytes=sum(s["referenced_bytes"] for s in acts),
            pinned_storages=len(pinned),
            pinned_unreferenced_bytes=sum(s["nbytes"] - s["referenced_bytes"] for s in pinned),
            hook_errors=len(self.errors))

    def classes(self) -> list[dict]:
        """Activation storages grouped by size (bytes), largest first; `label` names a user
        shape whose byte size equals the class (`labels`)."""
        names = _names_by_size(self.labels)
        counts: dict[int, int] = {}
        for s in self.storages:
            if not s["is_parameter"]:
                counts[s["nbytes"]] = counts.get(s["nbytes"], 0) + 1
        return [dict(nbytes=n, count=c, total_bytes=n * c, label=names.get(n))
                for n, c in sorted(counts.items(), reverse=True)]

    def as_dict(self) -> dict:
        return dict(schema_version=SCHEMA_VERSION, **self.meta, summary=self.summary,
                    storages=self.storages, classes=self.classes(), diff=self.diff,
                    errors=self.errors)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    def compare(self, other: MemoryReport) -> dict:
        """Signed deltas `other - self` per size class (count and bytes) and of the summary;
        stored as `other.diff` and returned."""
        mine = {c["nbytes"]: c for c in self.classes()}
        theirs = {c["nbytes"]: c for c in other.classes()}
        names = _names_by_size({**self.labels, **other.labels})
        deltas = []
        for n in sorted(set(mine) | set(theirs), reverse=True):
            a, b = mine.get(n, {}).get("count", 0), theirs.get(n, {}).get("count", 0)
            if a != b:
                deltas.append(dict(nbytes=n, label=names.get(n), count_delta=b - a,
                                   bytes_delta=(b - a) * n))
        base, new = self.summary, other.summary
        other.diff = dict(classes=deltas, summary={k: new[k] - base[k] for k in base})
        return other.diff

    def table(self) -> str:
        """Summary, per-storage table (largest first), size classes, and the remedies for the
        pinned storages."""
        s, m = self.summary, self.meta
        lines = [f"saved-tensor audit: torch {m['torch']}, {m['device']}, {m['mode']}, "
                 f"{m['dtype']}, {m['threads']} thread(s)",
                 f"saved references {s['saved_references']}, unique storages "
                 f"{s['unique_storages']}, activation bytes {s['activation_bytes']:,}, referenced "
                 f"{s['referenced_bytes']:,}, pinned storages {s['pinned_storages']} "
                 f"({s['pinned_unreferenced_bytes']:,} bytes unreferenced), hook errors "
                 f"{s['hook_errors']}",
                 f"{'bytes':>14} {'referenced':>14} {'cover':>6}  kind        refs  "
                 "shapes / modules"]
        for st in self.storages:
            kind = "parameter" if st["is_parameter"] else ("PINNED" if st["pinned"] else
                                                           "activation")
            lines.append(f"{st['nbytes']:>14,} {st['referenced_bytes']:>14,} "
                         f"{st['coverage']:>6.1%}  {kind:<10} {st['saved_refs']:>5}  "
                         f"{st['shapes'][:3]} {st['modules'][:2]}")
        lines.append("size classes (activations): " + ", ".join(
            f"{c['count']} x {c['nbytes']:,} B" + (f" ({c['label']})" if c["label"] else "")
            for c in self.classes()))
        if self.diff is not None:
            lines.append("compared with the baseline (count, bytes): " + (", ".join(
                f"{d['count_delta']:+d} x {d['nbytes']:,} B"
                + (f" ({d['label']})" if d["label"] else "") + f" = {d['bytes_delta']:+,} B"
                for d in self.diff["classes"]) or "no size class changed"))
        if s["pinned_storages"]:
            lines.append(
                "remedies for pinned storages: save a compact copy of the slice "
                "(`x[..., :k].contiguous()` before the op that saves it; bitwise equal in "
                "eager FP32, not asserted under torch.compile in BF16), or fold the "
                "slice's scale into the weights that produce it (not bitwise in BF16)")
        return "\n".join(lines)


class SavedTensorAudit:
    """Context manager that records what autograd saves for backward inside its block.

    Example::

        with SavedTensorAudit(params=model.parameters(), module=model) as rec:
            loss = model(x)
        print(rec.report().table())

    Args:
        params: tensors whose storages are parameters (listed, excluded from activations).
        module: a module whose submodules' forwards attribute each save to the innermost
            one running (eager code; a compiled module's graph runs inside its top module's
            forward, so its saves are attributed to that module as a whole).
        labels: names for size classes, e.g. ``{"B,T,d": B * T * d * 4}`` (bytes).
        mode: recorded in the report ("eager" unless given).
    """

    def __init__(self, params=None, module: torch.nn.Module | None = None,
                 labels: dict[str, int] | None = None, mode: str | None = None) -> None:
        self.param_keys = {_compat.storage_identity(p) for p in (params or [])}
        self.module = module
        self.labels = labels
        self.mode = mode or "eager"
        self.storages: dict[tuple[str, int], _Storage] = {}
        self.errors: list[str] = []
        self.count = 0
        self._stack: list[str] = []
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.released: int = 0  # saved views released before the report

    def __enter__(self) -> SavedTensorAudit:
        if self.module is not None:  # attribution: the innermost running module
            inner = getattr(self.module, "_orig_mod", self.module)
            # a compiled module: its graph runs inside the wrapper's forward (hooks inside
            # would be traced, not run), so it is attributed as a whole
            named = ([("", self.module)] if _compat.is_compiled(self.module)
                     else inner.named_modules())
            for name, sub in named:
                label = name or type(inner).__name__
                self._handles.append(sub.register_forward_pre_hook(self._enter_module(label)))
                # always_call: popped also when the module raises (and the caller catches it)
                self._handles.append(sub.register_forward_hook(self._leave_module,
                                                               always_call=True))
        self._hooks.__enter__()
        return self

    def _enter_module(self, name: str):
        def hook(module, args) -> None:  # returns None: the inputs stay as they are
            self._stack.append(name)
        return hook

    def _leave_module(self, module, args, output) -> None:  # None: the output is unchanged
        if self._stack:
            self._stack.pop()

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pack(self, t: Tensor) -> _Saved:
        self.count += 1
        try:
            if t.is_nested:
                raise TypeError("a nested tensor")
            if t.layout is not torch.strided:
                raise TypeError(f"layout {t.layout}")
            key = _compat.storage_identity(t)
            entry = self.storages.get(key)
            if entry is not None and not any(entry.live):
                # every view saved from this address was released: the memory was freed and
                # now holds another storage
                self.released += len(entry.views)
                entry = None
            if entry is None:
                entry = self.storages[key] = _Storage(
                    t.untyped_storage().nbytes(), str(t.dtype).removeprefix("torch."),
                    str(t.device), key in self.param_keys)
            entry.views.append((t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                t.element_size()))
            entry.live.append(True)
            if self._stack and self._stack[-1] not in entry.modules:
                entry.modules.append(self._stack[-1])
            return _Saved(t, entry, len(entry.views) - 1)
        except Exception as exc:  # recorded, never raised: the forward must go on
            self.errors.append(f"saved {type(t).__name__} {_describe_shape(t)}: "
                               f"{type(exc).__name__}: {exc}")
            return _Saved(t, None, 0)

    def report(self) -> MemoryReport:
        """The report of everything saved so far (coverage computed now)."""
        rows = []
        for entry in self.storages.values():
            live = entry.live_views()
            if not live:
                continue  # released: the backward ran, or the graph was freed inside fn
            referenced = entry.referenced_bytes()
            rows.append(dict(
                nbytes=entry.nbytes, referenced_bytes=referenced,
                coverage=referenced / entry.nbytes if entry.nbytes else 1.0,
                pinned=(not entry.is_parameter and entry.nbytes > 0
                        and referenced < PINNED_BELOW * entry.nbytes),
                is_parameter=entry.is_parameter, dtype=entry.dtype, device=entry.device,
                saved_refs=len(live), shapes=[list(v[1]) for v in live],
                modules=entry.modules))
        rows.sort(key=lambda r: (-r["nbytes"], r["is_parameter"]))
        by_dtype: dict[str, int] = {}
        for r in rows:
            if not r["is_parameter"]:
                by_dtype[r["dtype"]] = by_dtype.get(r["dtype"], 0) + r["nbytes"]
        meta = dict(torch=torch.__version__, device=rows[0]["device"] if rows else "cpu",
                    mode=self.mode, dtype=max(by_dtype, key=by_dtype.get) if by_dtype else None,
                    threads=torch.get_num_threads())
        return MemoryReport(meta, rows, self.errors, sum(r["saved_refs"] for r in rows),
                            self.labels)


def _unpack(saved: _Saved) -> Tensor:
    """The saved tensor, after autograd's own check that it was not modified in place since
    it was saved (which autograd does not make for hooked tensors)."""
    t = saved.tensor
    if t._version != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}], which is output 0 of a saved "
            f"tensor at version {t._version}; expected version {saved.version} instead "
            "(raised by cotangent.memory's unpack hook, as autograd would without it)")
    return t


def _describe_shape(t: Tensor) -> str:
    try:
        return str(tuple(t.shape))
    except Exception:  # old-style nested tensors have no sizes
        return "(no sizes)"


def audit(fn, *args, params=None, labels: dict[str, int] | None = None, mode: str | None = None,
          **kwargs) -> MemoryReport:
    """Call ``fn(*args, **kwargs)`` (a module or any callable) with every tensor autograd saves
    for backward recorded; returns the `MemoryReport`, whose `result` attribute is what `fn`
    returned (its graph, and so the saved tensors, live as long as you keep it, as without the
    audit).

    Args:
        params: tensors whose storages are parameters, listed but excluded from the activation
            totals (default: ``fn.parameters()`` when `fn` is a module).
        labels: names for size classes, e.g. ``{"B,T,d": B * T * d * 4}`` (bytes).
        mode: recorded as is (default: "compiled" for a `torch.compile`d module, else "eager").

    Returns:
        `MemoryReport`; ``as_dict()`` is ``{schema_version, torch, device, mode, dtype, threads,
        summary, storages, classes, diff, errors}``, sizes in integer bytes.

    Saved tensors of kinds without a plain storage (sparse, nested) are counted as hook errors
    with their kind, never raised.
    """
    module = fn if isinstance(fn, torch.nn.Module) else None
    if params is None and module is not None:
        params = list(module.parameters())
    mode = mode or ("compiled" if _compat.is_compiled(fn) else "eager")
    with SavedTensorAudit(params, module, labels, mode) as rec:
        result = fn(*args, **kwargs)
    report = rec.report()
    report.result = result
    return report
