"""Calibration verdicts: cached in memory and in a user cache file, and the probes' test values.

Every probe verdict (`cotangent.norms`, `cotangent.merge`) is keyed by everything its bits
depend on: the probe kind and its own arguments (device type, dtype, lengths, ...), plus the
torch version, the ATen thread count and the machine's kernel class (CPU vector ISA, or the CUDA
device name and compute capability). A verdict proven once is reused from
`$COTANGENT_CACHE_DIR/calibration-v3.json` (default `~/.cache/cotangent/`), written atomically;
`COTANGENT_CACHE_DIR=off` keeps verdicts in memory only. A missing, unreadable or corrupt file
is ignored (the probes simply run again). Version 3 of the file: every probe also feeds
non-finite values, NaNs of both signs and several payloads, and signed zeros
(`sprinkle_special_values`) in parameters and gradients alike; verdicts of earlier versions were
proven without them and are not read.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import cache
from pathlib import Path

import torch

FILE_NAME = "calibration-v3.json"
_MEMORY: dict[str, bool] = {}
_LOADED: set[str] = set()

# Values whose bits depend on the kernel path that produced them: NaN payloads and signs (a
# bfloat16 multiply stores NaN as 0x7FC0 on ATen's scalar path and 0xFFFF on its vector path;
# with two NaN operands the vector body and the scalar tail keep different ones), infinities,
# signed zeros, a float32 subnormal, and a NaN whose bits are all ones.
ALL_ONES_NAN = "all-ones NaN"
SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0, -float("nan"), 1e-40,
                  ALL_ONES_NAN)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_special(t: torch.Tensor, index: int, value) -> None:
    """`t[index] = value` for a 1-D tensor, `ALL_ONES_NAN` written as bits."""
    if value == ALL_ONES_NAN:
        t.view(_INT[t.element_size()])[index] = -1
    else:
        t[index] = value


def sprinkle_special_values(rows: list[torch.Tensor], shift: int = 0) -> None:
    """Write special values into each contiguous 1-D tensor of `rows`, in place, at positions
    that move from row to row, so that over a few rows both the vectorised body and the scalar
    tail of a CPU kernel meet each kind: with ``i = j + shift`` and ``k = len(SPECIAL_VALUES)``,
    row `j` of `n` elements gets ``SPECIAL_VALUES[i % k]`` at ``(37 * i) % n``,
    ``SPECIAL_VALUES[(i + 3) % k]`` at ``n - 1 - (i % n)`` and ``SPECIAL_VALUES[(i + 5) % k]``
    at ``(11 * i + 5) % n``. Two tensors sprinkled with different shifts hold specials at
    positions that sometimes coincide (NaN against NaN) and sometimes not."""
    k = len(SPECIAL_VALUES)
    for j, row in enumerate(rows):
        n = row.numel()
        if n == 0:
            continue
        i = j + shift
        write_special(row, (37 * i) % n, SPECIAL_VALUES[i % k])
        write_special(row, n - 1 - (i % n), SPECIAL_VALUES[(i + 3) % k])
        write_special(row, (11 * i + 5) % n, SPECIAL_VALUES[(i + 5) % k])


def cache_root() -> Path | None:
    """Cotangent's cache folder: ``$COTANGENT_CACHE_DIR``, else ``$XDG_CACHE_HOME/cotangent``
    (default ``~/.cache/cotangent``); None when ``COTANGENT_CACHE_DIR=off``."""
    root = os.environ.get("COTANGENT_CACHE_DIR")
    if root == "off":
        return None
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "cotangent")
    return Path(root)


def cache_path() -> Path | None:
    """The cache file, or None when the file cache is off."""
    root = cache_root()
    return None if root is None else root / FILE_NAME


@cache
def _machine(device_type: str) -> str:
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:{torch.cuda.get_device_name()}:sm{major}{minor}"
    if device_type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    return device_type


def full_key(kind: str, device_type: str, parts: tuple) -> str:
    """The string key of a verdict: probe kind, its arguments, and the environment."""
    fields = [kind, _machine(device_type), torch.__version__, str(torch.get_num_threads())]
    fields += [str(p).removeprefix("torch.") for p in parts]
    return "|".join(fields)


def _load(path: Path) -> None:
    if str(path) in _LOADED:
        return
    _LOADED.add(str(path))
    try:
        data = json.loads(path.read_text())
        verdicts = data["verdicts"]
        _MEMORY.update({k: bool(v) for k, v in verdicts.items()
                        if isinstance(k, str) and isinstance(v, bool)})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass


def lookup(key: str) -> bool | None:
    """A cached verdict, or None if this key was never probed here."""
    path = cache_path()
    if path is not None:
        _load(path)
    return _MEMORY.get(key)


def record(key: str, verdict: bool) -> None:
    """Remember a verdict in memory and (if enabled) in the cache file, atomically."""
    _MEMORY[key] = bool(verdict)
    path = cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        current: dict[str, bool] = {}
        try:
            current = json.loads(path.read_text())["verdicts"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        current[key] = bool(verdict)
        fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": 1, "verdicts": current}, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home directory: verdicts stay in memory


def table() -> list[dict]:
    """Every verdict known to this process (probed here or read from the cache file)."""
    path = cache_path()
    if path is not None:
        _load(path)
    rows = []
    for key, verdict in sorted(_MEMORY.items()):
        kind, machine, version, threads, *parts = key.split("|")
        rows.append(dict(kind=kind, machine=machine, torch=version, threads=int(threads),
                         args=parts, verdict=verdict))
    return rows
