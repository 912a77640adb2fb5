"""The package version, read by `pyproject.toml` and the calibration keys."""

__version__ = "0.1.0"
