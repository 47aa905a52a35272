"""Builds back to mid 2025 (issue 49, item 4): b6000 .. b7380 are dated from llama.cpp's release history
(fitter.llama_builds.changes.ANCHORS: tags with their commits and dates from public material) and modelled with that era's
rules; older builds are refused with one line that gives the range."""

from __future__ import annotations

import datetime as dt

import pytest

from fitter.llama_builds import (
    ANCHORS,
    OLDEST,
    OLDEST_BUILD_NUMBER,
    PINNED,
    BuildError,
    build_range,
    resolve_build,
)
from fitter.llama_builds.identify import build_from_text


@pytest.mark.parametrize("value", ["b6000", "6000", "b6500", "b7217", "b7379"])
def test_a_build_number_of_mid_2025_is_dated_and_modelled(value):
    b = resolve_build(value)
    assert dt.date(2025, 7, 1) < b.date < dt.date(2025, 12, 14)
    assert b.differences()  # an older era: rules the pinned build does not have


def test_b6000_is_the_oldest_build_and_has_the_era_before_set_rows():
    b = resolve_build("b6000")
    assert b.number == OLDEST_BUILD_NUMBER == OLDEST.number and b.date == OLDEST.date and b.date_estimated
    assert b.commit == "4762ad7316dcdec20016ab5985fb46a27902204d"  # the b6000 tag (Homebrew's formula)
    # between b5857 (<= 2025-07-10) and b6082 (<= 2025-08-04)
    assert dt.date(2025, 7, 10) < b.date < dt.date(2025, 8, 4)
    assert not b.has("kv_set_rows_default") and not b.has("fa_default_auto")
    assert resolve_build("0.3.15").has("kv_set_rows_default")  # b6110: LLAMA_SET_ROWS defaults to 1


def test_b6500_uses_the_rules_of_september_2025():
    b = resolve_build("b6500")
    assert b.date == dt.date(2025, 9, 17) and not b.date_estimated  # a tag date (shamitv/llama_cpp's release list)
    assert b.has("kv_set_rows_default") and b.has("fa_default_auto") and b.has("max_seq_256")
    assert not b.has("kv_size_pad_backend") and not b.has("embd_input_always")


@pytest.mark.parametrize("value, number", [
    ("4762ad73", 6000),  # a prefix of the b6000 tag's commit
    ("4762ad7316dcdec20016ab5985fb46a27902204d", 6000),
    ("ef0144c0", 6085),
    ("9a963895", 6110),  # llama-cpp-python 0.3.15's llama.cpp
    ("9515c6131", 6097),  # longer than the anchor's prefix
    ("c5023daf607c", 6940),
])
def test_a_commit_of_mid_2025_names_its_build(value, number):
    b = resolve_build(value)
    assert b.number == number and b.commit.startswith(value[:8]) and b.date < dt.date(2025, 12, 1)


def test_a_commit_prefix_two_known_builds_share_is_an_error():
    from fitter.llama_builds import _by_commit  # the prefix rule itself: no two known commits share 7 digits today
    assert _by_commit("4762ad7").number == 6000
    with pytest.raises(BuildError, match="several known builds"):
        _by_commit("")


@pytest.mark.parametrize("text, number", [
    ("version: 6000 (4762ad73)\nbuilt with cc (GCC) 13.3.0 for x86_64-linux-gnu", 6000),
    ("version: 6500 (abcdef12)\nbuilt with Apple clang version 17.0.0 for arm64-apple-darwin24", 6500),
    ("main: build: 7217 (0a1b2c3d4) with MSVC 19.44 for x64", 7217),
])
def test_a_version_line_of_mid_2025_is_dated(text, number):
    b = build_from_text(text, "llama-server --version")
    assert b.number == number and dt.date(2025, 7, 1) < b.date < dt.date(2025, 12, 14) and not b.is_pinned


@pytest.mark.parametrize("value", ["b5000", "5999", "b11313"])
def test_a_build_outside_the_range_is_refused_with_the_range(value):
    with pytest.raises(BuildError) as e:
        resolve_build(value)
    msg = str(e.value)
    assert "\n" not in msg and build_range() in msg and "b6000" in msg and "b11312" in msg


def test_a_commit_before_the_range_is_refused_with_the_range():
    with pytest.raises(BuildError, match=r"79e0b68c: build b5904, outside the builds ggfit can date and model \(b6000"):
        resolve_build("79e0b68c")  # llama-cpp-python 0.3.14's llama.cpp


def test_a_version_line_before_the_range_is_refused():
    with pytest.raises(BuildError, match="outside the builds ggfit can date and model"):
        build_from_text("version: 5000 (abc1234)\nbuilt with cc for x86_64", "llama-server --version")


def test_the_range_is_public():
    assert build_range() == f"b{OLDEST.number} (~{OLDEST.date}) .. b{PINNED.number} ({PINNED.date})"
    assert OLDEST.date < PINNED.date and OLDEST.number < PINNED.number


def test_the_anchors_are_consistent():
    """Numbers grow with dates; every anchor names a source; commits are hex and unique."""
    dated = sorted((a.number, a.date) for a in ANCHORS if a.date is not None)
    assert all(d1 <= d2 for (_, d1), (_, d2) in zip(dated, dated[1:]))
    assert all(a.source and (a.date or a.commit) for a in ANCHORS)
    commits = [a.commit for a in ANCHORS if a.commit]
    assert all(len(c) >= 7 and int(c, 16) >= 0 for c in commits) and len(set(commits)) == len(commits)
    assert any(a.number <= OLDEST_BUILD_NUMBER and a.date for a in ANCHORS)  # b6000 is dated from both sides


def test_builds_before_n_cpu_moe_get_an_ngl_placement():
    """--n-cpu-moe came with b6089 (#15077): for an older build the solver lowers -ngl instead of proposing a flag
    that llama-server would refuse."""
    from fitter.fit.solver import solve_placement
    from fitter.llama.cparams import Backend, Frontend, RunConfig
    from fitter.llama.model import load_model_spec
    from tests.synth.shapes import build_shape, q4_k_m_types

    header, spec = load_model_spec(str(build_shape("gpt-oss-20b", tensor_types=q4_k_m_types("gpt-oss-20b"))))
    levers = {}
    for b in ("b6088", "b6089"):
        choice, _ = solve_placement(header, spec, RunConfig(n_ctx=8192), Backend.CUDA, Frontend.SERVER, 6 * 2**30, None,
                                    table=False, build=resolve_build(b))
        assert choice is not None
        levers[b] = choice.lever
    assert levers == {"b6088": "n_gpu_layers", "b6089": "n_cpu_moe"}


def test_llama_server_of_2025_defaults_to_one_slot():
    """-np auto (4 slots, unified KV) came with #16736 (b7079 has it): an older llama-server runs one slot, without a
    unified cache, when -np is not given (0.3.16 common_params: n_parallel 1, kv_unified false)."""
    from fitter.llama.cparams import Frontend, RunConfig, resolve_context
    from fitter.llama.model import load_model_spec
    from tests.synth import build as synth

    _, spec = load_model_spec(str(synth("gemma3")))
    old = resolve_context(spec, RunConfig(n_ctx=4096), Frontend.SERVER, build=resolve_build("b6500"))
    new = resolve_context(spec, RunConfig(n_ctx=4096), Frontend.SERVER, build=resolve_build("b7090"))
    assert (old.n_seq_max, old.kv_unified) == (1, False) and "n_parallel" in old.defaults_applied
    assert (new.n_seq_max, new.kv_unified) == (4, True)
    given = resolve_context(spec, RunConfig(n_ctx=4096, n_parallel=4, kv_unified=True), Frontend.SERVER,
                            build=resolve_build("b6500"))
    assert (given.n_seq_max, given.kv_unified) == (4, True)
