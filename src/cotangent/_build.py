"""Compiling Cotangent's native code: one builder for every library it loads.

A library is compiled once per source, compiler (path and version) and flag set, and kept in
the kernel cache (``kernels`` in `cotangent.calibration.cache_root`, default
``~/.cache/cotangent/kernels``; a private temporary folder, removed at exit, when
``COTANGENT_CACHE_DIR=off``),
so later processes load it without compiling. Writes are atomic (a temporary file, then
`os.replace`), so processes building at once never load a half-written library.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cotangent import calibration


class BuildFailed(RuntimeError):
    """No compiler, or compiling failed; the message says which and shows its error output."""


@dataclass(frozen=True)
class Compiled:
    """A compiled library: its path, the compiler, whether it came from the cache, the seconds
    spent compiling (0.0 when cached), and the hex SHA-256 of what it was built from."""

    path: Path
    compiler: str
    cached: bool
    compile_s: float
    key: str


# the libraries this process compiled (not those it loaded from the cache), in order
COMPILED: list[Compiled] = []


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++``, else ``g++`` (a full path), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path | None:
    """Where compiled libraries are kept across processes: ``$COTANGENT_KERNEL_CACHE_DIR``, else
    the ``kernels`` folder of Cotangent's cache folder (`calibration.cache_root`); None when the
    one that applies is ``off`` (each process then compiles into a folder of its own). The
    variable lets compiled libraries outlive a cache of verdicts kept fresh (the test suite's
    per-session one): a library's name carries its build key, so a stale one is never loaded."""
    kernels = os.environ.get("COTANGENT_KERNEL_CACHE_DIR")
    if kernels:
        return None if kernels == "off" else Path(kernels)
    root = calibration.cache_root()
    return None if root is None else root / "kernels"


def compile_cached(stem: str, source: str, flags: tuple[str, ...], *, suffix: str = ".so",
                   link: tuple[str, ...] = (), key_extra: tuple[str, ...] = ()) -> Compiled:
    """Compile `source` (C++ text) with ``<cxx> *flags <file.cpp> -o <library> *link``, or load
    it from the cache. The cache key hashes the source, the compiler's path and ``--version``
    output, the flags, `link` and `key_extra` (what else the library depends on, e.g. the torch
    version whose headers it includes); the library is ``<stem>-<key[:20]><suffix>``.

    Raises:
        BuildFailed: no compiler, the compiler does not run, or the compile fails (with the
            last 2,000 characters of its error output).
    """
    cxx = compiler()
    if cxx is None:
        raise BuildFailed("no C++ compiler found (set CXX or install g++)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildFailed(f"C++ compiler {cxx} does not run: {e}") from e
    key = hashlib.sha256("\n".join([source, cxx, version, *flags, "--", *link, "--",
                                    *key_extra]).encode()).hexdigest()
    folder = cache_dir()
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            folder = None
    if folder is None:  # (this process's own, removed at exit: a loaded library stays mapped)
        folder = Path(tempfile.mkdtemp(prefix="cotangent-kernels-"))
        atexit.register(shutil.rmtree, folder, True)
    target = folder / f"{stem}-{key[:20]}{suffix}"
    if target.exists():
        return Compiled(target, cxx, True, 0.0, key)
    src_dir = Path(tempfile.mkdtemp(prefix="cotangent-src-"))
    src = src_dir / f"{stem}.cpp"
    src.write_text(source)
    tmp_out = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([cxx, *flags, str(src), "-o", str(tmp_out), *link],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildFailed(f"compiling {stem} failed: {e}") from e
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tmp_out.unlink(missing_ok=True)
        raise BuildFailed(f"compiling {stem} failed ({cxx}):\n{proc.stderr[-2000:]}")
    try:
        os.replace(tmp_out, target)
    except OSError as e:  # (e.g. a "compiler" that exits 0 and writes nothing)
        raise BuildFailed(f"compiling {stem} with {cxx} left no library: {e}") from e
    built = Compiled(target, cxx, False, seconds, key)
    COMPILED.append(built)
    return built
