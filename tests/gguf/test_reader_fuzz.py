"""Mutation fuzzing of the header reader: tens of thousands of damaged copies of a small valid file
(bit flips, byte insertions and deletions, truncations, length and count fields overwritten with huge
values). The only exceptions ever raised are ggfit's (GGUFError, SourceError; UnsupportedModelError for
a ggml type gguf-py does not know), memory per parse stays bounded, and, where libggml-base is
installed, ggfit accepts exactly the files gguf.cpp accepts and reads them the same way.

Deterministic: a fixed seed for the mutation loop, derandomized hypothesis.
"""

from __future__ import annotations

import random
import struct
import time
import tracemalloc
from collections import Counter
from typing import Callable

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fitter.gguf.cursor as gc
import fitter.gguf.reader as gr
from fitter.errors import GGUFError, SourceError, UnsupportedModelError
from fitter.gguf.reader import GGUFHeader, SkippedArray, read_header_from
from tests.gguf_bytes import STRING, GGUFBytes, MemSource, gguf_cpp, gguf_cpp_read

SEED = 20240607
N_MUTATIONS = 10_000  # with the small-window runs: 13,750 mutated files, plus 600 from hypothesis
PEAK_LIMIT = 3 << 20  # bytes of Python heap one parse may allocate at its peak
EXPECTED = (GGUFError, SourceError, UnsupportedModelError)

HUGE = [2**64 - 1, 2**63 - 1, 2**63, 2**62, 2**32, 2**32 - 1, 2**31, 2**30 + 1, 2**30, 2**20, 65536, 4097, 255, 64,
        63, 5, 4, 1, 0]


def seed_file() -> GGUFBytes:
    """Small but exercising every path: scalars of each type, kept and walked arrays, several tensor types."""
    b = GGUFBytes(alignment=32)
    b.kv("general.architecture", STRING, "llama")
    b.kv("general.alignment", V.UINT32, 32)
    b.kv("general.name", STRING, "fuzz")
    b.kv("llama.block_count", V.UINT32, 2)
    b.kv("t.i8", V.INT8, -3)
    b.kv("t.u16", V.UINT16, 7)
    b.kv("t.f32", V.FLOAT32, 0.5)
    b.kv("t.bool", V.BOOL, True)
    b.kv("t.u64", V.UINT64, 1 << 40)
    b.kv("t.i64", V.INT64, -1)
    b.kv("t.f64", V.FLOAT64, 2.5)
    b.kv_array("t.kept_u32", V.UINT32, [4, 4])
    b.kv_array("t.kept_str", STRING, ["a", "bb", ""])
    b.kv_array("tokenizer.ggml.tokens", STRING, [f"t{i}" * (i % 4) for i in range(gc.KEEP_STRING_ARRAY_MAX + 20)])
    b.kv_array("t.walked_i16", V.INT16, [1] * 40)  # walked once KEEP_ARRAY_MAX is lowered below
    b.tensor("token_embd.weight", (32, 2), Q.F32)
    b.tensor("blk.0.attn_q.weight", (256, 1), Q.Q4_K)
    b.tensor("blk.0.ffn_up.weight", (32, 2, 1), Q.Q8_0)
    b.tensor("output_norm.weight", (32,), Q.F16)
    return b


SEED_FILE = seed_file()
SEED_BYTES = SEED_FILE.build()
# Fields worth lying in: every length, count, dimension, type and offset.
FIELDS = [(label, off, len(v)) for (label, v), off in
          zip(SEED_FILE.segments(), [SEED_FILE.marks()[l] for l, _ in SEED_FILE.segments()])
          if len(v) in (4, 8) and label.split(".")[-1] in
          {"n_tensors", "n_kv", "key_len", "value_len", "type", "arr_type", "arr_len", "name_len", "n_dims", "offset", "version"}]
FIELDS += [(f"t{i}.dims", SEED_FILE.marks()[f"t{i}.dims"] + 8 * j, 8) for i in range(4) for j in range(1)]


# --- mutators ------------------------------------------------------------------------------------

def flip_bits(rng: random.Random, d: bytearray) -> None:
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        i = rng.randrange(len(d) * 8)
        d[i // 8] ^= 1 << (i % 8)


def flip_header_bits(rng: random.Random, d: bytearray) -> None:
    """Bit flips where they matter: in the header, not the zeroed tensor data."""
    i = rng.randrange(min(len(d), SEED_FILE.marks()["pad"]) * 8)
    d[i // 8] ^= 1 << (i % 8)


def insert_bytes(rng: random.Random, d: bytearray) -> None:
    i = rng.randrange(len(d) + 1)
    d[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 1, 2, 3, 4, 8, 17))))


def delete_bytes(rng: random.Random, d: bytearray) -> None:
    i = rng.randrange(len(d))
    del d[i : i + rng.choice((1, 1, 2, 3, 4, 8, 17))]


def truncate(rng: random.Random, d: bytearray) -> None:
    del d[rng.randrange(len(d)) :]


def lie_in_field(rng: random.Random, d: bytearray) -> None:
    """Overwrite a length/count/type/offset field with a huge or boundary value (either byte order)."""
    label, off, size = rng.choice(FIELDS)
    if off + size > len(d):
        return
    v = rng.choice(HUGE + [len(d) - off, len(d) - off + 1, len(d) - off - 1, rng.randrange(2 ** (8 * size))])
    v %= 2 ** (8 * size)
    d[off : off + size] = v.to_bytes(size, rng.choice(("little", "little", "big")))


def overwrite_window(rng: random.Random, d: bytearray) -> None:
    size = rng.choice((4, 8))
    i = rng.randrange(max(1, len(d) - size))
    d[i : i + size] = (rng.choice(HUGE) % 2 ** (8 * size)).to_bytes(size, "little")


MUTATORS: list[Callable[[random.Random, bytearray], None]] = [
    flip_bits, flip_header_bits, flip_header_bits, insert_bytes, delete_bytes, truncate, lie_in_field, lie_in_field,
    overwrite_window,
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    d = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not d:
            break
        rng.choice(MUTATORS)(rng, d)
    return bytes(d)


# --- the oracle ----------------------------------------------------------------------------------

ORACLE = gguf_cpp() is not None


def check_one(data: bytes) -> str:
    """Parse once; return the outcome's kind. Fails on any non-ggfit exception or disagreement with gguf.cpp."""
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        h = read_header_from(MemSource(data, "fuzz.gguf"))
        outcome, err = "ok", None
    except EXPECTED as e:
        outcome, err, h = type(e).__name__, e, None
        msg = str(e)
        assert "\n" not in msg and len(msg) < 1000, msg
    _, peak = tracemalloc.get_traced_memory()
    assert peak - base < PEAK_LIMIT, f"parse peaked at {peak - base} bytes"
    if not ORACLE:
        return outcome
    cpp = gguf_cpp_read(data)
    if h is not None:
        if cpp is None:
            # gguf.cpp refuses a file of the other byte order; ggfit reads it on purpose.
            assert h.shards[0].byte_order == ">", "ggfit accepts a file gguf.cpp refuses"
            return "ok-big-endian"
        assert_same(h, cpp)
    elif cpp is not None:
        # ggfit may refuse more than gguf.cpp only where llama.cpp's loader (or the spec, or gguf-py) does.
        assert isinstance(err, UnsupportedModelError) or (
            isinstance(err, GGUFError)
            and any(p in err.problem for p in ("runs past the end of the file", "GGUF keys are at most", "more than ggfit reads"))
        ), f"gguf.cpp accepts what ggfit refuses: {err}"
        return outcome + "-loader-check"
    return outcome


def assert_same(h: GGUFHeader, cpp) -> None:  # noqa: ANN001
    s = h.shards[0]
    assert cpp.version == s.version
    assert cpp.alignment == s.alignment
    assert cpp.data_offset == s.data_offset
    # gguf.cpp hands names out as C strings: they end at the first NUL byte
    assert cpp.keys == tuple(k.split("\0", 1)[0] for k in h.metadata)
    assert cpp.tensors == tuple((t.name.split("\0", 1)[0], int(t.ggml_type), t.offset, t.nbytes) for t in h.tensors)


@pytest.fixture
def traced():
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.fixture(params=[1 << 20, 64, 9], ids=["window-1MiB", "window-64", "window-9"])
def window(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Read windows small enough that mutated fields straddle their boundaries; walked arrays kept small."""
    monkeypatch.setattr(gc, "READ_CHUNK", request.param)
    monkeypatch.setattr(gc, "KEEP_ARRAY_MAX", 16)
    return request.param


def test_seed_file_is_valid() -> None:
    h = read_header_from(MemSource(SEED_BYTES))
    assert h.metadata["tokenizer.ggml.tokens"] == SkippedArray(V.STRING, gc.KEEP_STRING_ARRAY_MAX + 20)
    assert len(h.tensors) == 4
    if ORACLE:
        cpp = gguf_cpp_read(SEED_BYTES)
        assert cpp is not None
        assert_same(h, cpp)


def test_mutations(traced: None, window: int) -> None:
    rng = random.Random(SEED + window)
    n = {1 << 20: N_MUTATIONS, 64: N_MUTATIONS // 4}.get(window, N_MUTATIONS // 8)
    outcomes: Counter[str] = Counter()
    t0 = time.perf_counter()
    for i in range(n):
        data = mutate(rng, SEED_BYTES)
        try:
            outcomes[check_one(data)] += 1
        except BaseException as e:
            raise AssertionError(f"mutation {i} (seed {SEED + window}): {type(e).__name__}: {e}\nbytes: {data.hex()}") from e
    elapsed = time.perf_counter() - t0
    print(f"\n{n} mutations, window {window}: {dict(outcomes)} in {elapsed:.1f} s")
    # the mutations reach deep: many are refused, but some survive as valid files
    assert outcomes["ok"] > n // 50
    assert sum(v for k, v in outcomes.items() if k.startswith("GGUFError")) > n // 2


@settings(derandomize=True, database=None, max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(SEED_BYTES) - 1), st.sampled_from(["set8", "set4", "insert", "delete", "cut"]),
                  st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=9)),
        min_size=1, max_size=4,
    )
)
def test_hypothesis_edits(edits: list[tuple[int, str, int, bytes]]) -> None:
    d = bytearray(SEED_BYTES)
    for pos, op, value, blob in edits:
        pos = min(pos, len(d))
        if op == "set8":
            d[pos : pos + 8] = value.to_bytes(8, "little")
        elif op == "set4":
            d[pos : pos + 4] = (value % 2**32).to_bytes(4, "little")
        elif op == "insert":
            d[pos:pos] = blob
        elif op == "delete":
            del d[pos : pos + len(blob)]
        else:
            del d[pos:]
    tracemalloc.start()
    try:
        check_one(bytes(d))
    finally:
        tracemalloc.stop()


# --- memory on big (virtual) inputs ---------------------------------------------------------------


class VirtualSource:
    """A huge file that exists only as a header prefix followed by a repeating pattern."""

    def __init__(self, prefix: bytes, pattern: bytes, size: int):
        self.prefix, self.pattern, self.size = prefix, pattern, size
        self.name = "virtual.gguf"
        self.bytes_fetched = 0

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        out = bytearray()
        if offset < len(self.prefix):
            out += self.prefix[offset : offset + n]
        rest = n - len(out)
        if rest > 0:
            start = (offset + len(out) - len(self.prefix)) % len(self.pattern)
            reps = (start + rest) // len(self.pattern) + 1
            out += (self.pattern * reps)[start : start + rest]
        self.bytes_fetched += len(out)
        return bytes(out)

    def close(self) -> None:
        pass


def test_huge_vocab_walk_is_bounded(traced: None) -> None:
    """2 million tokens (a 28 MiB array) are walked with a bounded window, not kept."""
    n = 2_000_000
    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")
    b.kv_array("tokenizer.ggml.tokens", STRING, [], count=n)
    prefix = b.build()
    token = struct.pack("<Q", 6) + b"token!"
    src = VirtualSource(prefix, token, len(prefix) + n * len(token))
    tracemalloc.reset_peak()
    h = read_header_from(src)
    _, peak = tracemalloc.get_traced_memory()
    assert h.metadata["tokenizer.ggml.tokens"] == SkippedArray(V.STRING, n)
    assert h.header_size == src.size
    assert peak < 3 * gc.READ_CHUNK + (1 << 20), peak


def test_huge_string_value_is_not_read(traced: None) -> None:
    """A 900 MiB string value is skipped without being fetched."""
    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")
    b.kv("big", STRING, "", value_len=900 << 20)
    prefix = b.build()
    src = VirtualSource(prefix, b"x", len(prefix) + (900 << 20))
    tracemalloc.reset_peak()
    h = read_header_from(src)
    _, peak = tracemalloc.get_traced_memory()
    assert h.metadata["big"] == gr.SkippedString(900 << 20)
    assert src.bytes_fetched <= len(prefix) + gc.READ_CHUNK
    assert peak < 2 * gc.READ_CHUNK + (1 << 20)


def test_many_kept_arrays_hit_the_budget(traced: None) -> None:
    """Many arrays each small enough to keep: the whole-header budget caps what is kept."""
    count, each = 200, gc.KEEP_ARRAY_MAX  # 200 x 16384 u32 = 12.5 MiB in the file
    b = GGUFBytes()
    b.kv("general.architecture", STRING, "llama")
    body = struct.pack(f"<{each}I", *range(each))
    for i in range(count):
        b.kv_array(f"a{i}", V.UINT32, [], count=each, raw_body=body)
    data = b.build()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    h = read_header_from(MemSource(data))
    _, peak = tracemalloc.get_traced_memory()
    peak -= base
    kept = [k for k, v in h.metadata.items() if isinstance(v, list)]
    assert len(kept) * each <= gc.KEEP_TOTAL_ELEMENTS
    assert all(isinstance(h.metadata[f"a{i}"], SkippedArray) for i in range(len(kept), count))
    # a kept u32 costs ~36 bytes as a Python int in a list; the budget bounds the total
    assert peak < gc.KEEP_TOTAL_ELEMENTS * 40 + 4 * gc.READ_CHUNK
