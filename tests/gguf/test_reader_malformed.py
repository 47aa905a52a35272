"""A corpus of malformed GGUF headers, each built field by field (tests/gguf_bytes.py), each refused
with a one-line GGUFError naming the byte offset of the faulty field and the problem; and, for each,
gguf.cpp's own verdict (libggml-base from llama-cpp-python), so that ggfit refuses what llama.cpp refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from fitter.errors import GGFitError, GGUFError, SourceError, UnsupportedModelError
from fitter.gguf.reader import read_header, read_header_from
from tests.gguf_bytes import STRING, GGUFBytes, MemSource, gguf_cpp, gguf_cpp_read, minimal

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[bytes, int]]  # the file's bytes and the offset the error must name
    phrase: str  # must appear in the error's problem
    cpp_refuses: bool = True  # gguf.cpp refuses it too (False: a check of llama.cpp's loader or the spec)


CASES: list[Case] = []


def case(phrase: str, cpp_refuses: bool = True) -> Callable[[Callable[[], tuple[bytes, int]]], Callable[[], tuple[bytes, int]]]:
    def register(fn: Callable[[], tuple[bytes, int]]) -> Callable[[], tuple[bytes, int]]:
        CASES.append(Case(fn.__name__, fn, phrase, cpp_refuses))
        return fn

    return register


def base() -> GGUFBytes:
    """Valid: enough bytes before the victims that the early count checks pass when cutting late fields."""
    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")  # kv0
    b.kv("padding", STRING, "x" * 200)  # kv1
    b.kv("victim.u32", V.UINT32, 7)  # kv2
    b.kv("victim.str", STRING, "hello")  # kv3
    b.kv_array("victim.arr", V.UINT32, [1, 2, 3])  # kv4
    b.kv_array("victim.sarr", STRING, ["ab", "cd"])  # kv5
    b.tensor("t0", (32, 2), Q.F32)
    b.tensor("t1", (32, 2), Q.F32)
    return b


def cut(b: GGUFBytes, label: str, extra: int, at: str | None = None, plus: int = 0) -> tuple[bytes, int]:
    """The file cut `extra` bytes into field `label`; the error is expected at field `at` (default: label)."""
    m = b.marks()
    return b.upto(label, extra), m[at or label] + plus


def with_header(edit: Callable[[GGUFBytes], None], at: str, plus: int = 0) -> tuple[bytes, int]:
    b = base()
    edit(b)
    return b.build(), b.marks()[at] + plus


# --- magic and version --------------------------------------------------------------------------


@case("bad magic")
def wrong_magic() -> tuple[bytes, int]:
    b = base()
    b.magic = b"GGUX"
    return b.build(), 0


@case("bad magic")
def text_file() -> tuple[bytes, int]:
    return b"this is not a model at all\n" * 3, 0


@case("version 1 is no longer supported")
def version_1() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "version", 1), "version")


@case("unsupported GGUF version 0")
def version_0() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "version", 0), "version")


@case("unsupported GGUF version 99")
def version_99() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "version", 99), "version")


@case("unsupported GGUF version 4")
def version_4() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "version", 4), "version")


# --- truncated at every structural point ---------------------------------------------------------


@case("the file is empty")
def zero_length() -> tuple[bytes, int]:
    return b"", 0


@case("magic needs 4 bytes but only 2 remain")
def truncated_magic() -> tuple[bytes, int]:
    return b"GG", 0


@case("version needs 4 bytes but only 3 remain")
def truncated_version() -> tuple[bytes, int]:
    return cut(base(), "version", 3)


@case("tensor count needs 8 bytes but only 5 remain")
def truncated_tensor_count() -> tuple[bytes, int]:
    return cut(base(), "n_tensors", 5)


@case("key/value count needs 8 bytes but only 1 remain")
def truncated_kv_count() -> tuple[bytes, int]:
    return cut(base(), "n_kv", 1)


@case("key/value count 6 cannot fit in the 4 bytes that remain")
def truncated_first_key_length() -> tuple[bytes, int]:
    return cut(base(), "kv0.key_len", 4, at="n_kv")


@case("key 2 length needs 8 bytes but only 4 remain")
def truncated_key_length() -> tuple[bytes, int]:
    return cut(base(), "kv2.key_len", 4)


@case("key 2 length 10 exceeds the 3 bytes that remain")
def truncated_key() -> tuple[bytes, int]:
    return cut(base(), "kv2.key", 3, at="kv2.key_len")


@case("value type of 'victim.u32' needs 4 bytes but only 2 remain")
def truncated_value_type() -> tuple[bytes, int]:
    return cut(base(), "kv2.type", 2)


@case("value of 'victim.u32' needs 4 bytes but only 1 remain")
def truncated_value() -> tuple[bytes, int]:
    return cut(base(), "kv2.value", 1)


@case("value of 'victim.str' length 5 exceeds the 2 bytes that remain")
def truncated_string_value() -> tuple[bytes, int]:
    return cut(base(), "kv3.value", 2, at="kv3.value_len")


@case("element type of array 'victim.arr' needs 4 bytes")
def truncated_array_type() -> tuple[bytes, int]:
    return cut(base(), "kv4.arr_type", 2)


@case("length of array 'victim.arr' needs 8 bytes but only 5 remain")
def truncated_array_length() -> tuple[bytes, int]:
    return cut(base(), "kv4.arr_len", 5)


@case("array 'victim.arr' of 3 elements needs 12 bytes, only 5 remain")
def truncated_array_body() -> tuple[bytes, int]:
    return cut(base(), "kv4.arr_body", 5, at="kv4.arr_len")


@case("'victim.sarr'[1] length needs 8 bytes but only 7 remain")
def truncated_string_array_body() -> tuple[bytes, int]:
    return cut(base(), "kv5.arr_body", 17, at="kv5.arr_body", plus=10)


@case("name of tensor 0 length needs 8 bytes but only 3 remain")
def truncated_tensor_name_length() -> tuple[bytes, int]:
    return cut(base(), "t0.name_len", 3)


@case("name of tensor 0 length 2 exceeds the 1 bytes that remain")
def truncated_tensor_name() -> tuple[bytes, int]:
    return cut(base(), "t0.name", 1, at="t0.name_len")


@case("dimension count of tensor 't0' needs 4 bytes")
def truncated_dim_count() -> tuple[bytes, int]:
    return cut(base(), "t0.n_dims", 2)


@case("dimension 1 of tensor 't0' needs 8 bytes but only 4 remain")
def truncated_dims() -> tuple[bytes, int]:
    return cut(base(), "t0.dims", 12, plus=8)


@case("type of tensor 't1' needs 4 bytes but only 1 remain")
def truncated_tensor_type() -> tuple[bytes, int]:
    return cut(base(), "t1.type", 1)


@case("data offset of tensor 't1' needs 8 bytes but only 7 remain")
def truncated_tensor_offset() -> tuple[bytes, int]:
    return cut(base(), "t1.offset", 7)


@case("the data section would start at")
def truncated_before_data() -> tuple[bytes, int]:
    b = base()
    assert len(b.segments()[-2][1]) > 0, "the header must need padding for this case"
    return cut(b, "pad", 0)


@case("'t1' data (256 bytes at data offset 256) runs past the end of the file", cpp_refuses=False)
def truncated_tensor_data() -> tuple[bytes, int]:
    # gguf.cpp reads no data with no_alloc; llama-model-loader refuses it ("not within the file bounds")
    return cut(base(), "data", 256 + 100, at="t1.offset")


# --- counts and lengths larger than what remains ---------------------------------------------------


@case("tensor count 9223372036854775807 cannot fit")
def huge_tensor_count() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "n_tensors", INT64_MAX), "n_tensors")


@case("key/value count 9223372036854775807 cannot fit")
def huge_kv_count() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "n_kv", INT64_MAX), "n_kv")


@case("tensor count 3 cannot fit")  # 3 tensor infos cannot fit in what is left after the 6 keys
def tensor_count_past_the_end() -> tuple[bytes, int]:
    b = GGUFBytes(n_tensors=3)
    b.kv("general.architecture", STRING, "llama")
    return b.build(), 8


@case("tensor count -1 is negative")
def negative_tensor_count() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "n_tensors", -1), "n_tensors")


@case("key/value count -5 is negative")
def negative_kv_count() -> tuple[bytes, int]:
    return with_header(lambda b: setattr(b, "n_kv", -5), "n_kv")


@case("key 2 length 9223372036854775807 exceeds the maximum 1073741824")
def huge_key_length() -> tuple[bytes, int]:
    b = base()
    b.kvs[2][0] = ("kv2.key_len", b.pack("Q", INT64_MAX))
    return b.build(), b.marks()["kv2.key_len"]


@case("key 2 length 100000 exceeds the")
def key_length_past_the_end() -> tuple[bytes, int]:
    b = base()
    b.kvs[2][0] = ("kv2.key_len", b.pack("Q", 100_000))
    return b.build(), b.marks()["kv2.key_len"]


@case("value of 'victim.str' length 18446744073709551615 exceeds the maximum")
def huge_string_length() -> tuple[bytes, int]:
    b = base()
    b.kvs[3][3] = ("kv3.value_len", b.pack("Q", 2**64 - 1))
    return b.build(), b.marks()["kv3.value_len"]


@case("array 'victim.arr' has 9223372036854775807 elements, more than the maximum")
def huge_array_count() -> tuple[bytes, int]:
    b = base()
    b.kvs[4][4] = ("kv4.arr_len", b.pack("Q", INT64_MAX))
    return b.build(), b.marks()["kv4.arr_len"]


@case("array 'victim.arr' of 100000 elements needs 400000 bytes")
def array_count_past_the_end() -> tuple[bytes, int]:
    b = base()
    b.kvs[4][4] = ("kv4.arr_len", b.pack("Q", 100_000))
    return b.build(), b.marks()["kv4.arr_len"]


@case("array 'victim.sarr' of 100000000 strings cannot fit")
def string_array_count_past_the_end() -> tuple[bytes, int]:
    b = base()
    b.kvs[5][4] = ("kv5.arr_len", b.pack("Q", 100_000_000))
    return b.build(), b.marks()["kv5.arr_len"]


@case("'big'[300] length 4294967296 exceeds the")
def walked_string_past_the_end() -> tuple[bytes, int]:
    """In a vocab too big to keep (the skip_strings hot loop), one string's length lies."""
    b = GGUFBytes()
    b.kv_array("big", STRING, ["tok"] * 400)
    body = bytearray(b.kvs[0][5][1])
    body[300 * 11 : 300 * 11 + 8] = b.pack("Q", 2**32)
    b.kvs[0][5] = ("kv0.arr_body", bytes(body))
    return b.build(), b.marks()["kv0.arr_body"] + 300 * 11


@case("name of tensor 0 length 9223372036854775807 exceeds the maximum")
def huge_tensor_name_length() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][0] = ("t0.name_len", b.pack("Q", INT64_MAX))
    return b.build(), b.marks()["t0.name_len"]


# --- key/value types -----------------------------------------------------------------------------


@case("key 'victim.u32' has invalid GGUF type 13")
def unknown_value_type() -> tuple[bytes, int]:
    b = base()
    b.kvs[2][2] = ("kv2.type", b.pack("I", 13))
    return b.build(), b.marks()["kv2.type"]


@case("key 'victim.u32' has invalid GGUF type 4294967295")
def value_type_minus_one() -> tuple[bytes, int]:
    b = base()
    b.kvs[2][2] = ("kv2.type", b.pack("I", 0xFFFFFFFF))
    return b.build(), b.marks()["kv2.type"]


@case("array 'victim.arr' is nested")
def nested_array() -> tuple[bytes, int]:
    b = base()
    b.kvs[4][3] = ("kv4.arr_type", b.pack("I", V.ARRAY))
    return b.build(), b.marks()["kv4.arr_type"]


@case("array 'victim.arr' has invalid element type 99")
def unknown_array_element_type() -> tuple[bytes, int]:
    b = base()
    b.kvs[4][3] = ("kv4.arr_type", b.pack("I", 99))
    return b.build(), b.marks()["kv4.arr_type"]


@case("key 2 is empty")
def empty_key() -> tuple[bytes, int]:
    b = base()
    b.kvs[2] = GGUFBytes().kv("", V.UINT32, 7).kvs[0]
    b.kvs[2] = [(label.replace("kv0", "kv2"), v) for label, v in b.kvs[2]]
    return b.build(), b.marks()["kv2.key_len"]


@case("duplicate key 'victim.u32'")
def duplicate_key() -> tuple[bytes, int]:
    b = base()
    b.kv("victim.u32", V.UINT32, 8)
    return b.build(), b.marks()["kv6.key_len"]


@case("(GGUF keys are at most 65535)", cpp_refuses=False)  # the GGUF spec; gguf.cpp only caps at 1 GiB
def key_too_long() -> tuple[bytes, int]:
    b = base()
    b.kv("k" * 65536, V.UINT8, 1)
    return b.build(), b.marks()["kv6.key_len"]


# --- alignment -----------------------------------------------------------------------------------


def aligned(vtype: int, value: object) -> tuple[bytes, int]:
    b = base()
    b.kv("general.alignment", vtype, value)
    return b.build(), b.marks()["kv6.key_len"]


@case("general.alignment 0 is not a power of 2")
def alignment_0() -> tuple[bytes, int]:
    return aligned(V.UINT32, 0)


@case("general.alignment 3 is not a power of 2")
def alignment_3() -> tuple[bytes, int]:
    return aligned(V.UINT32, 3)


@case("general.alignment 96 is not a power of 2")
def alignment_96() -> tuple[bytes, int]:
    return aligned(V.UINT32, 96)


@case("general.alignment must be of type UINT32 but is UINT64")
def alignment_u64() -> tuple[bytes, int]:
    return aligned(V.UINT64, 32)


@case("general.alignment must be of type UINT32 but is INT32")
def alignment_i32() -> tuple[bytes, int]:
    return aligned(V.INT32, 32)


@case("general.alignment must be of type UINT32 but is STRING")
def alignment_string() -> tuple[bytes, int]:
    return aligned(STRING, "32")


# --- tensor infos --------------------------------------------------------------------------------


@case("tensor 1 name is 64 bytes, llama.cpp allows fewer than 64")
def tensor_name_64_bytes() -> tuple[bytes, int]:
    b = base()
    b.tensors[1] = [(label.replace("t0.", "t1."), v) for label, v in GGUFBytes().tensor("n" * 64, (32, 2)).tensors[0]]
    return b.build(), b.marks()["t1.name_len"]


@case("duplicate tensor name 't0'")
def duplicate_tensor_name() -> tuple[bytes, int]:
    b = base()
    b.tensor("t0", (32,))
    return b.build(), b.marks()["t2.name_len"]


@case("tensor 't0' has 5 dimensions, at most 4 are allowed")
def too_many_dims() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][2] = ("t0.n_dims", b.pack("I", 5))
    return b.build(), b.marks()["t0.n_dims"]


@case("tensor 't0' dimension 1 is negative (-2)")
def negative_dim() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][3] = ("t0.dims", b.pack("qq", 32, -2))
    return b.build(), b.marks()["t0.dims"] + 8


@case("has more than INT64_MAX elements")
def element_count_overflow() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][3] = ("t0.dims", b.pack("qq", 2**32, 2**32))
    return b.build(), b.marks()["t0.dims"]


@case("is more than SIZE_MAX bytes")
def byte_size_overflow() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][3] = ("t0.dims", b.pack("qq", 2**31, 2**31))  # 2**62 F32 elements: 2**64 bytes
    return b.build(), b.marks()["t0.type"]


@case("tensor 't0' has invalid ggml type 43")
def ggml_type_past_count() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][4] = ("t0.type", b.pack("I", 43))
    return b.build(), b.marks()["t0.type"]


@case("tensor 't0' has invalid ggml type -1")
def ggml_type_negative() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][4] = ("t0.type", b.pack("I", 0xFFFFFFFF))
    return b.build(), b.marks()["t0.type"]


@case("tensor 't0' has ggml type 4 (Q4_2), removed from ggml")
def ggml_type_removed_q4_2() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][4] = ("t0.type", b.pack("I", 4))
    return b.build(), b.marks()["t0.type"]


@case("tensor 't0' has ggml type 31 (Q4_0_4_4), removed from ggml")
def ggml_type_removed_q4_0_4_4() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][4] = ("t0.type", b.pack("I", 31))
    return b.build(), b.marks()["t0.type"]


@case("tensor 'q' of type Q4_K has 32 elements per row, not a multiple of its block size 256")
def row_not_multiple_of_block() -> tuple[bytes, int]:
    b = base()
    b.tensor("q", (32, 8), Q.Q4_K)
    return b.build(), b.marks()["t2.type"]


@case("tensor 't1' data offset 264 is not aligned to 32")
def misaligned_offset() -> tuple[bytes, int]:
    b = base()
    b.tensors[1][5] = ("t1.offset", b.pack("Q", 264))
    return b.build(), b.marks()["t1.offset"]


@case("tensor 't0' has data offset 256, expected 0")
def offsets_out_of_order() -> tuple[bytes, int]:
    b = base()
    b.tensors[0][5] = ("t0.offset", b.pack("Q", 256))
    b.tensors[1][5] = ("t1.offset", b.pack("Q", 0))
    return b.build(), b.marks()["t0.offset"]


@case("tensor 't1' has data offset 512, expected 256")
def offsets_with_a_gap() -> tuple[bytes, int]:
    b = base()
    b.tensors[1][5] = ("t1.offset", b.pack("Q", 512))
    b.data = b"\0" * 1024
    return b.build(), b.marks()["t1.offset"]


@case("'t1' data (256 bytes at data offset 256) runs past the end", cpp_refuses=False)
def tensor_data_past_eof() -> tuple[bytes, int]:
    b = base()
    b.data = b"\0" * 300
    return b.build(), b.marks()["t1.offset"]


@case("tensor 'huge' data (4398046511104 bytes at data offset 512) runs past", cpp_refuses=False)
def huge_tensor_past_eof() -> tuple[bytes, int]:
    b = base()
    b.tensor("huge", (1 << 20, 1 << 20), Q.F32)
    b.data = b"\0" * 512
    return b.build(), b.marks()["t2.offset"]


# --- the tests -----------------------------------------------------------------------------------


def test_corpus_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_malformed_header(c: Case, tmp_path: Path) -> None:
    data, offset = c.build()
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as info:
        read_header(path)
    e = info.value
    assert c.phrase in e.problem
    assert e.offset == offset, f"error at byte {e.offset}, expected {offset}: {e}"
    msg = str(e)
    assert msg.startswith(f"{path}: invalid GGUF at byte {offset}: ")
    assert "\n" not in msg and len(msg) < 500
    assert e.__cause__ is None and e.__context__ is None  # nothing chained behind the one line
    # the same bytes from memory give the same error
    with pytest.raises(GGUFError) as again:
        read_header_from(MemSource(data, str(path)))
    assert str(again.value) == msg


@pytest.mark.skipif(gguf_cpp() is None, reason="libggml-base (llama-cpp-python) not installed")
@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_gguf_cpp_agrees(c: Case) -> None:
    """gguf.cpp refuses each case too, except the few that llama.cpp refuses later (or the spec does)."""
    data, _ = c.build()
    verdict = gguf_cpp_read(data)
    if c.cpp_refuses:
        assert verdict is None, "gguf.cpp accepts this file"
    else:
        assert verdict is not None, "gguf.cpp refuses this file: mark it cpp_refuses=True"


def test_base_is_valid() -> None:
    """The victims' base file is itself valid, so each case fails for its own edit."""
    b = base()
    h = read_header_from(MemSource(b.build()))
    assert [t.name for t in h.tensors] == ["t0", "t1"]
    assert h.header_size == b.marks()["data"]
    if gguf_cpp() is not None:
        assert gguf_cpp_read(b.build()) is not None


def test_tensor_name_63_bytes_is_fine() -> None:
    b = minimal()
    b.tensor("n" * 63, (32,))
    assert read_header_from(MemSource(b.build())).tensors[-1].name == "n" * 63


def test_count_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """ggfit's caps on key/values and tensors (memory), which gguf.cpp does not have."""
    import fitter.gguf.reader as gr

    b = base()
    monkeypatch.setattr(gr, "MAX_KV", 5)
    with pytest.raises(GGUFError, match="key/value count 6 is more than ggfit reads") as info:
        read_header_from(MemSource(b.build()))
    assert info.value.offset == 16
    monkeypatch.setattr(gr, "MAX_KV", 6)
    monkeypatch.setattr(gr, "MAX_TENSORS", 1)
    with pytest.raises(GGUFError, match="tensor count 2 is more than ggfit reads") as info:
        read_header_from(MemSource(b.build()))
    assert info.value.offset == 8
    monkeypatch.setattr(gr, "MAX_TENSORS", 2)
    assert len(read_header_from(MemSource(b.build())).tensors) == 2


def test_type_unknown_to_gguf_py() -> None:
    """Q2_0 (ggml type 42) is valid for the reference llama.cpp but not in gguf-py 0.19: a clear GGFitError."""
    b = minimal()
    b.tensor("q2", (64,), 42)
    b.data = b"\0" * 4096
    with pytest.raises(UnsupportedModelError, match=r"ggml type 42 \(Q2_0\).*cannot size it"):
        read_header_from(MemSource(b.build()))


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="is a directory"):
        read_header(tmp_path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        read_header(tmp_path / "nope.gguf")


def test_not_a_regular_file() -> None:
    with pytest.raises(SourceError, match="not a regular file"):
        read_header("/dev/null")


def test_unreadable_path() -> None:
    with pytest.raises(SourceError):
        read_header("bad\0path.gguf")
    with pytest.raises(SourceError, match="unsupported URL scheme"):
        read_header("ftp://example.com/model.gguf")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path: Path) -> None:
    p = tmp_path / "locked.gguf"
    p.write_bytes(minimal().build())
    p.chmod(0)
    with pytest.raises(SourceError, match="cannot open"):
        read_header(p)


def test_all_errors_are_ggfit_errors() -> None:
    assert issubclass(GGUFError, GGFitError) and issubclass(SourceError, GGFitError)
