"""RunConfig <-> llama-server flags: one writer (to_server_args) and one reader (from_server_args), in the words of
the pinned build's common/arg.cpp."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.llama.cparams import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[2]

_VALUES = {
    "n_ctx": [None, 0, 4096], "n_batch": [None, 64, 2048], "n_ubatch": [None, 256], "type_k": ["f16", "q8_0"],
    "type_v": ["f16", "q4_0"], "flash_attn": ["auto", "on", "off"], "n_parallel": [None, -1, 1, 8],
    "kv_unified": [None, True, False], "swa_full": [None, True], "n_gpu_layers": [-1, 0, 12],
    "no_mmap": [False, True], "no_repack": [True, False], "embeddings": [False, True],
    "spec_type": ["none", "draft-simple", "draft-mtp"], "draft_model": [None, "/models/draft q8.gguf"],
    "draft_type_k": ["f16", "q8_0"], "draft_type_v": ["f16", "q4_0"], "draft_n_max": [3, 0, 16],
}


def _configs() -> list[RunConfig]:
    """Every value of every field once (the others at their defaults), then pairwise mixes of a few fields."""
    out = [RunConfig()]
    for field, values in _VALUES.items():
        out += [RunConfig(**{field: v}) for v in values]
    for (fa, va), (fb, vb) in itertools.combinations([(f, v) for f, vs in _VALUES.items() for v in vs[1:]], 2):
        if fa != fb:
            out.append(RunConfig(**{fa: va, fb: vb}))
    return out


def test_round_trip_every_field() -> None:
    configs = _configs()
    assert len(configs) > 300
    for cfg in configs:
        args = [w for g in cfg.to_server_args() for w in g]
        back, opts, unknown = RunConfig.from_server_args(args)
        assert (back, opts, unknown) == (cfg, {}, []), args


def test_swa_full_off_is_llama_server_default() -> None:
    # common/arg.cpp has --swa-full and no --no-swa-full: off writes nothing and reads back as the default
    assert RunConfig(swa_full=False).to_server_args() == [["--no-repack"]]


def test_model_paths_and_extra_flags() -> None:
    cfg = RunConfig(n_ctx=8192, no_mmap=True, spec_type="draft-simple", draft_model="d.gguf")
    args = cfg.to_server_args("m.gguf", draft_model="/abs/d.gguf", extra=[["-fit", "off"]])
    assert args == [["-m", "m.gguf"], ["-c", "8192"], ["-lm", "none"], ["--spec-type", "draft-simple"],
                    ["--spec-draft-n-max", "3"], ["-md", "/abs/d.gguf"], ["--no-repack"], ["-fit", "off"]]


def test_from_server_args_spellings_options_and_unknown_flags() -> None:
    cfg, opts, unknown = RunConfig.from_server_args(
        ["-c", "4096", "-ub", "256", "-ctk", "q8_0", "-fa", "on", "-np", "1", "--kv-unified", "-lm", "none",
         "--spec-type", "draft-simple", "-md", "/x.gguf", "--spec-draft-n-max", "5", "--draft-p-min", "0.5",
         "-t", "2", "--no-such-flag", "7", "--metrics", "--ctx-size=8192", "-ngl", "all", "-lm", "mlock"])
    assert (cfg.n_ctx, cfg.n_ubatch, cfg.type_k, cfg.flash_attn, cfg.n_parallel, cfg.kv_unified, cfg.no_mmap) == (
        8192, 256, "q8_0", "on", 1, True, True)
    assert (cfg.spec_type, cfg.draft_model, cfg.draft_n_max, cfg.n_gpu_layers) == ("draft-simple", "/x.gguf", 5, -1)
    assert opts == {"draft_p_min": 0.5, "threads": 2}
    assert unknown == ["--no-such-flag", "7", "--metrics", "-lm", "mlock"]


@pytest.mark.parametrize("args, message", [
    (["-ctk", "q4_K"], "^-ctk q4_K: unsupported cache type"),
    (["-c", "many"], "^-c: invalid value 'many'"),
    (["-c"], "^-c needs a value"),
    (["-lm"], "^-lm needs a value"),
    (["-t", "0"], "^-t 0: use 1 or more threads"),
    (["-b", "2"], r"^-b 2: llama.cpp needs n_batch >= n_seq_max \(4, -np 4 \(auto\)\)"),
])
def test_from_server_args_refuses_bad_values(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_server_args(args)


def test_fit_prints_flags_the_pinned_llama_server_takes() -> None:
    # the pinned build's llama-server has no --no-mmap (common/arg.cpp: -lm/--load-mode none); fit printed it
    out = subprocess.run([sys.executable, "cli.py", "fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu",
                          "-c", "4096", "--no-mmap", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    flags = json.loads(out.stdout)["flags"]
    assert "-lm none" in flags and "--no-mmap" not in flags
    back, _, unknown = RunConfig.from_server_args([w for f in flags for w in f.split()])
    assert unknown[:1] == ["-m"] and back.no_mmap and back.n_ctx == 4096
