"""Byte-level corpora: WikiText-2 from a directory, or an embedded real corpus.

WikiText-2 (Merity et al., "Pointer Sentinel Mixture Models", 2016) is read as raw bytes (byte
vocabulary 256, no tokenizer) from a directory holding either the tokenized release under the names
`train.txt` / `valid.txt` / `test.txt` (as pytorch/examples ships it) or `wiki.{train,valid,test}.tokens`,
or the raw release `wiki.{train,valid,test}.raw`, each plain or `.xz`-compressed. Every file's
SHA-256 (of the decompressed bytes) is checked against the table of known files below; an unknown
file is used with a warning naming it.

Without WikiText-2, `embedded_corpus()` gives a real corpus every Python installation has: the bytes
of the standard library's `.py` sources, in sorted path order.
"""

from __future__ import annotations

import hashlib
import lzma
import math
import os
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "valid", "test")

# SHA-256 of the decompressed bytes -> (dataset, split): the hashes of the tokenized WikiText-2
# files as pytorch/examples ships them (word_language_model/data/wikitext-2/{train,valid,test}.txt)
# and of the raw release's valid and test files (wiki.{valid,test}.raw of wikitext-2-raw-v1.zip;
# its train file is not listed, so a raw train file loads with a warning).
KNOWN_SHA256: dict[str, tuple[str, str]] = {
    "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f": ("wikitext-2", "train"),
    "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8": ("wikitext-2", "valid"),
    "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0": ("wikitext-2", "test"),
    "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7": ("wikitext-2-raw", "valid"),
    "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08": ("wikitext-2-raw", "test"),
}

# Accepted file names per split, in the order they are looked for (each also with `.xz`).
FILE_NAMES: dict[str, tuple[str, ...]] = {
    split: (f"{split}.txt", f"wiki.{split}.tokens", f"wiki.{split}.raw") for split in SPLITS
}

DATA_ENV = "COTANGENT_DATA_DIR"  # the WikiText-2 directory when no --data-dir is given
TRAIN_FRACTION = 0.95  # training windows come from the first 95% of train (the rest: probes)


@dataclass(frozen=True, slots=True)
class SplitSource:
    """Where one split's bytes came from."""

    path: str
    sha256: str  # of the decompressed bytes
    known: bool  # found in KNOWN_SHA256 for this split
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Corpus:
    """A byte corpus with train/valid/test splits."""

    name: str
    splits: dict[str, bytes]
    sources: dict[str, SplitSource] = field(default_factory=dict)
    note: str = ""

    def manifest(self) -> dict:
        """JSON-able description: name, note and per-split path, SHA-256 and size."""
        return {
            "name": self.name,
            "note": self.note,
            "splits": {s: {"path": src.path, "sha256": src.sha256, "known": src.known,
                           "bytes": src.n_bytes} for s, src in self.sources.items()},
        }


def sha256_bytes(data: bytes) -> str:
    """SHA-256 (hex) of `data`."""
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes:
    """File contents, decompressed when the name ends in `.xz`.

    Raises:
        ValueError: a corrupt or truncated `.xz` file (names the file).
    """
    if path.suffix == ".xz":
        try:
            with lzma.open(path) as f:
                return f.read()
        except (lzma.LZMAError, EOFError) as exc:
            raise ValueError(f"{path}: not a valid .xz file ({exc})") from exc
    return path.read_bytes()


def find_split(data_dir: Path, split: str) -> Path:
    """The file holding `split` in `data_dir`; FileNotFoundError lists every name tried."""
    tried = []
    for name in FILE_NAMES[split]:
        for candidate in (name, name + ".xz"):
            path = data_dir / candidate
            tried.append(candidate)
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"no {split} split in {data_dir}: looked for {', '.join(tried)}"
    )


def load_wikitext2(data_dir: str | os.PathLike) -> Corpus:
    """Read WikiText-2's three splits as bytes from `data_dir`, checking SHA-256.

    Returns:
        Corpus named "wikitext-2" (tokenized) or "wikitext-2-raw" (if all files are raw-named).
    Raises:
        FileNotFoundError: `data_dir` is missing or lacks a split.
        ValueError: a corrupt `.xz` file.
    Warns:
        UserWarning: a file whose SHA-256 is not the known one for its split (names the file).
    """
    root = Path(data_dir)
    if root.exists() and not root.is_dir():
        raise FileNotFoundError(f"data directory {root} is a file, not a directory")
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {root} does not exist")
    splits, sources = {}, {}
    for split in SPLITS:
        path = find_split(root, split)
        data = read_bytes(path)
        digest = sha256_bytes(data)
        known = KNOWN_SHA256.get(digest, ("", ""))[1] == split
        if not known:
            warnings.warn(
                f"{path}: SHA-256 {digest} is not a known WikiText-2 {split} file; using it anyway",
                stacklevel=2,
            )
        splits[split] = data
        sources[split] = SplitSource(str(path), digest, known, len(data))
    raw = all(".raw" in Path(src.path).name for src in sources.values())
    return Corpus("wikitext-2-raw" if raw else "wikitext-2", splits, sources)


def embedded_corpus() -> Corpus:
    """The running Python's standard-library `.py` sources as one byte corpus.

    Files under the stdlib directory (`sysconfig.get_paths()["stdlib"]`, excluding
    site-packages/dist-packages) are concatenated in sorted relative-path order; the first 90% of
    the bytes is train, the next 5% valid, the last 5% test. The SHA-256 recorded for each split
    identifies the exact Python build it came from.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py")
         if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    data = b"".join(p.read_bytes() for p in files)
    a, b = int(len(data) * 0.90), int(len(data) * 0.95)
    splits = {"train": data[:a], "valid": data[a:b], "test": data[b:]}
    sources = {s: SplitSource(f"{root}/**/*.py[{s}]", sha256_bytes(v), False, len(v))
               for s, v in splits.items()}
    note = (f"embedded corpus: {len(files)} standard-library .py files of Python "
            f"{sysconfig.get_python_version()} ({len(data):,} bytes, SHA-256 {sha256_bytes(data)})")
    return Corpus("python-stdlib", splits, sources, note)


def as_array(data: bytes) -> np.ndarray:
    """Read-only uint8 view of `data` (no copy)."""
    return np.frombuffer(data, dtype=np.uint8)


class WindowSampler:
    """Uniformly random (context + 1)-byte training windows.

    Offsets come from `numpy.random.default_rng(seed + 100000)`, drawn `batch_size` at a time with
    `rng.integers(0, limit - context, size=batch_size)` where `limit` is the first 95% of train,
    so a window never reaches the held-out tail. Two samplers with the same arguments yield the
    same batches.
    """

    def __init__(self, train: bytes, *, seed: int, batch_size: int, context: int) -> None:
        self.data = as_array(train)
        self.limit = int(len(self.data) * TRAIN_FRACTION)
        if self.limit < context + 1:
            raise ValueError(f"train split too short ({len(self.data)} bytes) for context {context}")
        self.rng = np.random.default_rng(seed + 100000)
        self.batch_size = batch_size
        self.context = context

    def offsets(self) -> np.ndarray:
        """The next batch's window start offsets, int64 of shape (batch_size,)."""
        return self.rng.integers(0, self.limit - self.context, size=self.batch_size)

    def next_batch(self) -> torch.Tensor:
        """int64 tensor of shape (batch_size, context + 1): inputs are [:, :-1], targets [:, 1:]."""
        starts = self.offsets()
        idx = starts[:, None] + np.arange(self.context + 1)[None, :]  # (B, T + 1)
        return torch.from_numpy(self.data[idx].astype(np.int64))


def eval_windows(data: bytes, context: int, max_bytes: int = 0) -> torch.Tensor:
    """Contiguous non-overlapping windows for evaluation.

    Window i holds bytes [i*context, i*context + context + 1): `context` inputs and the `context`
    next-byte targets, so every byte after the first is predicted exactly once. `max_bytes` > 0
    keeps only the first `max_bytes` bytes. Returns int64 (n_windows, context + 1).
    """
    arr = as_array(data if max_bytes <= 0 else data[:max_bytes])
    n = (len(arr) - 1) // context
    if n < 1:
        raise ValueError(f"evaluation split too short ({len(arr)} bytes) for context {context}")
    idx = np.arange(n)[:, None] * context + np.arange(context + 1)[None, :]  # (N, T + 1)
    return torch.from_numpy(arr[idx].astype(np.int64))


BITS_PER_NAT = 1.0 / math.log(2.0)


# The canonical public copy of tokenized WikiText-2 (v1), as pytorch/examples ships it; the
# SHA-256 of each file is checked against KNOWN_SHA256 before it is kept.
WIKITEXT2_URL = ("https://raw.githubusercontent.com/pytorch/examples/main/"
                 "word_language_model/data/wikitext-2/")


def fetch_wikitext2(dest: str | os.PathLike, base_url: str = WIKITEXT2_URL, *,
                    timeout_s: float = 60.0, log=print) -> dict[str, Path]:
    """Download WikiText-2's three splits from `base_url` into `dest` as `{split}.txt`.

    For each split the names `load_wikitext2` reads are tried at `base_url` in its order
    (`train.txt`, `train.txt.xz`, `wiki.train.tokens`, ...); the first that exists is
    downloaded, decompressed if its name ends in `.xz`, and its SHA-256 (of the decompressed
    bytes) checked against the known WikiText-2 hash of its split before it is written to a
    temporary name and renamed into place. A `{split}.txt` already present with the right hash
    is kept. Returns {split: path}.
    Raises:
        ValueError: a downloaded file has the wrong SHA-256 or is a corrupt `.xz` (nothing is
            kept for it).
        OSError: the download failed, or no accepted name exists at `base_url` (names the URLs).
    """
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    expected = {split: digest for digest, (name, split) in KNOWN_SHA256.items()
                if name == "wikitext-2"}
    paths = {}
    for split in SPLITS:
        target = root / f"{split}.txt"
        if target.is_file() and sha256_bytes(target.read_bytes()) == expected[split]:
            log(f"{target}: present, SHA-256 ok")
            paths[split] = target
            continue
        url, data = _download_first(base_url, split, timeout_s)
        if url.endswith(".xz"):
            try:
                data = lzma.decompress(data)
            except lzma.LZMAError as exc:
                raise ValueError(f"{url}: not a valid .xz file ({exc}); not saved") from None
        digest = sha256_bytes(data)
        if digest != expected[split]:
            raise ValueError(f"{url}: SHA-256 {digest} is not WikiText-2's {split} "
                             f"({expected[split]}); not saved")
        tmp = target.with_name(f".{target.name}.part")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        log(f"{target}: {len(data):,} bytes from {url}"
            + (" (decompressed)" if url.endswith(".xz") else "") + ", SHA-256 ok")
        paths[split] = target
    return paths


def _download_first(base_url: str, split: str, timeout_s: float) -> tuple[str, bytes]:
    """(url, bytes) of the first of `split`'s accepted file names that exists at `base_url`.
    A missing name (HTTP 404, or no such file) moves on to the next; any other failure, or no
    name found, raises OSError naming the URL(s)."""
    import urllib.error
    import urllib.request

    tried = []
    for name in FILE_NAMES[split]:
        for candidate in (name, name + ".xz"):
            url = base_url.rstrip("/") + "/" + candidate
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    return url, response.read()
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise OSError(f"download of {url} failed: {exc}") from None
            except urllib.error.URLError as exc:
                if not isinstance(exc.reason, FileNotFoundError):
                    raise OSError(f"download of {url} failed: {exc}") from None
            except OSError as exc:
                raise OSError(f"download of {url} failed: {exc}") from None
            tried.append(candidate)
    raise OSError(f"download of WikiText-2 {split} from {base_url} failed: none of "
                  f"{', '.join(tried)} is there")


def describe_corpus(data_dir: str | os.PathLike | None) -> list[str]:
    """Human-readable lines: which corpus would be used, from where, with what hashes."""
    if not data_dir:
        corpus = embedded_corpus()
        return [f"no data directory: the {corpus.note}"] + [
            f"  {s:<5} {src.n_bytes:>11,} B  sha256 {src.sha256}"
            for s, src in corpus.sources.items()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = load_wikitext2(data_dir)
    lines = [f"{corpus.name} in {data_dir}"]
    for split, src in corpus.sources.items():
        status = "known" if src.known else "UNKNOWN (not a known WikiText-2 file)"
        lines.append(f"  {split:<5} {src.n_bytes:>11,} B  sha256 {src.sha256}  {status}  "
                     f"{src.path}")
    lines += [f"  warning: {w.message}" for w in caught]
    return lines
