"""fitter.session.server: llama-server's prompt cache and checkpoints over a session, against the numbers the
pinned llama-server printed for the bundled Gemma 3 270M (-lv 4: "created context checkpoint ... size",
"saving prompt ... total state size", "cache state: N prompts, X MiB"), and `fit`'s session line and JSON."""

from __future__ import annotations

import json

import pytest

import cli
from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from fitter.session.server import MIB, CacheFlags, checkpoint_positions, server_session

M = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma():
    header, spec = load_model_spec(resolve_model(M))
    return spec, predict(header, spec, RunConfig(n_ctx=8192)).context


def test_checkpoints_are_made_4_plus_ubatch_and_4_tokens_before_the_prompt_end():
    """update_slots' checkpoint_offsets {4 + n_ubatch, 4}: the first batch leaves nothing to checkpoint."""
    assert checkpoint_positions(600, 2048, 512, 32) == [84, 596]
    assert checkpoint_positions(300, 2048, 512, 32) == [296]
    assert checkpoint_positions(4, 2048, 512, 32) == []
    assert checkpoint_positions(600, 2048, 512, 1) == [596]  # --ctx-checkpoints 1 keeps the last
    assert checkpoint_positions(600, 2048, 512, 0) == []
    assert checkpoint_positions(5000, 2048, 512, 32) == [4484, 4996]


def test_sizes_are_the_ones_llama_server_printed(gemma):
    """600-token prompts, 8 generated (n_tokens 607): the log's 9.292 MiB state, 1.232 and 7.506 MiB checkpoints
    (the SWA cache: 84 cells, then n_swa = 512) and 18.030 MiB per cached prompt."""
    spec, cp = gemma
    s = server_session(spec, cp, 600, 8, [1, 2, 4])
    assert round(s.state_bytes / MIB, 3) == 9.292
    assert [round(c / MIB, 3) for c in s.checkpoints] == [1.232, 7.506]
    assert [round(p.cache_bytes / MIB, 3) for p in s.points] == [0.0, 18.03, 54.089]
    assert [p.cache_entries for p in s.points] == [0, 1, 3]  # a slot is saved when the next request starts


def test_the_ceiling_follows_cache_ram(gemma):
    spec, cp = gemma
    entry = server_session(spec, cp, 600, 8, [1]).entry_bytes
    capped = server_session(spec, cp, 600, 8, [10], CacheFlags(cache_ram_mib=64))
    assert capped.limit.cache_entries == 64 * MIB // entry == capped.points[0].cache_entries == 3
    nolimit = server_session(spec, cp, 600, 8, [50], CacheFlags(cache_ram_mib=-1))
    assert nolimit.limit.cache_entries == 8192 // 607  # -1: at most n_ctx tokens (limit_tokens = n_ctx)
    assert nolimit.points[0].cache_entries == 8192 // 607
    off = server_session(spec, cp, 600, 8, [10], CacheFlags(cache_ram_mib=0))
    assert off.limit.cache_bytes == 0 and off.limit.checkpoint_bytes == 4 * sum(off.checkpoints)  # each slot its own
    default = server_session(spec, cp, 600, 8, [1])
    assert default.limit.cache_entries == 8192 * MIB // entry


def _run(capfd, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capfd.readouterr()
    return int(e.value.code or 0), out, err


def test_fit_shows_the_session_and_proposes_a_cap(capfd):
    base = ["fit", M, "--budget", "2GiB", "-c", "8192", "--backend", "cpu", "--no-speed"]
    code, out, err = _run(capfd, *base, "--json", "--session-prompt", "4096", "--session-gen", "256")
    assert code == 0, err
    s = json.loads(out)["session"]
    assert s["fits"] is False and s["ceiling_entries"] == 231 and s["counts_against"] == "budget"
    (prop,) = s["proposals"]
    assert prop["flags"][0] == "--cache-ram" and prop["ceiling_bytes"] <= s["headroom_bytes"]
    code, out, err = _run(capfd, *base, "--json", "-cram", prop["flags"][1], "--session-prompt", "4096")
    assert code == 0 and json.loads(out)["session"]["fits"] is True
    code, out, err = _run(capfd, *base, "-cram", "0")
    assert code == 0 and "session  llama-server" in out and "--cache-ram off" in out and "fits the" in out


def test_quants_still_refuses_the_cache_flags(capfd):
    code, _, err = _run(capfd, "quants", M, "--budget", "2GiB", "-c", "4096", "--cache-ram", "64")
    assert code == 2 and "does not model" in err


@pytest.mark.parametrize("argv,phrase", [
    (["--session-prompt", "5000"], "--session-prompt 5000 + --session-gen 256 exceed a slot's context"),
    (["--session-gen", "0"], "--session-gen"),
])
def test_a_session_longer_than_a_slot_is_one_line(argv, phrase, capfd):
    code, _, err = _run(capfd, "fit", M, "--budget", "2GiB", "-c", "4096", "--no-speed", *argv)
    assert code == 2 and err.count("\n") == 1 and phrase in err, err


def test_a_draft_travels_with_the_saved_prompt_and_its_checkpoints():
    """server_slot::prompt_save and create_checkpoint's update_dft, as logged on a synthetic gemma3 with a gemma3
    draft (benchmarks/session_here.py's sgemma-p2000-draft): 20.128 MiB per state, 11.262 MiB per checkpoint."""
    from benchmarks.session_here import DRAFT, predicted

    s = predicted({"model": "synth-gemma3", "n_ctx": 16384, "prompt": 2000, "gen": 8, "flags": DRAFT}, [3])
    assert round(s.state_bytes / MIB, 3) == 20.128 and [round(c / MIB, 3) for c in s.checkpoints] == [11.262] * 2
    assert round(s.points[0].cache_bytes / MIB, 3) == 85.304


@pytest.mark.parametrize("flags", [CacheFlags(), CacheFlags(cache_ram_mib=-1), CacheFlags(cache_ram_mib=0),
                                   CacheFlags(cache_ram_mib=40, cache_idle_slots=False),
                                   CacheFlags(cache_ram_mib=100, ctx_checkpoints=1)])
@pytest.mark.parametrize("n_parallel, kv_unified", [(None, None), (1, False), (3, False), (2, True)])
def test_the_points_past_a_cycle_are_the_simulated_ones(flags, n_parallel, kv_unified):
    """server._run reads the points after a repeating cycle of requests off the cycle: the same as simulating every
    request up to the last asked."""
    from fitter.session import server

    header, spec = load_model_spec(resolve_model(M))
    cp = predict(header, spec, RunConfig(n_ctx=8192, n_parallel=n_parallel, kv_unified=kv_unified)).context
    entry, ckpt = 18 * MIB, 9 * MIB
    args = (cp.n_seq_max, cp.n_ctx, flags, cp.kv_unified, entry, 607, ckpt)
    wanted = [1, 2, 3, 5, 8, 13, 40, 99, 100, 101, 257]
    assert server._run(wanted, *args) == server._run(wanted, *args, repeat=False)
