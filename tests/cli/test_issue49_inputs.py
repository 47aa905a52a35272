"""Issue 49, item 8: inputs a new user gives, checked against what llama.cpp does with them."""

from __future__ import annotations

import json

import pytest

import cli
from fitter.bundled import resolve_model
from fitter.fit.memory import repack_applies
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from fitter.oracle.llama_run import LlamaParams, measure

M = "gemma3-270m"
B = ("--budget", "2GiB")


def _run(argv: list[str], capfd) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capfd.readouterr()
    return int(e.value.code or 0), out, err


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GGFIT_NO_SERVER_BUILD", "1")


# --- --no-repack only where llama.cpp's extra CPU buffer types can take a weight -------------------------------

def test_the_cpu_backend_offers_weights_to_the_extra_buffer_types():
    """On the CPU every matrix reaches the extra types (make_cpu_buft_list): llama.cpp's own dry run here puts a model
    buffer in one (AMX or CPU_REPACK on this machine) with use_extra_bufts, none without: --no-repack matters."""
    m = resolve_model(M)
    kinds = {}
    for extra in (False, True):
        r = measure(m, LlamaParams(n_ctx=1024, use_extra_bufts=extra), mode="dry", timeout=120)
        assert r.status == "ok", r.message
        kinds[extra] = {b.buffer for b in r.report.buffers if b.kind == "model"}
    assert kinds[False] <= {"CPU", "CPU_Mapped"}
    assert kinds[True] - {"CPU", "CPU_Mapped"}, kinds  # an extra buffer type took weights


@pytest.mark.parametrize("backend,flags,applies", [
    ("cpu", [], True),
    ("metal", [], False),  # every layer on MTL0: the token embedding (GET_ROWS) alone stays on the CPU
    ("metal", ["-ngl", "3"], True),  # CPU layers: no host buffer type before the extra ones (Metal has none)
    ("metal", ["-ot", "ffn_up=CPU"], True),
    ("cuda", [], False),
    ("cuda", ["-ngl", "3"], False),  # CUDA_Host comes first in the CPU list and takes every weight CUDA multiplies
])
def test_no_repack_is_printed_only_where_it_applies(backend, flags, applies, capfd):
    code, out, err = _run(["fit", M, *B, "--backend", backend, "-c", "4096", *flags, "--json"], capfd)
    assert code == 0, err
    printed = json.loads(out)["flags"]
    assert ("--no-repack" in printed) == applies, printed
    header, spec = load_model_spec(resolve_model(M))
    cfg = RunConfig.from_server_args(flags).config
    assert repack_applies(spec, cfg, Backend(backend)) == applies


# --- every GPU the flags use has a budget -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,phrase", [
    (["--budget", "2GiB,2GiB", "-ts", "1,1,1"], "-ts 1,1,1: 3 proportions, one for a GPU without a budget; "
                                                "--budget names 2 GPUs"),
    (["--budget", "2GiB", "-ts", "0,1"], "-ts 0,1: 2 proportions"),
    # llama_model_load: "invalid value for main_gpu: 5 (available devices: 1)"
    (["--budget", "2GiB", "-sm", "none", "-mg", "5"], "-mg 5: invalid value for main_gpu: 5 (available devices: 1)"),
    (["--budget", "2GiB,2GiB", "-sm", "none", "-mg", "2"], "invalid value for main_gpu: 2 (available devices: 2)"),
    (["--budget", "2GiB", "-mg", "1"], "-mg 1: GPU 1 has no budget"),
    # common/arg.cpp: llama_max_devices() is 16
    (["--budget", "2GiB", "-ts", ",".join(["1"] * 16)], "got 16 input configs, but system only has 16 devices"),
])
def test_a_gpu_without_a_budget_is_an_error(argv, phrase, capfd):
    code, out, err = _run(["fit", M, "--backend", "cuda", "-c", "4096", *argv], capfd)
    assert code == 2 and err.count("\n") == 1 and err.startswith("ggfit: error: ") and phrase in err, err


def test_metal_names_its_one_device(capfd):
    code, _, err = _run(["fit", M, "--backend", "metal", *B, "-c", "4096", "-ts", "1,1"], capfd)
    assert code == 2 and "Metal has one device (MTL0)" in err


@pytest.mark.parametrize("argv", [["--budget", "2GiB,2GiB", "-ts", "1,1"], ["--budget", "2GiB,2GiB", "-sm", "none",
                                                                            "-mg", "1"]])
def test_budgeted_gpus_are_fine(argv, capfd):
    code, out, err = _run(["fit", M, "--backend", "cuda", "-c", "4096", *argv, "--json"], capfd)
    assert code == 0, err
    assert set(json.loads(out)["device_totals"]) <= {"CUDA0", "CUDA1"}


# --- calibrate: an unwritable store is one line, before any dry run, and leaves nothing -----------------------------

def _no_dry_run(monkeypatch):
    import fitter.oracle.calibrate as oc

    def refuse(*a, **k):
        raise AssertionError("the store is checked before the dry runs")
    monkeypatch.setattr(oc, "calibrate", refuse)


@pytest.mark.parametrize("argv", [["calibrate", M, "--backend", "cpu"],
                                  ["calibrate", "--log", "tests/data/llama_logs/14-cuda-bunknown.log", M,
                                   "--llama-build", "b9430"]])
def test_calibrate_into_an_unwritable_store_is_one_line(argv, monkeypatch, capfd):
    monkeypatch.setenv("XDG_DATA_HOME", "/proc/nope")
    _no_dry_run(monkeypatch)
    code, out, err = _run(argv, capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("ggfit: error: cannot write the calibration store /proc/nope/ggfit/calibration.json")


def test_a_directory_in_place_of_the_store_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capfd):
    from fitter.fit import calibration

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    store = tmp_path / "ggfit" / "calibration.json"
    store.mkdir(parents=True)
    _no_dry_run(monkeypatch)
    code, _, err = _run(["calibrate", M, "--backend", "cpu"], capfd)
    assert code == 2 and "(a directory)" in err and err.count("\n") == 1, err
    with pytest.raises(calibration.CalibrationError, match="a directory"):
        calibration._write(store, {})  # the writer itself, past the check: no calibration.tmp left beside it
    with pytest.raises(calibration.CalibrationError, match="a directory"):
        calibration.clear()
    assert sorted(p.name for p in store.parent.iterdir()) == ["calibration.json"]


def test_clear_with_nothing_stored_says_so_plainly(capfd):
    code, out, _ = _run(["calibrate", "--clear"], capfd)
    assert code == 0 and out.startswith("no calibration stored (") and "in all" not in out


# --- --llama-server PATH: the same file for --llama-build auto as for probe ------------------------------------------

@pytest.mark.parametrize("given", ["./llama-server", "llama-server"])
def test_a_relative_llama_server_is_the_file_in_the_working_directory(given, tmp_path, monkeypatch, capfd):
    """probe's find_llama_server takes the file relative to the working directory; so does --llama-build auto
    (str(Path("./llama-server")) is "llama-server", which exec looked up on PATH)."""
    exe = tmp_path / "llama-server"
    exe.write_text('#!/bin/sh\necho "version: 9430 (0123456789ab)" >&2\necho "built with cc for x86_64" >&2\n')
    exe.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no llama-server there
    from search.server import find_llama_server

    assert find_llama_server(given) == str(exe)
    code, out, err = _run(["fit", M, *B, "--backend", "cpu", "-c", "4096", "--llama-build", "auto",
                           "--llama-server", given, "--json"], capfd)
    assert code == 0, err
    assert json.loads(out)["llama_build"]["label"].startswith("llama.cpp b9430")


# --- the other engine's flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,phrase", [
    (["fit", "x.gguf", "--kv-bits", "4"], "--kv-bits 4: mlx-lm's (--engine mlx), not llama.cpp's"),
    (["fit", M, *B, "--max-kv-size", "4096", "--prefill-step-size", "512"],
     "--max-kv-size 4096, --prefill-step-size 512: mlx-lm's"),
    (["fit", "--engine", "mlx", "dir", "-ctk", "q8_0", "-np", "8"], "-ctk q8_0, -np 8: llama.cpp's, not mlx-lm's"),
    (["fit", "--engine", "mlx", "dir", "--no-mmap", "-ngl", "0"], "-ngl 0, --no-mmap: llama.cpp's"),
])
def test_the_other_engines_flags_are_refused(argv, phrase, capfd):
    code, _, err = _run(argv, capfd)
    assert code == 2 and err.count("\n") == 1 and phrase in err, err


# --- --check with another --llama-build compares like with like ---------------------------------------------------

def test_check_with_another_build_compares_the_pinned_dry_run_with_the_pinned_prediction(capfd):
    """b8999 computes logits for every token of the ubatch (+486 MiB here); the dry run is the pinned build's: its
    rows are set beside ggfit's prediction for the pinned build, and the output says so."""
    code, out, err = _run(["fit", M, *B, "--backend", "cpu", "-c", "8192", "--check", "--llama-build", "b8999",
                           "--json"], capfd)
    assert code == 0, err
    doc = json.loads(out)
    check = doc["check"]
    assert all(r["predicted_bytes"] == r["measured_bytes"] for r in check["rows"]), check["rows"]
    assert any("the dry run is the pinned llama.cpp b11312" in n and "not llama.cpp b8999" in n for n in check["notes"])
    shown = next(b["bytes"] for b in doc["buffers"] if b["owner"] == "target" and b["kind"] == "compute")
    measured = next(r["measured_bytes"] for r in check["rows"] if r["kind"] == "compute")
    assert shown > measured  # the table itself stays b8999's


# --- --llama-build: one range, the tables' own, for every form ------------------------------------------------------

def test_every_form_of_llama_build_has_the_tables_range():
    """Dates, build numbers and a log's build line: one range, the oldest build ggfit models to the pin."""
    import datetime as dt

    from fitter.llama_builds import OLDEST, PINNED, BuildError, resolve_build

    day = dt.timedelta(days=1)
    for ok in (OLDEST.date, PINNED.date):
        assert resolve_build(ok.isoformat()).date == ok
    for bad in (OLDEST.date - day, PINNED.date + day, dt.date(2020, 1, 1), dt.date(2099, 1, 1)):
        with pytest.raises(BuildError, match=f"--llama-build {bad}: outside the builds ggfit can date and model"):
            resolve_build(bad.isoformat())
    for ok_n in (OLDEST.number, PINNED.number):
        assert resolve_build(f"b{ok_n}").number == ok_n
    assert OLDEST.number is not None and PINNED.number is not None
    for bad_n in (1, OLDEST.number - 1, PINNED.number + 1):
        with pytest.raises(BuildError, match=f"--llama-build b{bad_n}: outside the builds ggfit can date and model"):
            resolve_build(f"b{bad_n}")
    # a log's or a binary's build line: the same range for its date
    with pytest.raises(BuildError, match="outside the builds ggfit can date and model"):
        resolve_build(None, number=PINNED.number + 5, date=PINNED.date + 30 * day)


@pytest.mark.parametrize("value", ["2020-01-01", "2099-01-01", "b1"])
def test_llama_build_out_of_range_is_one_line(value, capfd):
    code, _, err = _run(["fit", M, *B, "--backend", "cpu", "-c", "4096", "--llama-build", value], capfd)
    assert code == 2 and err.count("\n") == 1 and f"--llama-build {value}: outside the builds ggfit" in err, err


# --- a pasted llama-server command line ------------------------------------------------------------------------------

def test_fit_ignores_llama_server_flags_that_change_no_memory_and_says_so(capfd):
    base = ["fit", M, *B, "--backend", "cpu", "-c", "4096", "--json"]
    code, plain, _ = _run(base, capfd)
    assert code == 0
    pasted = ["-tb", "8", "--port", "8080", "-cb", "--jinja", "--temp", "0.7", "--host=0.0.0.0", "-a", "gemma",
              "--metrics", "-to", "600", "--seed", "1", "-v", "--api-key", "k", "--slots", "--top-k", "40"]
    code, out, err = _run(base + pasted, capfd)
    assert code == 0, err
    assert json.loads(out) == json.loads(plain)  # the same prediction
    assert err == ("ggfit: note: ignored (no effect on memory): -tb 8 --port 8080 -cb --jinja --temp 0.7 "
                   "--host=0.0.0.0 -a gemma --metrics -to 600 --seed 1 -v --api-key k --slots --top-k 40\n")


def test_fit_takes_t_for_the_speed_model_not_as_an_ignored_flag(capfd):
    """-t is llama.cpp's threads: the speed model's CPU side reads it (issue 46), so it is no longer ignored."""
    base = ["fit", M, *B, "--backend", "cpu", "-c", "4096", "--json", "--hardware", "cpu",
            "--host-bandwidth", "50GB/s"]
    code, plain, _ = _run(base + ["-t", "1"], capfd)
    code2, out, err = _run(base + ["-t", "8"], capfd)
    assert code == code2 == 0 and not err
    one, eight = json.loads(plain), json.loads(out)
    assert one.pop("speed") != eight.pop("speed") and one == eight  # the rates move, the memory does not


@pytest.mark.parametrize("argv,phrase", [
    (["-cram", "0"], "-cram 0: a llama-server flag that changes memory, which ggfit does not model"),
    (["--fit", "off"], "--fit off: a llama-server flag that changes memory"),
    (["-tb"], "-tb needs a value"),
    (["-t"], "-t' requires an argument"),
])
def test_llama_server_flags_ggfit_cannot_ignore_are_one_line(argv, phrase, capfd):
    code, _, err = _run(["quants", M, *B, *argv], capfd)
    assert code == 2 and err.count("\n") == 1 and phrase in err, err


def _help_flags(binary: str) -> dict[str, bool]:
    """llama-server --help's flags and whether each takes a value ("-t,    --threads N   number of ...")."""
    import re
    import subprocess

    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    out: dict[str, bool] = {}
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        left = re.split(r"(?<![,\s])\s{2,}", line.strip(), maxsplit=1)[0]
        tokens = [t for t in re.split(r",?\s+", left) if t]
        names = [t for t in tokens if t.startswith("-")]
        for n in names:
            out[n] = len(tokens) > len(names)
    return out


def test_the_flag_tables_are_the_pinned_llama_servers(llama_server):
    """Every flag fit ignores or refuses is one of the pinned llama-server's (--mlock: older builds'), with the same
    arity."""
    from cli_options import NO_MEMORY_FLAGS, NOT_MODELLED_FLAGS

    helped = _help_flags(llama_server)
    for table in (NO_MEMORY_FLAGS, NOT_MODELLED_FLAGS):
        for name, takes in table.items():
            if name == "--mlock":
                continue
            assert name in helped, name
            assert helped[name] == takes, name


# --- wording ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,phrase", [
    (["quants", M, *B, "--candidate", "bad=x"], "--candidate bad=x: no such file"),
    (["fit", M, "--budget", "1e30MiB"], "--budget '1e30MiB': too large (at most 8,388,608 TiB)"),
    (["fit", M, "--budget", "2GiB", "--margin", "1e3"], "--margin 1e3: a size needs a unit (did you mean 1e3MiB?)"),
    (["optimise", M, *B, "--storage", "sqlite:////dev/null/x.db"], "/dev/null is not a directory"),
    (["report", "s1", "--storage", "sqlite:////dev/null/x.db"], "/dev/null is not a directory"),
    (["optimise", M, "/tmp", *B, "--engine", "llama,mlx", "--storage", "x.db"], "--storage does not apply"),
])
def test_the_words_of_one_line_errors(argv, phrase, capfd):
    code, _, err = _run(argv, capfd)
    assert code == 2 and err.count("\n") == 1 and phrase in err, err


def test_sizes_read_as_the_readme_says():
    from fitter.fit.budget import parse_size

    assert parse_size("1.5e3MiB") == 1500 * 2**20 and parse_size("26.8GB") == 26_800_000_000
    assert parse_size("0") == 0  # zero alone is zero in every unit (--margin 0)


@pytest.mark.parametrize("retried,line", [
    ([0], "[ggfit] trial 0 was cut short (its process died or was interrupted): retried first"),
    ([3, 5], "[ggfit] trials 3, 5 were cut short (their process died or was interrupted): retried first"),
])
def test_cut_short_trials_are_counted_in_words(retried, line):
    from types import SimpleNamespace

    from search.study.run import _announce

    said: list[str] = []
    plan = SimpleNamespace(trials_goal=3, budget=SimpleNamespace(bytes=2**30), margin_bytes=0, avail=2**30,
                           space=SimpleNamespace(dims=[]), notes=[])
    _announce(said.append, plan, "s", "sqlite:///x.db", retried)
    assert said[0] == line


def test_a_pasted_m_model_is_the_model(capfd):
    code, plain, _ = _run(["fit", M, *B, "--backend", "cpu", "-c", "4096", "--json"], capfd)
    code2, out, err = _run(["fit", "-m", M, *B, "--backend", "cpu", "-c", "4096", "--json", "-tb", "8"], capfd)
    assert code == code2 == 0 and json.loads(out) == json.loads(plain)
    assert err == "ggfit: note: ignored (no effect on memory): -tb 8\n"
