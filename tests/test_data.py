"""Data loading, hash checking and window reproducibility."""

from __future__ import annotations

import lzma
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from cotangent.harness import data as D

SHARED = Path(os.environ.get("COTANGENT_DATA_DIR", Path(__file__).parents[2] / "shared/data/wikitext-2"))


def _write_splits(root: Path, names: dict[str, str], payload: dict[str, bytes], xz=False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for split, name in names.items():
        if xz:
            (root / (name + ".xz")).write_bytes(lzma.compress(payload[split]))
        else:
            (root / name).write_bytes(payload[split])


PAYLOAD = {s: f"= {s} =\n some text for the {s} split .\n".encode() * 20 for s in D.SPLITS}


@pytest.mark.parametrize("xz", [False, True])
@pytest.mark.parametrize("naming", ["tokenized", "raw"])
def test_unknown_files_load_with_a_warning_naming_them(tmp_path, xz, naming):
    names = {s: (f"{s}.txt" if naming == "tokenized" else f"wiki.{s}.raw") for s in D.SPLITS}
    _write_splits(tmp_path, names, PAYLOAD, xz=xz)
    with pytest.warns(UserWarning) as record:
        corpus = D.load_wikitext2(tmp_path)
    messages = [str(w.message) for w in record]
    assert len(messages) == 3
    for split in D.SPLITS:
        assert corpus.splits[split] == PAYLOAD[split]
        assert any(names[split] in m and "not a known" in m for m in messages)
        assert corpus.sources[split].sha256 == D.sha256_bytes(PAYLOAD[split])
        assert not corpus.sources[split].known
    assert corpus.name == ("wikitext-2-raw" if naming == "raw" else "wikitext-2")


@pytest.mark.skipif(not SHARED.is_dir(), reason="WikiText-2 not available")
def test_real_wikitext2_matches_known_hashes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known file must not warn
        corpus = D.load_wikitext2(SHARED)
    assert all(src.known for src in corpus.sources.values())
    assert len(corpus.splits["train"]) == 10_797_148
    assert len(corpus.splits["valid"]) == 1_121_681
    assert len(corpus.splits["test"]) == 1_256_449


def test_known_hash_is_accepted_only_for_its_own_split(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "KNOWN_SHA256", {
        D.sha256_bytes(PAYLOAD["train"]): ("wikitext-2", "train"),
        D.sha256_bytes(PAYLOAD["valid"]): ("wikitext-2", "test"),  # known, but as another split
    })
    _write_splits(tmp_path, {s: f"{s}.txt" for s in D.SPLITS}, PAYLOAD)
    with pytest.warns(UserWarning) as record:
        corpus = D.load_wikitext2(tmp_path)
    messages = " | ".join(str(w.message) for w in record)
    assert "train.txt" not in messages
    assert "valid.txt" in messages and "test.txt" in messages
    assert [corpus.sources[s].known for s in D.SPLITS] == [True, False, False]


def test_missing_split_and_corrupt_xz_give_clear_errors(tmp_path):
    _write_splits(tmp_path, {"train": "train.txt", "valid": "valid.txt"}, PAYLOAD)
    with pytest.raises(FileNotFoundError, match="no test split"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            D.load_wikitext2(tmp_path)
    (tmp_path / "test.txt.xz").write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match="test.txt.xz: not a valid .xz"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            D.load_wikitext2(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        D.load_wikitext2(tmp_path / "nope")


def test_windows_are_reproducible_and_stay_in_the_first_95_percent():
    train = bytes(range(256)) * 40  # 10,240 bytes
    a = D.WindowSampler(train, seed=7, batch_size=8, context=256)
    b = D.WindowSampler(train, seed=7, batch_size=8, context=256)
    c = D.WindowSampler(train, seed=8, batch_size=8, context=256)
    expected_rng = np.random.default_rng(7 + 100000)
    limit = int(len(train) * 0.95)
    differs = False
    for _ in range(50):
        xa, xb, xc = a.next_batch(), b.next_batch(), c.next_batch()
        assert xa.shape == (8, 257) and xa.dtype.is_floating_point is False
        assert np.array_equal(xa.numpy(), xb.numpy())
        differs |= not np.array_equal(xa.numpy(), xc.numpy())
        starts = expected_rng.integers(0, limit - 256, size=8)
        for row, s in zip(xa.numpy(), starts):
            assert bytes(row.astype(np.uint8)) == train[s:s + 257]
            assert s + 257 <= limit
    assert differs


def test_eval_windows_cover_each_target_once():
    data = bytes(range(200)) * 3  # 600 bytes
    w = D.eval_windows(data, context=64)
    assert w.shape == ((600 - 1) // 64, 65)
    targets = w[:, 1:].reshape(-1).tolist()
    assert targets == list(data[1:1 + len(targets)])
    assert D.eval_windows(data, context=64, max_bytes=130).shape == (2, 65)


def test_embedded_corpus_is_real_python_source():
    corpus = D.embedded_corpus()
    assert len(corpus.splits["train"]) > 1_000_000
    assert b"def " in corpus.splits["train"][:100_000]
    assert "SHA-256" in corpus.note and corpus.sources["train"].sha256 == D.sha256_bytes(
        corpus.splits["train"])


@pytest.mark.skipif(not SHARED.is_dir(), reason="WikiText-2 not available")
def test_fetch_from_a_file_url_verifies_hashes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for split in D.SPLITS:
        (src / f"{split}.txt").write_bytes(D.read_bytes(SHARED / f"{split}.txt.xz"))
    paths = D.fetch_wikitext2(tmp_path / "dest", src.as_uri(), log=lambda *_: None)
    assert sorted(paths) == sorted(D.SPLITS)
    corpus = D.load_wikitext2(tmp_path / "dest")
    assert all(s.known for s in corpus.sources.values())
    # a second fetch keeps the verified files
    lines = []
    D.fetch_wikitext2(tmp_path / "dest", (tmp_path / "nowhere").as_uri(), log=lines.append)
    assert all("present, SHA-256 ok" in line for line in lines)


@pytest.mark.skipif(not SHARED.is_dir(), reason="WikiText-2 not available")
def test_fetch_reads_the_xz_files_train_reads(tmp_path):
    # the WikiText-2 directory (SHARED) holds only train.txt.xz, valid.txt.xz and test.txt.xz
    assert not (SHARED / "train.txt").exists() and (SHARED / "train.txt.xz").is_file()
    lines = []
    paths = D.fetch_wikitext2(tmp_path / "dest", SHARED.resolve().as_uri(), log=lines.append)
    assert sorted(paths) == sorted(D.SPLITS)
    assert all("txt.xz (decompressed), SHA-256 ok" in line for line in lines), lines
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every fetched file is the known one
        corpus = D.load_wikitext2(tmp_path / "dest")
    assert len(corpus.splits["train"]) == 10_797_148


def _serve(root: Path, files: dict[str, bytes]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / name).write_bytes(content)
    return root.as_uri()


def test_fetch_accepts_xz_by_the_decompressed_hash_and_rejects_corrupt_copies(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(D, "KNOWN_SHA256", {D.sha256_bytes(PAYLOAD[s]): ("wikitext-2", s)
                                            for s in D.SPLITS})
    good = {f"{s}.txt.xz": lzma.compress(PAYLOAD[s]) for s in D.SPLITS}
    # a mix of names train reads: plain, .xz, and wiki.*.tokens.xz
    mixed = {"train.txt": PAYLOAD["train"], "valid.txt.xz": good["valid.txt.xz"],
             "wiki.test.tokens.xz": good["test.txt.xz"]}
    lines = []
    paths = D.fetch_wikitext2(tmp_path / "dest", _serve(tmp_path / "mixed", mixed),
                              log=lines.append)
    assert {s: paths[s].read_bytes() for s in D.SPLITS} == PAYLOAD
    assert [p.name for p in paths.values()] == ["train.txt", "valid.txt", "test.txt"]
    assert "wiki.test.tokens.xz (decompressed)" in lines[2]
    # a corrupted .xz (one flipped byte: the xz check fails) is refused, nothing kept
    broken = dict(good)
    data = bytearray(broken["valid.txt.xz"])
    data[len(data) // 2] ^= 0xFF
    broken["valid.txt.xz"] = bytes(data)
    dest = tmp_path / "dest-broken"
    with pytest.raises(ValueError, match=r"valid.txt.xz: not a valid .xz file"):
        D.fetch_wikitext2(dest, _serve(tmp_path / "broken", broken), log=lambda *_: None)
    assert sorted(p.name for p in dest.iterdir()) == ["train.txt"]
    # a valid .xz of other bytes: its decompressed SHA-256 is checked
    wrong = dict(good, **{"test.txt.xz": lzma.compress(PAYLOAD["valid"])})
    dest = tmp_path / "dest-wrong"
    with pytest.raises(ValueError, match=r"test.txt.xz: SHA-256 .* is not WikiText-2's test"):
        D.fetch_wikitext2(dest, _serve(tmp_path / "wrong", wrong), log=lambda *_: None)
    assert sorted(p.name for p in dest.iterdir()) == ["train.txt", "valid.txt"]
    # no accepted name at all: the error lists every name tried
    with pytest.raises(OSError, match=r"none of train.txt, train.txt.xz, wiki.train.tokens, "
                                      r"wiki.train.tokens.xz, wiki.train.raw, wiki.train.raw.xz"):
        D.fetch_wikitext2(tmp_path / "dest-none", _serve(tmp_path / "empty", {}),
                          log=lambda *_: None)


def test_fetch_rejects_a_wrong_hash_and_keeps_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for split in D.SPLITS:
        (src / f"{split}.txt").write_bytes(PAYLOAD[split])
    with pytest.raises(ValueError, match="train.txt: SHA-256 .* is not WikiText-2's train"):
        D.fetch_wikitext2(tmp_path / "dest", src.as_uri(), log=lambda *_: None)
    assert not any((tmp_path / "dest").iterdir())
    with pytest.raises(OSError, match="download of"):
        D.fetch_wikitext2(tmp_path / "dest2", (tmp_path / "missing").as_uri())


def test_info_names_files_hashes_and_unknowns(tmp_path):
    _write_splits(tmp_path, {s: f"{s}.txt" for s in D.SPLITS}, PAYLOAD)
    text = "\n".join(D.describe_corpus(tmp_path))
    assert "UNKNOWN" in text and D.sha256_bytes(PAYLOAD["train"]) in text
    assert "standard-library" in "\n".join(D.describe_corpus(None))
