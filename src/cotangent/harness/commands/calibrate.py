"""`cotangent calibrate`: the probe verdicts this machine has recorded, and the keys in use."""

from __future__ import annotations

import contextlib
import json

from cotangent.harness.model import MODEL_CONFIGS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="run and show the bitwise calibration probes for a model",
        description="Build the model, pack it with cotangent.AdamW for each native AdamW "
                    "implementation, run the calibration probes its layout needs, and list "
                    "those verdicts (cached in memory and in the user cache file); verdicts "
                    "cached for other models are not listed.")
    p.add_argument("--model", default="transformer-small", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--json", action="store_true", help="print the verdicts as one JSON list "
                   "as the last line")


@contextlib.contextmanager
def _calibration_keys_used():
    """Collect the key of every calibration verdict looked up or recorded inside the block
    (the probes a layout needs, whether they ran now or came from the cache)."""
    from cotangent import calibration

    used: set[str] = set()
    lookup, record = calibration.lookup, calibration.record

    def traced_lookup(key, *a, **k):
        used.add(key)
        return lookup(key, *a, **k)

    def traced_record(key, *a, **k):
        used.add(key)
        return record(key, *a, **k)

    calibration.lookup, calibration.record = traced_lookup, traced_record
    try:
        yield used
    finally:
        calibration.lookup, calibration.record = lookup, record


def calibration_key(row: dict) -> str:
    """The cache key of one `cotangent.calibration.table()` row."""
    return row["key"]


def run(args) -> int:
    import torch

    import cotangent
    from cotangent import calibration
    from cotangent.harness.model import build_model

    from cotangent import singlepass

    singlepass.forget_verdicts()  # every verdict the layout uses comes through the cache
    with _calibration_keys_used() as used:
        for flags in ({"fused": True}, {"foreach": True}, {"foreach": False}):
            model = build_model(args.model, 0)
            params = list(model.parameters())
            opt = cotangent.AdamW(params, max_norm=1.0, **flags)
            torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
            opt.step()  # the probes of the calls it makes run here
            path = opt.update_path()
            print(f"{args.model} {flags}: {len(params)} tensors; update path {path['path']} "
                  f"({path['single_pass']} by the single pass, {path['native']} native"
                  + (f": {'; '.join(path['single_pass_notes'])}" if path["single_pass_notes"]
                     else "") + ")")
    every = calibration.table()
    rows = [r for r in every if calibration_key(r) in used]
    path = calibration.cache_path()
    if path is None:
        print("cache: off (memory only)")
    elif path.is_file():
        print(f"cache: {path}")
    else:
        print(f"cache: {path} could not be written: verdicts stay in memory for this process")
    print(f"{len(rows)} verdicts used by {args.model} ({len(every) - len(rows)} others known "
          "to this process or the cache, not listed):")
    for r in rows:
        print(f"  {'yes' if r['verdict'] else 'no ':<4}{r['kind']:<20}{' '.join(r['args'])}  "
              f"[{r['machine']}, torch {r['torch']}, {r['threads']} threads]")
    if args.json:
        print(json.dumps(rows))
    return 0
