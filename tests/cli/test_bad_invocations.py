"""Issue 11's sweep: every bad invocation of every command ends in exactly one line on stderr,
`ggfit: error: ...`, and exit code 2; never a traceback, never llama.cpp's own log lines, and never
after loading a model (they are bad inputs: they fail first).

The bulk runs in-process (cli.main with the fd-level stderr captured, so a line printed by llama.cpp's
C code would show); a representative subset runs through `python3 cli.py` as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from tests.gguf_bytes import minimal

ROOT = Path(__file__).resolve().parents[2]
M = "gemma3-270m"  # the bundled real model: a good file, so that the error is the option's
B = ("--budget", "2GiB")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Broken model files, a study database with one (non-ggfit) study, and an existing plain file."""
    import optuna

    d = tmp_path_factory.mktemp("bad")
    (d / "empty.gguf").write_bytes(b"")
    (d / "text.gguf").write_text("this is not a model\n")
    (d / "dir.gguf").mkdir()
    good = minimal().build()
    (d / "trunc.gguf").write_bytes(good[: len(good) // 2])  # cut inside the header
    (d / "magic.gguf").write_bytes(b"GGUX" + good[4:])
    (d / "notes.txt").write_text("a file, not a directory\n")
    db = d / "studies.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s1", storage=f"sqlite:///{db}")
    return {
        "missing": str(d / "missing.gguf"), "empty": str(d / "empty.gguf"), "text": str(d / "text.gguf"),
        "dir": str(d / "dir.gguf"), "trunc": str(d / "trunc.gguf"), "magic": str(d / "magic.gguf"),
        "file": str(d / "notes.txt"), "db": f"sqlite:///{db}", "tmp": str(d),
    }


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Studies and calibrations go to a fresh XDG_DATA_HOME; no test builds llama-server."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GGFIT_NO_SERVER_BUILD", "1")
    monkeypatch.setenv("COLUMNS", "80")


BAD_FILES = ("missing", "empty", "text", "dir", "trunc", "magic")
COMMANDS = (("inspect",), ("fit", *B), ("quants", *B), ("calibrate", "--backend", "cpu"), ("probe",),
            ("optimise", *B))

# (argv, a phrase the error line must contain); "{name}" is replaced by the fixture's path
CASES: list[tuple[tuple[str, ...], str]] = []
for _cmd in COMMANDS:
    for _f in BAD_FILES:
        CASES.append(((*_cmd, "{%s}" % _f), "{%s}" % _f))
CASES += [
    # a bad file given to an option
    (("fit", M, *B, "-md", "{empty}"), "{empty}"),
    (("fit", M, *B, "--model-draft", "{text}"), "{text}"),
    (("probe", M, "-md", "{trunc}"), "{trunc}"),
    (("quants", M, *B, "-md", "{missing}"), "{missing}"),
    (("quants", M, *B, "--candidate", "X=notasize"), "notasize"),
    (("optimise", M, *B, "--draft", "{dir}"), "{dir}"),
    # units
    (("fit", M, "--budget", "25559"), "25559MiB"),
    (("fit", M, "--budget", "24G"), "unknown unit 'G'"),
    (("fit", M, "--budget", "lots"), "--budget"),
    (("fit", M, "--budget", "-1GiB"), "negative"),
    (("fit", M, "--budget", "0"), "more than zero"),
    (("fit", M, "--budget", "1.5"), "1.5MiB"),
    (("fit", M, *B, "--margin", "512"), "512MiB"),
    (("fit", M, *B, "--margin", "auto"), "--margin"),
    (("fit", M, *B, "--margin", "-5MiB"), "--margin"),
    (("fit", M, "--budget", "1GiB", "--margin", "2GiB"), "leaves nothing"),
    (("quants", M, "--budget", "1GiB", "--margin", "1GiB"), "leaves nothing"),
    (("optimise", M, "--budget", "1GiB", "--margin", "2GiB"), "leaves nothing"),
    (("quants", M, "--budget", "25559"), "25559MiB"),
    (("quants", M, *B, "--margin", "100"), "100MiB"),
    (("optimise", M, "--budget", "25559"), "25559MiB"),
    (("optimise", M, *B, "--margin", "100"), "100MiB"),
    (("probe", M, "--budget", "2048"), "2048MiB"),
    (("probe", M, "--budget", "0"), "--budget"),
    (("probe", M, "--budget", "2G"), "--budget"),
    # ranges: what llama.cpp refuses, reads as something else, or aborts on
    (("fit", M, *B, "-c", "-1"), "-c -1"),
    (("fit", M, *B, "-c", "99999999999"), "-c 99999999999"),
    (("fit", M, *B, "-b", "0"), "-b 0"),
    (("fit", M, *B, "-ub", "0"), "-ub 0"),
    (("fit", M, *B, "-ub", "99999999999"), "-ub 99999999999"),
    (("fit", M, *B, "-c", "1024", "-b", "1", "-ub", "1"), "-b 1"),
    (("fit", M, *B, "-c", "1"), "-c 1"),
    (("fit", M, *B, "-c", "2", "-np", "3"), "-c 2"),
    (("fit", M, *B, "-b", "2", "-ub", "2"), "-b 2"),  # no -c: the solver's every context has the same problem
    (("fit", M, *B, "-np", "0"), "-np 0"),
    (("fit", M, *B, "-np", "-5"), "-np -5"),
    (("fit", M, *B, "-np", "300"), "-np 300"),
    (("fit", M, *B, "--spec-draft-n-max", "-1"), "--spec-draft-n-max -1"),
    (("fit", M, *B, "--frontend", "library", "-np", "-1"), "-np -1"),
    (("quants", M, *B, "-c", "99999999999"), "-c 99999999999"),
    (("quants", M, *B, "-np", "0"), "-np 0"),
    (("quants", M, *B, "-c", "8192", "-b", "1"), "-b 1"),
    # placement (issue 15)
    (("fit", M, *B, "--n-cpu-moe", "-1"), "--n-cpu-moe -1"),
    (("fit", M, *B, "-ot", "exps"), "-ot exps"),
    (("fit", M, *B, "-ot", "exps=CUDA7"), "unknown buffer type"),
    (("fit", M, "--backend", "cuda", *B, "-sm", "row"), "-sm row"),
    (("fit", M, *B, "-sm", "diagonal"), "-sm diagonal"),
    (("fit", M, "--budget", "2GiB,2GiB"), "one value per GPU"),
    (("fit", M, "--backend", "cuda", "--budget", "2GiB,auto"), "auto"),
    (("fit", M, "--backend", "cuda", *B, "--host-budget", "12"), "--host-budget"),
    (("fit", M, "--backend", "cuda", *B, "-ts", "3,x"), "-ts"),
    (("probe", M, "--n-cpu-moe", "-1"), "--n-cpu-moe -1"),
    (("probe", M, "-c", "-1"), "-c -1"),
    (("probe", M, "-np", "0"), "-np 0"),
    (("probe", M, "-np", "-5"), "-np -5"),
    (("probe", M, "-b", "1"), "-b 1"),
    (("probe", M, "-c", "99999999999"), "-c 99999999999"),
    (("probe", M, "-t", "0"), "-t 0"),
    (("probe", M, "--prompt-tokens", "0"), "--prompt-tokens 0"),
    (("probe", M, "--gen-tokens", "0"), "--gen-tokens 0"),
    (("probe", M, "--repeats", "0"), "--repeats 0"),
    (("probe", M, "--timeout", "0"), "--timeout 0"),
    (("probe", M, "--timeout", "-3"), "--timeout -3"),
    (("optimise", M, *B, "--trials", "0"), "--trials 0"),
    (("optimise", M, *B, "--seed", "-1"), "--seed -1"),
    # flags llama.cpp (or the command) does not have
    (("fit", M, *B, "--draft-max", "4"), "--draft-max"),
    (("fit", M, *B, "--ctx", "100"), "--ctx"),
    (("fit", M, *B, "--no-such-flag"), "--no-such-flag"),
    (("quants", M, *B, "--foo"), "--foo"),
    (("inspect", M, "--budget", "2GiB"), "--budget"),
    (("calibrate", M, "-c", "512"), "-c"),
    (("report", "s1", "--json"), "--json"),
    (("optimise", M, *B, "--foo"), "--foo"),
    (("probe", M, "--foo"), "--foo"),
    (("probe", M, "--draft-max", "4"), "--draft-max"),
    (("probe", M, "-lm", "bogus"), "-lm bogus: not a llama-server flag the python runner takes"),
    # bad values of enumerations
    (("fit", M, *B, "--backend", "gpu"), "--backend gpu"),
    (("fit", M, *B, "--frontend", "web"), "--frontend web"),
    (("fit", M, *B, "-fa", "maybe"), "-fa maybe"),
    (("fit", M, *B, "-ctk", "q9"), "-ctk q9"),
    (("fit", M, *B, "-ctv", "q3_k"), "-ctv q3_k"),
    (("fit", M, *B, "--spec-type", "eagle"), "--spec-type eagle"),
    (("fit", M, *B, "--spec-draft-type-k", "q9"), "--spec-draft-type-k q9"),
    (("fit", M, *B, "-ctv", "q8_0", "-fa", "off"), "flash attention"),
    (("quants", M, *B, "--backend", "gpu"), "--backend gpu"),
    (("quants", M, *B, "--frontend", "web"), "--frontend web"),
    (("quants", M, *B, "-ctk", "q9"), "-ctk q9"),
    (("quants", M, *B, "-fa", "maybe"), "-fa maybe"),
    (("calibrate", M, "--backend", "gpu"), "--backend gpu"),
    (("optimise", M, *B, "--runner", "gpu"), "--runner gpu"),
    (("optimise", M, *B, "--backend", "gpu"), "--backend"),
    (("optimise", M, *B, "--study", "nosuch"), "nosuch"),
    (("optimise", M, *B, "--study", "{missing}"), "missing"),
    (("optimise", M, *B, "--engine", "gpu"), "--engine gpu: use llama, or llama,mlx"),
    (("optimise", M, *B, "--engine", "mlx"), "--engine mlx: optimise searches MLX beside llama.cpp"),
    (("optimise", M, *B, "--engine", "llama,mlx"), "a GGUF and the same model's MLX directory (1 model given)"),
    (("optimise", M, "{tmp}", *B, "--engine", "llama,mlx", "--draft", M, "-ngl", "0"), "--draft, -ngl do not apply"),
    (("probe", M, "--runner", "gpu"), "--runner gpu"),
    (("probe", M, "--kind", "poetry"), "--kind poetry: use prose or code"),
    (("probe", M, "-fa", "maybe"), "-fa maybe"),
    (("probe", M, "-ctk", "q9"), "-ctk q9"),
    (("probe", M, "--spec-type", "eagle"), "--spec-type eagle"),
    # numbers that are not numbers, missing values and arguments
    (("fit", M, *B, "-c", "abc"), "not a whole number"),
    (("fit", M, *B, "-c", "1.5"), "-c"),
    (("fit", M, *B, "-c"), "-c"),
    (("probe", M, "-c", "abc"), "-c"),
    (("probe", M, "-c"), "-c needs a value"),
    (("probe", M, "--timeout", "soon"), "--timeout"),
    (("fit",), "Missing argument"),
    (("quants",), "Missing argument"),
    (("probe",), "Missing argument"),
    (("report",), "Missing argument"),
    (("optimise",), "Missing argument"),
    (("nosuchcommand",), "nosuchcommand"),
    # storage URLs
    (("optimise", M, *B, "--storage", "sqlite:////nonexistent/dir/x.db"), "/nonexistent/dir"),
    (("optimise", M, *B, "--storage", "bogus://x"), "--storage"),
    (("report", "s1", "--storage", "sqlite:////nonexistent/dir/x.db"), "/nonexistent/dir"),
    (("report", "s1", "--storage", "{tmp}/nope.db"), "does not exist"),
    (("report", "nosuchstudy"), "no study 'nosuchstudy'"),
    (("report", "nosuchstudy", "--storage", "{db}"), "no study 'nosuchstudy'"),
    (("report", "s1", "--storage", "bogus://x"), "--storage"),
    (("report", "s1", "--storage", "{tmp}"), "not a SQLite database file"),
    # output paths
    (("report", "s1", "--storage", "{db}", "--out", "/proc/nope"), "--out /proc/nope"),
    (("report", "s1", "--storage", "{db}", "--out", "{file}"), "not a directory"),
    (("report", "s1", "--storage", "{db}", "--out", "{file}/sub"), "--out"),
    # the network to the rpc-servers (issue 47 in the speed model)
    (("fit", M, *B, "--rpc", "127.0.0.1:50052", "--rpc-bandwidth", "fast"), "--rpc-bandwidth fast"),
    (("fit", M, *B, "--rpc", "127.0.0.1:50052", "--rpc-bandwidth", "0Gbit/s"), "above 0"),
    (("fit", M, *B, "--rpc", "127.0.0.1:50052", "--rpc-latency", "soon"), "--rpc-latency soon"),
    (("fit", M, *B, "--rpc-bandwidth", "10GbE"), "goes with --rpc"),
    (("quants", M, *B, "--rpc-latency", "0.2"), "goes with --rpc"),
    # hardware profiles
    (("hardware", "no-such-chip"), "ggfit hardware no-such-chip: no such hardware profile"),
    (("hardware", "--no-such-flag"), "--no-such-flag"),
    (("hardware", "auto", "extra"), "extra"),
]


def _fill(s: str, files: dict[str, str]) -> str:
    for k, v in files.items():
        s = s.replace("{%s}" % k, v)
    return s


PROGRESS = re.compile(r"^ggfit \w+: \[")  # fitter.progress's plain lines (a probe that got as far as starting)


def _check(code, out: str, err: str, phrase: str) -> None:
    lines = [ln for ln in err.splitlines() if not PROGRESS.match(ln)]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(lines) == 1, err
    assert lines[0].startswith("ggfit: error: "), err
    assert phrase in lines[0], (phrase, lines[0])
    assert "Traceback" not in out + err and "pydantic" not in err


def test_the_sweep_is_big_enough():
    assert len(CASES) >= 100
    commands = {argv[0] for argv, _ in CASES}
    assert {"inspect", "fit", "quants", "calibrate", "probe", "optimise", "report"} <= commands


@pytest.mark.parametrize("argv, phrase", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_invocation_is_one_line_exit_2(argv, phrase, files, capfd):
    args = [_fill(a, files) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    out, err = capfd.readouterr()
    _check(e.value.code, out, err, _fill(phrase, files))


SUBPROCESS = [
    (("fit", M, "--budget", "25559"), "25559MiB"),
    (("fit", M, *B, "--backend", "cpu", "-c", "1024", "-b", "1", "-ub", "1"), "-b 1"),
    (("fit", M, *B, "--no-such-flag"), "--no-such-flag"),
    (("probe", "{empty}"), "{empty}"),
    (("probe", M, "--kind", "poetry"), "--kind poetry"),
    (("report", "nosuchstudy"), "no study"),
    (("inspect", "{text}"), "{text}"),
    (("calibrate", "no-such-model.gguf"), "no such file"),  # nothing left to close at exit (FileSource.__del__)
    (("fit", "/proc", *B), "is a directory"),
]


@pytest.mark.parametrize("argv, phrase", SUBPROCESS, ids=[" ".join(a) for a, _ in SUBPROCESS])
def test_bad_invocation_through_a_subprocess(argv, phrase, files, tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "xdg"), GGFIT_NO_SERVER_BUILD="1")
    r = subprocess.run([sys.executable, "cli.py", *(_fill(a, files) for a in argv)], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    _check(r.returncode, r.stdout, r.stderr, _fill(phrase, files))


def test_report_of_a_missing_study_creates_nothing(tmp_path, capfd):
    """`report nosuchstudy` must not leave an empty database (nor its directory) behind."""
    with pytest.raises(SystemExit) as e:
        cli.main(["report", "nosuchstudy"])
    assert e.value.code == 2
    assert not (tmp_path / "xdg").exists()
    target = tmp_path / "sub" / "x.db"
    with pytest.raises(SystemExit):
        cli.main(["report", "s1", "--storage", f"sqlite:///{target}"])
    assert not target.parent.exists()
    capfd.readouterr()


def test_optimise_does_not_create_the_directory_of_an_explicit_storage(tmp_path, capfd):
    target = tmp_path / "no" / "such" / "x.db"
    with pytest.raises(SystemExit) as e:
        cli.main(["optimise", M, *B, "--storage", f"sqlite:///{target}"])
    assert e.value.code == 2
    assert not (tmp_path / "no").exists()
    assert "does not exist" in capfd.readouterr().err


def test_probe_unknown_flag_is_named_once(capfd):
    """The python runner has no llama-server flags: the unknown one is named once, before anything runs."""
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", M, "--no-such-flag", "3"])
    err = capfd.readouterr().err
    assert e.value.code == 2
    assert err.count("--no-such-flag") == 1 and err.count("error") == 1, err
    assert err.startswith("ggfit: error: --no-such-flag 3: not a llama-server flag the python runner takes")


def test_probe_server_unknown_flag_is_named_once(capfd, llama_server):
    """llama-server refuses a flag it lacks ("error: invalid argument: --no-such-flag"): ggfit says so once, exit 2
    (it fails at argument parsing, before any model is read)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", M, "--runner", "server", "--llama-server", llama_server, "--no-such-flag", "3"])
    out, err = capfd.readouterr()
    _check(e.value.code, out, err, "--no-such-flag: llama-server has no such option")
    assert err.count("error") == 1, err


def test_choice_options_list_their_values_in_help_and_agree_with_fitter(capfd):
    """--backend, --frontend, -fa, --runner, --kind are typer Enum options: the help shows the choices, a value
    outside them is one line naming the flag, the value and the allowed ones; the CLI's backend and frontend names
    are fitter's own."""
    from fitter.ggml.backends.base import Backend
    from fitter.llama.cparams import Frontend

    assert {b.value for b in cli.BackendName} == {b.value for b in Backend}
    assert {f.value for f in cli.FrontendName} == {f.value for f in Frontend}
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--help"])
    assert e.value.code == 0
    out = " ".join(capfd.readouterr().out.split())
    assert "--backend <metal|cuda|cpu|rpc|rpc-cuda>" in out and "<server|library>" in out and "<on|off|auto>" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", M, "--flash-attn", "maybe"])
    assert e.value.code == 2
    assert capfd.readouterr().err == "ggfit: error: -fa maybe: use on, off or auto (see ggfit fit --help)\n"
