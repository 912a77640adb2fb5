import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # Calibration verdicts go to a per-session temporary cache, never the user's own.
    import os
    import tempfile

    os.environ["COTANGENT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cotangent-cache-")


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
