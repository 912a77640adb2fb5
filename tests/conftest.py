import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # Calibration verdicts go to a per-session temporary cache, never the user's own; compiled
    # libraries (the kernel, the list reader, the tests' kernel variants) to a cache that
    # outlives the session (`$COTANGENT_KERNEL_CACHE_DIR` where set, else
    # `~/.cache/cotangent-tests/kernels`): each is built once per machine, source and flags.
    import os
    import tempfile

    os.environ["COTANGENT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cotangent-cache-")
    if not os.environ.get("COTANGENT_KERNEL_CACHE_DIR"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["COTANGENT_KERNEL_CACHE_DIR"] = os.path.join(base, "cotangent-tests", "kernels")


INTEGRATIONS = ("transformers", "accelerate", "pytorch_lightning", "safetensors", "tensorboard")


def _versions() -> str:
    import importlib.metadata

    import torch

    found = []
    for name in INTEGRATIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name.replace('_', '-'))}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent (its tests skip)")
    return f"torch {torch.__version__}; integrations: " + ", ".join(found)


def pytest_report_header(config):
    """The versions the integration tests ran against (or that a framework is absent and its
    tests skip), at the top of the output and (since `-q` hides the header) at the end."""
    return [_versions()]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_versions())
    from cotangent import _build

    names = [c.path.name.split("-")[0] for c in _build.COMPILED]
    terminalreporter.write_line(
        f"compiled in this session: {len(names)} libraries in "
        f"{sum(c.compile_s for c in _build.COMPILED):.1f} s ({', '.join(names) or 'none'}); "
        f"kernel cache {_build.cache_dir()}")


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-process gloo group (file rendezvous), for ZeroRedundancyOptimizer / FSDP2 tests."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()
