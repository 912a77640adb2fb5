import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # Calibration verdicts go to a per-session temporary cache, never the user's own.
    import os
    import tempfile

    os.environ["COTANGENT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cotangent-cache-")


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
