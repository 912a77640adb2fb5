"""Reading a single-pass call's tensor lists in C++: checks and addresses in one loop.

`singlepass.prepare_lists` checks every tensor of a call (contiguous, the parameter's dtype
and shape, on the CPU; distinct 0-d step tensors) and reads its address. In Python each such
read costs 60-100 ns per tensor and attribute (a C-level ``map`` over a method), about 0.5 ms
for 146 parameters with their gradients, moments and steps. `read_lists` does the same checks
through the tensors' C++ objects, about 10 ns per tensor, and reports whether the byte spans
of all of them are disjoint.

The library is `csrc/tensorlists.cpp`, compiled against the installed torch's headers (the
``include`` folder of its wheel) and the Python headers, by the same builder and cache as the
kernel (`cotangent._build`; keyed also by the torch version and Python's extension suffix).
Where it cannot be built (no compiler, no Python headers), `reader()` is None and
`prepare_lists` checks in Python: the same verdicts (a test compares them), more time.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sysconfig
import threading
from pathlib import Path

import torch

from cotangent import _build, _compat

_log = logging.getLogger(__name__)
SOURCE_PATH = Path(__file__).with_name("csrc") / "tensorlists.cpp"
_LOCK = threading.Lock()
_STATE: dict = {}  # "reader": the function or None; "why": why there is none


def _flags_and_link(module: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    root = Path(torch.__file__).parent
    flags = ("-O2", "-fPIC", "-shared", "-std=c++17", f"-DCOTANGENT_MODULE={module}",
             f"-D_GLIBCXX_USE_CXX11_ABI={_compat.cxx11_abi()}",
             "-isystem", str(root / "include"),
             "-isystem", str(root / "include" / "torch" / "csrc" / "api" / "include"),
             "-isystem", sysconfig.get_paths()["include"])
    link = (f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python")
    return flags, link


def _load():
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise _build.BuildFailed("no Python headers (Python.h) to compile against")
    source = SOURCE_PATH.read_text()
    # one module name (its PyInit symbol) for every build: each build is its own file, loaded
    # by path
    module = "cotangent_tensorlists"
    flags, link = _flags_and_link(module)
    built = _build.compile_cached(module, source, flags, suffix=suffix, link=link,
                                  key_extra=(torch.__version__, str(Path(torch.__file__)),
                                             suffix))
    spec = importlib.util.spec_from_file_location(module, built.path)
    if spec is None or spec.loader is None:
        raise _build.BuildFailed(f"cannot load {built.path}")
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    # state entries are found by hash: read_group may look them up by id(p) where
    # Tensor.__hash__ (which nn.Parameter inherits) returns id(self), as in torch 2.x
    h = torch.Tensor.__hash__
    by_id = torch.nn.Parameter.__hash__ is h and all(
        hash(t) == id(t) for t in (torch.empty(0), torch.nn.Parameter(torch.empty(0))))
    lib.set_types(torch.Tensor, torch.nn.Parameter, h if by_id else None)
    _STATE["group"] = lib.read_group
    _STATE["clear"] = lib.clear_grads
    _STATE["seen"] = lib.GradientSet
    _STATE["replay"] = lib.Replay
    _log.info("tensor-list reader %s (%.2f s): %s", "loaded from the cache" if built.cached
              else "compiled", built.compile_s, built.path)
    _STATE["build"] = built
    return lib.read_lists


def reader():
    """The compiled ``read_lists(lists, steps, grad_enabled, out) -> int``, or None when it
    cannot be built here (`why_not` says why; logged once). Built on first use (about 15-20 s
    with the torch headers), then loaded from the kernel cache.

    ``read_lists`` takes K Python lists of n tensors (parameters first), a Python list of n
    step tensors, whether grad mode is on, and a writable int64 buffer of (K + 2) * n entries
    (`array.array("q")`). Where every tensor is a plain dense contiguous CPU tensor (of type
    torch.Tensor or torch.nn.Parameter exactly, no Python dispatch, not an inference tensor nor
    a ZeroTensor, no negative or conjugate bit) of the parameters' dtype and its parameter's
    sizes, no parameter requires grad in grad mode, and the step tensors are distinct 0-d
    plain CPU tensors, it writes row k (k < K) with the k-th list's addresses, row K with the
    steps' and row K + 1 with the parameters' numels, and returns
    ``1 | 2 * (every step float32) | 4 * (no two byte spans overlap)``; otherwise 0.
    """
    if "reader" not in _STATE:
        with _LOCK:
            if "reader" not in _STATE:
                try:
                    _STATE["reader"] = _load()
                except (_build.BuildFailed, ImportError, OSError) as e:
                    _STATE["reader"], _STATE["why"] = None, str(e)
                    _log.info("tensor-list reader unavailable (lists checked in Python): %s", e)
    return _STATE["reader"]


def group_reader():
    """The compiled ``read_group(params, state, amsgrad, grad_enabled)``, or None where
    `reader()` is None: one param group's AdamW lists read and checked in C++
    (`cotangent.gather.read_group` documents what it returns and when it declines)."""
    return _STATE.get("group") if reader() is not None else None


def gradient_set():
    """The compiled class ``GradientSet(grads)``, or None where `reader()` is None: the
    gradients a clip saw, held by weak reference to their tensors (none kept alive), asked
    ``same(tensors)`` (the same tensors in order), ``holds(tensor)`` and ``covers(params)`` (1:
    every ``.grad`` of `params` is one of them; 0: one is not; -1: a parameter of another type
    than torch.Tensor or nn.Parameter, for the caller to ask `holds`)."""
    return _STATE.get("seen") if reader() is not None else None


def replayer():
    """The compiled class ``Replay(group, snapshot, plan)``, or None where `reader()` is None:
    the last step's plan, whose ``run(state, decide)`` performs the next step or declines
    having modified nothing (`cotangent.replay`)."""
    return _STATE.get("replay") if reader() is not None else None


def grad_clearer():
    """The compiled ``clear_grads(param_groups) -> bool``, or None where `reader()` is None:
    ``Optimizer.zero_grad(set_to_none=True)``'s loop in C++ (``p.grad = None`` is the ``grad``
    setter's ``mutable_grad().reset()``), for plain leaf parameters only (False, nothing
    changed, otherwise)."""
    return _STATE.get("clear") if reader() is not None else None


def why_not() -> str | None:
    """Why `reader()` is None (None when it is available or not yet asked for)."""
    return _STATE.get("why")


def build_info() -> _build.Compiled | None:
    """How the reader was obtained (`cotangent._build.Compiled`), None if it is not loaded."""
    return _STATE.get("build")


def report() -> dict | None:
    """For benchmarks and logs: None before `reader()` was asked for, else ``available``,
    ``cached`` (loaded from the kernel cache), ``compile_s`` (0.0 when cached) and ``why_not``."""
    if "reader" not in _STATE:
        return None
    built = build_info()
    return dict(available=_STATE["reader"] is not None,
                cached=None if built is None else built.cached,
                compile_s=0.0 if built is None else built.compile_s, why_not=_STATE.get("why"))
