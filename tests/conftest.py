import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # Calibration verdicts go to a per-session temporary cache, never the user's own.
    import os
    import tempfile

    os.environ["COTANGENT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cotangent-cache-")
