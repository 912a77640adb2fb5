"""Run records: every file is written atomically (temporary file in the same directory, fsync,
`os.replace`), so a reader sees either the previous complete file or the new complete file."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

import cotangent


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; records are ordinary files
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path, kind: type = dict):
    """Parse a JSON record; ValueError naming the file when it is not valid JSON of `kind`."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, kind):
        raise ValueError(f"{path}: expected a JSON {kind.__name__}, got {type(obj).__name__}")
    return obj


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSON-lines record (one object per line); ValueError naming the file otherwise."""
    try:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON lines ({exc})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every line must be a JSON object")
    return rows


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def source_sha256() -> str:
    """SHA-256 over the installed `cotangent` package's source: its .py files and its C++
    (``csrc/*.cpp``, the kernels compiled on first use), relative path + bytes, in path order."""
    root = Path(cotangent.__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
              "MKL_NUM_THREADS")


def environment() -> dict:
    """Versions and machine facts recorded with every run (`thread_env`: the threading
    environment variables, None when unset)."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "cotangent": cotangent.__version__,
        "code_sha256": source_sha256(),
        # how idle OpenMP threads wait decides how badly a busy machine slows the steps
        "thread_env": {k: os.environ.get(k) for k in THREAD_ENV},
    }


def cpu_model() -> str:
    """The CPU model name (/proc/cpuinfo), else what `platform` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer in `state_dict` order (`state_sha256`)."""
    return state_sha256(model.state_dict())


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors of `state` in order: name, dtype, shape and the bytes of its
    values in logical (row-major) order, so the hash does not depend on where or with which
    strides a tensor is stored."""
    h = hashlib.sha256()
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
