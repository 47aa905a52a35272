"""Issue 11, inputs: what ggfit approves, llama.cpp runs (and the reverse), checked against llama.cpp
itself; the clamped values ggfit prints; the training-context warning; help text for every option."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.model import load_model_spec
from fitter.oracle.llama_run import LlamaParams, measure

ROOT = Path(__file__).resolve().parents[2]


def ggfit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def gemma_spec(gemma):
    return load_model_spec(gemma)[1]


@pytest.mark.slow
@pytest.mark.parametrize("frontend", [Frontend.SERVER, Frontend.LIBRARY])
def test_n_batch_below_n_seq_max_is_refused_exactly_where_llama_cpp_aborts(gemma, gemma_spec, frontend):
    """llama_context::llama_context calls output_reserve(n_seq_max), which asserts n_seq_max <= n_outputs_max,
    and n_outputs_max is at most n_batch. ggfit refuses -b 3 with 4 sequences and approves -b 4; llama.cpp's
    own dry run aborts on the first and builds the second, with the parameters ggfit resolved."""
    for b, ok in ((3, False), (4, True)):
        cfg = RunConfig(n_ctx=1024, n_batch=b, n_ubatch=1, n_parallel=4, kv_unified=True)
        if ok:
            cp = resolve_context(gemma_spec, cfg, frontend)
            n_out = cp.n_outputs_max
        else:
            with pytest.raises(ConfigError, match=r"^-b 3: .*n_batch >= n_seq_max"):
                resolve_context(gemma_spec, cfg, frontend)
            n_out = b if frontend == Frontend.SERVER else 0  # server_output_limits: min(n_batch, slots); library: 0
        run = measure(gemma, LlamaParams(n_ctx=1024, n_batch=b, n_ubatch=1, n_seq_max=4, n_outputs_max=n_out,
                                         kv_unified=True, load_mode="none"), mode="dry", timeout=120, log_level="info")
        if ok:
            assert run.status == "ok", run.message
        else:
            assert run.status == "crash" and "n_outputs_max <= cparams.n_outputs_max" in (run.message or "")


def test_tiny_context_names_c(gemma_spec):
    # llama.cpp caps n_batch at the unpadded n_ctx, so -c 1 with 4 slots leaves n_batch 1 < n_seq_max 4
    with pytest.raises(ConfigError, match=r"^-c 1: llama.cpp caps n_batch at n_ctx \(1\)"):
        resolve_context(gemma_spec, RunConfig(n_ctx=1), Frontend.SERVER)
    cp = resolve_context(gemma_spec, RunConfig(n_ctx=1, n_parallel=1), Frontend.SERVER)
    assert (cp.n_ctx, cp.n_batch, cp.n_ubatch) == (256, 1, 1)


@pytest.mark.parametrize("field, value, flag", [
    ("n_ctx", 2**31, "-c 2147483648"), ("n_ctx", -1, "-c -1"), ("n_batch", 0, "-b 0"), ("n_ubatch", 2**40, "-ub"),
    ("n_parallel", 0, "-np 0"), ("n_parallel", -5, "-np -5"), ("n_parallel", 257, "-np 257"),
    ("draft_n_max", -1, "--spec-draft-n-max -1"), ("type_k", "q9", "-ctk q9"), ("flash_attn", "maybe", "-fa maybe"),
])
def test_run_config_errors_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError) as e:
        RunConfig(**{field: value})
    msg = str(e.value)
    assert msg.startswith(flag) and "\n" not in msg and field not in msg


def test_run_config_checks_every_field():
    """RunConfig.__post_init__ checks each field (fitter.llama.cparams._CHECKS), in the fields' order."""
    from fitter.llama.cparams import _CHECKS

    assert list(_CHECKS) == list(RunConfig.model_fields)


def test_run_config_normalises_what_llama_server_reads():
    cfg = RunConfig(type_k="Q8_0", override_tensor=["exps=CPU,blk.0=CPU"], tensor_split=[3, 1],
                    lora=[["a.gguf", 1]])
    assert (cfg.type_k, cfg.override_tensor, cfg.tensor_split, cfg.lora) == \
        ("q8_0", ("exps=CPU", "blk.0=CPU"), (3.0, 1.0), (("a.gguf", 1.0),))
    assert hash(cfg) == hash(RunConfig(type_k="q8_0", override_tensor=("exps=CPU", "blk.0=CPU"),
                                       tensor_split=(3.0, 1.0), lora=(("a.gguf", 1.0),)))
    for kw, line in [({"n_ctx": "4096"}, "-c 4096: use a valid integer"),
                     ({"n_ctx": True}, "-c on: use a valid integer"),
                     ({"no_mmap": 1}, "--no-mmap 1: use a valid boolean"),
                     ({"split_mode": "rows"}, "-sm rows: use 'none', 'layer', 'row' or 'tensor'")]:
        with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
            RunConfig(**kw)


def test_int32_limit_is_llama_servers():
    RunConfig(n_ctx=2**31 - 1, n_batch=2**31 - 1, n_ubatch=2**31 - 1)  # std::stoi takes these
    RunConfig(n_parallel=-1)
    RunConfig(n_parallel=256)


def test_huge_ubatch_is_printed_clamped_in_text_and_flags(gemma):
    """-ub 99999999 without -b: llama.cpp caps n_ubatch at n_batch, 2048 by default (llama_context::llama_context);
    the table's column, the recommendation and the flags say the -ub it runs (issue 49: not a -b ggfit raised)."""
    out = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-ub", "99999999")
    assert out.returncode == 0, out.stderr
    rec = re.search(r"recommended: -c (\d+) -ub (\d+)", out.stdout)
    flag_ub = re.search(r"^\s+-ub (\d+)", out.stdout, re.M)
    flag_b = re.search(r"^\s+-b (\d+)", out.stdout, re.M)
    assert rec and flag_ub and flag_b, out.stdout
    assert rec.group(2) == flag_ub.group(1) == flag_b.group(1) == "2048"
    assert re.search(r"^  -ctk/-ctv +-ub 2048 $", out.stdout, re.M), out.stdout
    assert "capped   -ub 99999999 -> 2048 " in out.stdout  # says so once, in the header
    assert "99999999" not in out.stdout.split("capped", 1)[1].split("\n", 1)[1]


def test_capped_batch_is_said_and_flagged(gemma):
    out = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "8192", "-ub", "4096")
    assert out.returncode == 0, out.stderr
    assert "capped   -ub 4096 -> 2048 " in out.stdout and re.search(r"^\s+-ub 2048 ", out.stdout, re.M)


def test_context_above_training_warns_once(gemma):
    out = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "65536", "--json")
    assert out.returncode == 0
    assert out.stderr.splitlines() == [
        "ggfit: warning: n_ctx_seq (65536) > n_ctx_train (32768) -- possible training context overflow "
        "(llama-server caps each slot at n_ctx_train)"]
    json.loads(out.stdout)
    quiet = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "32768")
    assert quiet.returncode == 0 and quiet.stderr == ""


COMMANDS = ["inspect", "fit", "quants", "optimise", "report", "calibrate", "probe", "hardware"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_whole_names_at_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "…" not in text and "Traceback" not in text
    cmd = cli.typer.main.get_command(cli.app).commands[command]
    for p in cmd.params:
        if p.param_type_name == "option":
            assert p.help, f"{command} {p.opts} has no help"
            for name in [*p.opts, *p.secondary_opts]:
                assert re.search(rf"(^|[\s,/]){re.escape(name)}([\s,/]|$)", text, re.M), (command, name)
        else:
            assert p.help, f"{command} {p.name} has no help"


def test_shared_options_are_one_definition():
    """-c, -b, -ub, -ctk, -ctv, -fa, -np, --budget, --margin, --backend ... read the same in every command."""
    cmds = cli.typer.main.get_command(cli.app).commands
    seen: dict[str, tuple[str, str]] = {}
    for name, cmd in cmds.items():
        for p in cmd.params:
            if p.param_type_name != "option" or name == "probe" and "--budget" in p.opts:
                continue  # probe's --budget is a memory limit for the probe, not the fit budget
            key = p.opts[0]
            if key in seen:
                assert seen[key] == (p.help, "/".join(p.opts)), (key, name, seen[key])
            seen[key] = (p.help, "/".join(p.opts))
    for flag in ("-c", "-b", "-ub", "-ctk", "-ctv", "-fa", "-np", "--budget", "--margin", "--backend", "-md",
                 "--storage", "--runner", "--llama-server"):
        assert flag in seen, flag


def test_readme_has_exit_codes_and_plots_extra():
    text = (ROOT / "README.md").read_text()
    assert re.search(r"Exit codes.*0.*1.*2.*130", text, re.S)
    assert "pip install -e '.[plots]'" in text
