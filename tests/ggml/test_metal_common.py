"""Metal's graph_optimize reorder (fitter.ggml.backends.metal.common) on small graphs, each expectation read off
ggml-metal-common.cpp's ggml_metal_graph_optimize_reorder and ggml_mem_ranges_check. The reorder on real graphs is
checked through what it changes, the compute buffer: tests/fit/test_seed_figures.py (the August draft's steps) and
tests/oracle/test_user_log.py (a Metal llama-server log of b8999, exact)."""

from __future__ import annotations

from fitter.ggml.backends.metal.common import cache_ranges, reorder
from fitter.ggml.sched import graph_uses
from fitter.ggml.tensor import IS_WEIGHT, CacheTensor, Tensor
from fitter.ggml.types import F32
from fitter.llama_builds import PINNED, resolve_build

OLD = resolve_build("0.3.35")  # packs ADD / NORM / RMS_NORM runs only


def t(op: str, *src: Tensor, name: str = "", vs: Tensor | None = None, ne: tuple = (64, 8, 1, 1)) -> Tensor:
    x = Tensor(op, F32, list(ne), [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]], src, vs, name)
    x.sid = 0
    return x


def weight(name: str) -> Tensor:
    w = Tensor("NONE", F32, [64, 64, 1, 1], [4, 256, 16384, 16384], (), None, name, ext=True)
    w.w = IS_WEIGHT
    return w


def cache(name: str, buf: tuple) -> CacheTensor:
    c = CacheTensor("NONE", F32, [64, 64, 1, 1], [4, 256, 16384, 16384], (), None, name, ext=True)
    c.buf = buf
    return c


def run(nodes: list[Tensor], build=OLD) -> list[str]:
    return [n.name for n in reorder(nodes, graph_uses(nodes), cache_ranges(nodes, Tensor.nbytes, 32), build)]


def test_an_independent_matmul_joins_the_running_set() -> None:
    x = t("NONE", name="x")
    a = t("MUL_MAT", weight("w0"), x, name="a")
    b = t("ADD", a, a, name="b")  # reads a: a barrier before it
    c = t("MUL_MAT", weight("w1"), x, name="c")  # reads only x and a weight: moved up beside a
    assert run([a, b, c]) == ["a", "c", "b"]


def test_the_look_ahead_stops_at_an_op_it_may_not_move() -> None:
    x = t("NONE", name="x")
    a = t("MUL_MAT", weight("w0"), x, name="a")
    b = t("ADD", a, a, name="b")
    s = t("SOFT_MAX", x, name="s")  # not in h_safe: nothing after it is looked at
    c = t("MUL_MAT", weight("w1"), x, name="c")
    assert run([a, b, s, c]) == ["a", "b", "s", "c"]


def test_a_node_that_reads_what_a_skipped_node_writes_stays_behind_it() -> None:
    x = t("NONE", name="x")
    a = t("MUL_MAT", weight("w0"), x, name="a")
    b = t("ADD", a, a, name="b")
    c = t("MUL", b, x, name="c")  # reads b, which is not moved: it may not pass b
    d = t("MUL_MAT", weight("w1"), x, name="d")
    assert run([a, b, c, d]) == ["a", "d", "b", "c"]


def test_every_kv_tensor_of_one_cache_overlaps_in_the_dry_run() -> None:
    """A dry run's KV cache has a dummy buffer and no data pointer: every K and V tensor of it spans [0, size), so a
    store into layer 0's K keeps a read of layer 3's K from moving past it; another cache's buffer does not."""
    x = t("NONE", name="x")
    k0, k3 = cache("cache_k_l0", ("kv", 0)), cache("cache_k_l3", ("kv", 0))
    swa = cache("cache_k_l1", ("kv", 1))  # the SWA cache: a buffer of its own
    a = t("MUL_MAT", weight("w0"), x, name="a")
    store = t("SET_ROWS", a, x, k0, name="store", vs=k0)  # writes into k0, reads a: a barrier
    read3 = t("GET_ROWS", t("VIEW", k3, vs=k3), x, name="read3")
    read_swa = t("GET_ROWS", t("VIEW", swa, vs=swa), x, name="read_swa")
    names = run([a, store, read3, read_swa])
    assert names.index("read_swa") < names.index("store") < names.index("read3")


def test_recurrent_states_are_at_their_offsets_and_touching_ranges_overlap_one_way() -> None:
    """r_l and s_l are allocated one after the other: [0, R) and [R, R + S). ggml_mem_ranges_check tests a range
    against the set's with `p0 < cmp.p1 && p1 >= cmp.p0`: r against s overlaps (r's end is s's start), s against r
    does not. So a read of r may not pass a write of s, but a read of s passes a write of r."""
    x = t("NONE", name="x")
    r, s = cache("cache_r_l0", ("rs", 0, 0)), cache("cache_s_l0", ("rs", 0, 1))
    ranges = cache_ranges([t("CPY", x, r, vs=r), t("CPY", x, s, vs=s)], Tensor.nbytes, 32)
    assert ranges[id(r)][1:] == (0, 16384) and ranges[id(s)][1:] == (16384, 32768)
    a = t("MUL_MAT", weight("w0"), x, name="a")
    write_r = t("CPY", a, t("VIEW", r, vs=r), name="write_r", vs=r)  # reads a: a barrier
    read_s = t("GET_ROWS", t("VIEW", s, vs=s), x, name="read_s")
    assert run([a, write_r, read_s]) == ["a", "read_s", "write_r"]
    write_s = t("CPY", a, t("VIEW", s, vs=s), name="write_s", vs=s)
    read_r = t("GET_ROWS", t("VIEW", r, vs=r), x, name="read_r")
    assert run([a, write_s, read_r]) == ["a", "write_s", "read_r"]


def test_a_fused_norm_moves_as_one_and_what_it_computes_is_not_its_source_since_the_fusion_table() -> None:
    x = t("NONE", name="x")
    a = t("MUL_MAT", weight("w0"), x, name="a")
    b = t("ADD", a, a, name="b")
    n = t("RMS_NORM", x, name="n")
    m = t("MUL", n, weight("norm_w"), name="m")  # RMS_NORM + MUL: one pack, moved together
    for build in (OLD, PINNED):
        assert run([a, b, n, m], build) == ["a", "n", "m", "b"]
