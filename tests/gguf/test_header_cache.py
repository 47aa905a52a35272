"""The on-disk header cache (fitter.gguf.header_cache): a hit is the header the reader gives, and any
change to the file (content, size, mtime, even with the mtime put back) or to the entry is a miss.

Every test uses its own GGFIT_CACHE (never the user's cache)."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
from gguf import GGUFValueType

import fitter.gguf.reader as gr
from fitter.gguf import header_cache as hc
from tests.gguf_bytes import minimal


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGFIT_NO_HEADER_CACHE", raising=False)
    monkeypatch.setattr(hc, "RACY_NS", 0)  # files written by the test are stored at once (see test_racy_file)
    return tmp_path / "cache" / "headers"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real parse of a file (a cache hit does not parse)."""
    seen: list[str] = []
    real = gr.read_header_from

    def spy(src, shard=0):
        seen.append(src.name)
        return real(src, shard)

    monkeypatch.setattr(gr, "read_header_from", spy)
    return seen


def _write(path: Path, arch: str = "llama", blocks: int = 2) -> None:
    b = minimal(arch)
    b.kv("extra.blocks", GGUFValueType.UINT32, blocks)
    path.write_bytes(b.build())
    time.sleep(0.05)  # past the clock tick that stamped the file: a later change moves its ctime


def _read(path: Path) -> gr.GGUFHeader:
    with hc.enabled():
        return gr.read_header(path)


def test_hit_equals_the_reader(tmp_path: Path, cache: Path, reads: list[str]) -> None:
    f = tmp_path / "m.gguf"
    _write(f)
    first = _read(f)
    assert len(list(cache.iterdir())) == 1
    second = _read(f)
    assert reads == [str(f)]  # the second read came from the cache
    assert second == first == gr.read_header(f)
    assert second.tensors[1].ggml_type == first.tensors[1].ggml_type  # the same enum members


def test_off_by_default_and_by_env(tmp_path: Path, cache: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "m.gguf"
    _write(f)
    gr.read_header(f)
    gr.read_header(f)
    assert not cache.exists()
    monkeypatch.setenv("GGFIT_NO_HEADER_CACHE", "1")
    _read(f)
    _read(f)
    assert not cache.exists() and len(reads) == 4


@pytest.mark.parametrize("change", ["content, same size, mtime put back", "size", "mtime", "replaced by another file"])
def test_a_changed_file_is_read_again(tmp_path: Path, cache: Path, reads: list[str], change: str) -> None:
    f = tmp_path / "m.gguf"
    _write(f, blocks=2)
    assert _read(f).metadata["extra.blocks"] == 2
    st = os.stat(f)
    if change.startswith("content"):
        _write(f, blocks=3)  # the same bytes but one value
        assert os.stat(f).st_size == st.st_size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        want = 3
    elif change == "size":
        _write(f, arch="llama4", blocks=3)
        want = 3
    elif change == "mtime":
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        want = 2
    else:
        other = tmp_path / "other.gguf"
        _write(other, blocks=5)
        os.replace(other, f)
        want = 5
    h = _read(f)
    assert h.metadata["extra.blocks"] == want
    assert len(reads) == 2
    assert _read(f) == h and len(reads) == 2  # and the new parse is what the cache holds now
    assert len(list(cache.iterdir())) == 1  # one entry per file: a change replaces it


def _corrupt(entry: Path, how: str) -> None:
    data = entry.read_bytes()
    if how == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif how == "flipped byte":
        i = len(data) - 10
        entry.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "garbage":
        entry.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        entry.write_bytes(b"")
    elif how == "foreign pickle":  # a well-formed entry whose pickle would run code: refused
        payload = pickle.dumps((("k",), os.system))
        entry.write_bytes(hc.MAGIC + hc._digest(payload) + payload)
    elif how == "another file's entry":
        payload = data[len(hc.MAGIC) + hc._DIGEST:]
        key, header = pickle.loads(payload)
        payload = pickle.dumps(((key[0] + "x", *key[1:]), header))
        entry.write_bytes(hc.MAGIC + hc._digest(payload) + payload)
    else:  # a directory where the entry should be
        entry.unlink()
        entry.mkdir()


@pytest.mark.parametrize("how", ["truncated", "flipped byte", "garbage", "empty", "foreign pickle",
                                 "another file's entry", "directory"])
def test_a_corrupt_entry_is_a_miss(tmp_path: Path, cache: Path, reads: list[str], how: str) -> None:
    f = tmp_path / "m.gguf"
    _write(f)
    want = _read(f)
    (entry,) = cache.iterdir()
    _corrupt(entry, how)
    assert _read(f) == want
    assert len(reads) == 2
    if how != "directory":  # the entry is written again, and serves the next read
        assert _read(f) == want and len(reads) == 2


def test_racy_file_is_not_stored(tmp_path: Path, cache: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hc, "RACY_NS", 2_000_000_000)
    f = tmp_path / "m.gguf"
    f.write_bytes(minimal().build())  # just written: it could change again within its clock tick, unseen
    _read(f)
    _read(f)
    assert len(reads) == 2 and not cache.exists()


def test_unwritable_cache_is_skipped(tmp_path: Path, cache: Path, reads: list[str]) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"not a directory")
    f = tmp_path / "m.gguf"
    _write(f)
    assert _read(f) == _read(f) == gr.read_header(f)
    assert len(reads) == 3


def test_errors_are_not_cached(tmp_path: Path, cache: Path) -> None:
    f = tmp_path / "bad.gguf"
    f.write_bytes(minimal().upto("t1.type"))
    time.sleep(0.05)
    for _ in range(2):
        with pytest.raises(gr.GGUFError):
            _read(f)
    assert not cache.exists() or not list(cache.iterdir())


def test_the_command_line_uses_it(cache: Path, reads: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`ggfit inspect` twice: the second reads the cache and prints the same; the cache is off again after it."""
    import cli
    from tests.synth import build

    f = build("llama")
    outs = []
    for _ in range(2):
        with pytest.raises(SystemExit) as e:
            cli.main(["inspect", str(f)])
        assert e.value.code == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "llama" in outs[0]
    assert reads == [str(f)] and len(list(cache.iterdir())) == 1
    assert not hc.is_enabled()


def test_a_big_vocabulary_round_trips(cache: Path, reads: list[str]) -> None:
    """Gemma 3 270M: token and merge arrays walked and summarised (SkippedArray), a chat template kept."""
    from fitter.bundled import resolve_model

    path = resolve_model("gemma3-270m")
    want = gr.read_header(path)
    assert any(isinstance(v, gr.SkippedArray) for v in want.metadata.values())
    _read(path)
    assert _read(path) == want and len(reads) == 2  # the first stores (an old file), the second is a hit
