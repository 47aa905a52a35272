"""fitter.llama_builds: naming a llama.cpp build (--llama-build), reading it from a binary or a log, and which of the
memory changes (fitter.llama_builds.changes) it has."""

from __future__ import annotations

import datetime as dt
import os
from importlib import metadata
from pathlib import Path

import pytest

from fitter.llama_builds import (
    CHANGES,
    PINNED,
    RELEASES,
    BuildError,
    _dist_info_version,
    installed_llama_cpp_python,
    resolve_build,
)
from fitter.llama_builds.identify import build_from_text, build_in_text, build_of_binary

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests/data/llama_logs"


@pytest.mark.parametrize("value", [None, "pinned", "b11312", "11312", "0.3.36", "0c1e570", "0c1e57098bba"])
def test_every_name_of_the_pinned_build_is_the_pinned_build(value):
    b = resolve_build(value)
    assert b == PINNED and b.is_pinned and b.differences() == []


def test_release_versions_name_their_vendored_commit():
    for r in RELEASES:
        b = resolve_build(r.version)
        assert b.commit == r.commit and b.date == r.date and b.number == r.number


def test_a_build_number_between_known_builds_gets_an_estimated_date():
    b = resolve_build("b9430")  # between b9102 (2026-05-10) and b9525 (2026-06-05)
    assert b.date_estimated and dt.date(2026, 5, 10) < b.date < dt.date(2026, 6, 5)
    exact = resolve_build("b9525")
    assert not exact.date_estimated and exact.date == dt.date(2026, 6, 5)


@pytest.mark.parametrize("value, words", [
    ("b1", "outside the builds ggfit can date"),
    ("b99999", "outside the builds ggfit can date"),
    ("0.2.9", "ggfit knows the llama.cpp of llama-cpp-python"),
    ("deadbeef", "does not know this commit"),
    ("2026-13-45", "not a date"),
    ("june", "expected a build number"),
])
def test_a_build_ggfit_cannot_place_is_one_clear_error(value, words):
    with pytest.raises(BuildError, match=words):
        resolve_build(value)


def test_has_follows_dates_and_reverts():
    """#21277 (SWA cache f16 only) lived one day, 2026-04-01, before its revert #21332: of the releases only 0.3.20
    (2026-04-02's commit f49e917, taken before the revert) has it... as the recordings show."""
    assert resolve_build("2026-04-01").has("swa_cache_f16_only")
    # the revert was merged on 2026-04-02 after f49e917 (0.3.20): a build of that day is taken to have #21277
    assert resolve_build("0.3.20").has("swa_cache_f16_only") and resolve_build("2026-04-02").has("swa_cache_f16_only")
    assert not resolve_build("2026-04-03").has("swa_cache_f16_only")
    assert not PINNED.has("swa_cache_f16_only")
    assert not resolve_build("0.3.23").has("logits_whole_ubatch") and resolve_build("0.3.25").has("logits_whole_ubatch")
    assert PINNED.has("logits_whole_ubatch") != PINNED.flip("logits_whole_ubatch").has("logits_whole_ubatch")


def test_the_change_table_is_well_formed():
    ids = [c.id for c in CHANGES]
    assert len(ids) == len(set(ids))
    for c in CHANGES:
        assert c.backend in ("all", "CPU", "CUDA", "Metal") and c.before
        assert c.window is None or c.window[0] < c.window[1]
        assert c.until is None or (c.until > c.date and c.after)
        assert c.date <= PINNED.date


@pytest.mark.parametrize("text, number, commit", [
    ("version: 0.5.0-dev (build 0, commit 0c1e57098bba)", None, "0c1e57098bba"),  # a build outside git
    ("common_params_print_info: build 9625 (f05cf4676) with cc for x86_64", 9625, "f05cf4676"),
    ("version: 9525 (ad1b88ca0)\nbuilt with cc for x86_64", 9525, "ad1b88ca0"),
    ("main: build: 8284 (00de61534) with MSVC 19.44 for x64", 8284, "00de61534"),
    ("version: b9010-d05fe1d7d", 9010, "d05fe1d7d"),
    ("# build: 1234 (not this: a comment)\nllama_context: n_ctx = 4096", None, None),
])
def test_build_lines(text, number, commit):
    found = build_in_text(text)
    assert (found is None and number is None and commit is None) or found == (number, commit)


def test_a_shallow_clone_s_build_is_its_commit_s():
    """The whole llama-cpp-python sdist vendors llama.cpp as a one-commit shallow clone: a build from it says
    "build 1" (git rev-list --count), and its commit says which build it is."""
    assert build_from_text("version: 0.5.0-dev (build 1, commit 0c1e57098bba)", "--version").is_pinned
    assert build_from_text("version: 0.5.0-dev (build 0, commit 0c1e57098bba)", "--version").is_pinned


def test_public_logs_name_their_builds():
    """The build lines of the public logs in tests/data/llama_logs (their headers give the build too)."""
    b = build_from_text((LOGS / "01-cuda-b9525.log").read_text(), "01-cuda-b9525.log")
    assert (b.number, b.date) == (9525, dt.date(2026, 6, 5)) and not b.is_pinned
    b = build_from_text((LOGS / "10-metal-b9010.log").read_text(), "10-metal-b9010.log")
    assert b.number == 9010 and b.date_estimated


def test_a_log_without_a_build_line_says_how_to_give_the_build():
    with pytest.raises(BuildError, match="--llama-build bNNNN"):
        build_from_text("llama_context: n_ctx = 4096\n", "server.log")


def test_the_pinned_llama_server_says_it_is_the_pinned_build(llama_server):
    # (the fixture builds it on a new machine: a skipif on the cached binary skipped it on the first CI there)
    assert build_of_binary(llama_server).is_pinned


def test_a_binary_that_is_not_one(tmp_path):
    f = tmp_path / "llama-server"
    f.write_text("not a program")
    with pytest.raises(BuildError, match="not an executable"):
        build_of_binary(f)
    f.write_text("#!/bin/sh\necho 'version: 9625 (f05cf4676)'\n")
    os.chmod(f, 0o755)
    b = build_of_binary(f)
    assert (b.number, b.date) == (9625, dt.date(2026, 6, 13))


def test_installed_version_is_importlib_metadatas(monkeypatch, tmp_path):
    assert installed_llama_cpp_python() == metadata.version("llama-cpp-python")
    # the first dist-info on sys.path wins, as importlib.metadata's path finder has it; an egg's defers to it
    first = tmp_path / "first"
    (first / "llama_cpp_python-9.9.9.dist-info").mkdir(parents=True)
    (first / "llama_cpp_python-9.9.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.9.9\n\nVersion: 1.0\n")
    (first / "llama_cpp_python_extra-1.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(first))
    assert _dist_info_version("llama_cpp_python") == "9.9.9" == metadata.version("llama-cpp-python")
    egg = tmp_path / "egg"
    (egg / "llama_cpp_python.egg-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(egg))
    assert _dist_info_version("llama_cpp_python") is None
