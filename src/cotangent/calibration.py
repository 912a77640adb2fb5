"""Calibration verdicts: cached in memory and in a user cache file, and the probes' test values.

Every probe (`cotangent.norms`, `cotangent.merge`, `cotangent.muon_batched`,
`cotangent.singlepass`, the harness's `packed.tracking`) runs through `verdict` (the cached
verdict, else the probe's, recorded) and compares with `same_bytes`. Each verdict is keyed by
everything its bits depend on and everything that decides what the probe checks (`full_key`): the probe kind and its own arguments
(device type, dtype, lengths, ...); the machine (CPU vector ISA class and the CPU model: vendor,
family, model, stepping and microcode, `cpu_model`; or the CUDA device name and compute
capability); the torch version, Cotangent's version and the ATen thread count; and a hash of the
probe's own code (`probe_fingerprint`: the probing functions' bytecode and constants, plus the
special values every probe feeds and the code that writes them), so that a release that changes
or strengthens a probe, or another CPU model behind a shared home directory, probes again
instead of reusing an old "yes". A verdict proven once is reused from
`$COTANGENT_CACHE_DIR/calibration-v4.json` (default `~/.cache/cotangent/`), written atomically;
`COTANGENT_CACHE_DIR=off` keeps verdicts in memory only. A missing, unreadable or corrupt file
is ignored (the probes simply run again). Version 4 of the file: keys carry the CPU model,
Cotangent's version and the probe fingerprint; verdicts of earlier versions are not read.
"""

from __future__ import annotations

import dis
import hashlib
import inspect
import json
import os
import platform
import struct
import sys
import tempfile
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from cotangent._version import __version__

FILE_NAME = "calibration-v4.json"
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
def cpu_model() -> str:
    """The CPU's vendor, family, model, stepping, microcode revision and model name (Linux:
    the first processor of ``/proc/cpuinfo``; else `platform.processor()`), part of every CPU
    verdict's key: one ISA class covers CPUs whose kernels round alike but whose estimate tables,
    MKL code paths or errata differ, and a hypervisor may show a bare model name ("AMD EPYC")
    for several generations. Fields that cannot be read are "?"."""
    fields = ("vendor_id", "cpu family", "model", "stepping", "microcode", "model name")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in fields and name not in found:
                    found[name] = value.strip()
                if not line.strip() and found:
                    break  # the first processor's block
    except OSError:
        pass
    if found:
        return " / ".join(found.get(k, "?") for k in fields)
    return platform.processor() or platform.machine()


@cache
def _machine(device_type: str) -> str:
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:{torch.cuda.get_device_name()}:sm{major}{minor}"
    if device_type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}:{cpu_model()}".replace("|", "/")
    return device_type


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's instructions, names and constants (nested functions, lambdas and
    comprehensions included), without line numbers or file names: an edit that changes what
    the code does changes these bytes; moving it within the file does not."""
    parts = [code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode()]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if isinstance(const, types.CodeType)
                     else _stable_repr(const).encode())
    return b"\0".join(parts)


def _stable_repr(value) -> str:
    """`repr` that is the same in every process: floats by their bytes (NaN signs kept),
    sequences item by item, sets sorted, and any other object (a sentinel) by its type's name,
    never its address."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(map(_stable_repr, value)) + ")"
    if isinstance(value, (set, frozenset)):  # (`x in {"a", "b"}` compiles to a frozenset whose
        return "{" + ",".join(sorted(map(_stable_repr, value))) + "}"  # order follows the hash seed)
    if isinstance(value, float):
        return struct.pack("<d", value).hex()
    if value is None or isinstance(value, (bool, int, str, range)):
        return repr(value)
    return f"<{type(value).__qualname__}>"


def _names(code: types.CodeType) -> set[str]:
    """Every global or attribute name `code` (and the code nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


_VALUE_TYPES = (int, float, str, tuple, range)  # module-level values a probe may feed


@cache
def _rebound_globals(module_name: str) -> frozenset[str]:
    """Names that some function of module `module_name` (decorated ones unwrapped) rebinds with
    a ``global`` statement (counters, timers, memos such as singlepass's probe count): state,
    not probe values, so left out of fingerprints (their values change while the process
    runs)."""
    module = sys.modules.get(module_name)
    names: set[str] = set()
    functions = [inspect.unwrap(v) for v in vars(module).values()
                 if callable(v)] if module is not None else []
    codes = [f.__code__ for f in functions if isinstance(f, types.FunctionType)]
    while codes:
        code = codes.pop()
        names.update(ins.argval for ins in dis.get_instructions(code)
                     if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"))
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)


def _probe_closure(functions) -> tuple[list, dict]:
    """The functions of a probe and, transitively, every Cotangent function their code names
    (as a global of its module, or as an attribute of a Cotangent module it imported), plus the
    module-level values (numbers, strings, tuples) those names denote. Returns (functions in a
    stable order, {(module, name): value})."""
    seen: set[int] = set()
    found: list = []
    values: dict[tuple[str, str], object] = {}
    stack = [inspect.unwrap(fn) for fn in functions]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        found.append(fn)
        owners = [(fn.__module__, fn.__globals__)]
        owners += [(v.__name__, vars(v)) for v in fn.__globals__.values()
                   if isinstance(v, types.ModuleType) and v.__name__.startswith("cotangent")]
        for name in _names(fn.__code__):
            for module, namespace in owners:
                obj = namespace.get(name)
                if obj is None or isinstance(obj, bool):
                    continue
                target = inspect.unwrap(obj) if callable(obj) else obj
                if (isinstance(target, types.FunctionType)
                        and target.__module__.startswith("cotangent")):
                    stack.append(target)
                elif (isinstance(obj, _VALUE_TYPES) and not name.startswith("__")
                      and name not in _rebound_globals(module)):
                    values[(module, name)] = obj  # (not __file__: paths differ per install)
    found.sort(key=lambda f: (f.__module__, f.__qualname__))
    return found, values


@cache
def probe_fingerprint(probe) -> str:
    """A 16-hex-digit hash of a probe's own code: `probe` is a function, or a tuple of functions
    and value tables (tuples of numbers, hashed by `_stable_repr`). Covered: those functions
    and, transitively, every Cotangent function their code names and the module-level values
    those names denote (`_probe_closure`: the helpers that build the probe's inputs, compare its
    bytes or run the path it proves, `_PROBE_TRIALS`-like constants), each function by its
    bytecode, names and constants (`_code_bytes`: not line numbers), together with
    `SPECIAL_VALUES` and the code of `sprinkle_special_values` and `write_special`, which every
    probe feeds through. torch's own code is not covered (the torch version is in the key).
    Part of every verdict's key (`full_key`); computed once per probe and process.

    Raises:
        TypeError: `probe` holds something that is neither a Python function nor a value.
    """
    items = probe if isinstance(probe, tuple) else (probe,)
    digest = hashlib.sha256(_stable_repr(SPECIAL_VALUES).encode())
    functions = [sprinkle_special_values, write_special]
    for item in items:
        if isinstance(item, (tuple, list, int, float, str, range)):  # values the probe feeds
            digest.update(b"values\0" + _stable_repr(item).encode())
        elif isinstance(inspect.unwrap(item), types.FunctionType):
            functions.append(item)
        else:
            raise TypeError(f"probe_fingerprint takes Python functions and plain values (tuples "
                            f"of numbers), got {item!r}")
    found, values = _probe_closure(functions)
    for fn in found:
        digest.update(f"{fn.__module__}.{fn.__qualname__}".encode() + b"\0"
                      + _code_bytes(fn.__code__))
    for (module, name), value in sorted(values.items()):
        digest.update(f"{module}.{name}=".encode() + _stable_repr(value).encode())
    return digest.hexdigest()[:16]


def full_key(kind: str, device_type: str, parts: tuple, *, probe) -> str:
    """The string key of a verdict: probe kind, machine (`_machine`: ISA class and CPU model,
    or the CUDA device), torch version, Cotangent's version, the probe's fingerprint
    (`probe_fingerprint(probe)`: `probe` is the function that runs the probe, or a tuple of it
    and the helpers that build its inputs), the thread count, then the probe's arguments."""
    fields = [kind, _machine(device_type), torch.__version__, __version__,
              "probe-" + probe_fingerprint(probe), str(torch.get_num_threads())]
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


def verdict(key: str, run: Callable[[], bool | None]) -> bool:
    """The one way a probe runs: the verdict cached for `key` (a `full_key`), else `run()`'s,
    recorded in memory and in the cache file (`record`). `run` compares native against the
    candidate on the probe's data (bytes, `same_bytes`) and returns True or False; None means
    the probe could not run here: False is returned and nothing is recorded, so a later process
    probes again."""
    cached = lookup(key)
    if cached is not None:
        return cached
    found = run()
    if found is None:
        return False
    record(key, found)
    return bool(found)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have the same dtype, shape and bytes (a NaN's payload and a zero's
    sign included): the probes' one comparison."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                            b.reshape(-1).contiguous().view(torch.uint8)))


def table() -> list[dict]:
    """Every verdict known to this process (probed here or read from the cache file), one dict
    per verdict: ``key`` (as `full_key` made it), ``kind``, ``machine``, ``torch``,
    ``cotangent`` (versions), ``probe`` (fingerprint), ``threads``, ``args`` and ``verdict``."""
    path = cache_path()
    if path is not None:
        _load(path)
    rows = []
    for key, verdict in sorted(_MEMORY.items()):
        kind, machine, version, ours, probe, threads, *parts = key.split("|")
        rows.append(dict(key=key, kind=kind, machine=machine, torch=version, cotangent=ours,
                         probe=probe.removeprefix("probe-"), threads=int(threads), args=parts,
                         verdict=verdict))
    return rows
