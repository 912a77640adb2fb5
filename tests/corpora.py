"""Test corpora made in memory (no test reads a data file for these)."""

from __future__ import annotations

from cotangent.harness.data import Corpus, SplitSource, sha256_bytes


def synthetic_corpus() -> Corpus:
    """A small structured byte corpus, learnable in a few steps: 2,000 numbered lines; 60,000
    bytes of train, 6,000 each of valid and test."""
    lines = [f"{i:05d} the {['quick', 'lazy', 'brown'][i % 3]} fox jumps over {i * 7 % 97}\n"
             for i in range(2000)]
    data = "".join(lines).encode()
    splits = {"train": data[:60_000], "valid": data[60_000:66_000], "test": data[66_000:72_000]}
    sources = {s: SplitSource(f"synthetic[{s}]", sha256_bytes(v), False, len(v))
               for s, v in splits.items()}
    return Corpus("synthetic", splits, sources, "synthetic test corpus")
