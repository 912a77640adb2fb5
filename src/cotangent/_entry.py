"""The `cotangent` command's entry point: the harness CLI, or one line naming the extra to
install when the harness's dependencies are missing (a core-only ``pip install cotangent``).

Standard library only until the harness imports; it lives outside `cotangent.harness` because
importing anything in that package without the extra fails by design."""

from __future__ import annotations

import sys

HARNESS_PACKAGES = ("numpy", "scipy", "matplotlib", "tqdm")


def main(argv: list[str] | None = None) -> int:
    """Run `cotangent.harness.cli.main`; exit status 2 with a one-line message (no traceback)
    when a package of the `harness` extra is not installed."""
    try:
        from cotangent.harness.cli import main as harness_main
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in HARNESS_PACKAGES:
            raise
        print(f"cotangent: the command needs the harness extra ({exc.name} is not installed): "
              "pip install 'cotangent[harness]'", file=sys.stderr)
        return 2
    return harness_main(argv)


if __name__ == "__main__":
    sys.exit(main())
