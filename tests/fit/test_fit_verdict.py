"""Issue 49, `fit`'s and `quants`' answers: -b/-ub as llama.cpp runs them (checked against its own resolved
n_batch/n_ubatch), the what-fits-instead list in JSON, the placement solved without -c, one verdict for text and JSON,
and the same exit codes for both."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.oracle.llama_run import LlamaParams, measure
from tests.synth.shapes import build_shape, q4_k_m_types

ROOT = Path(__file__).resolve().parents[2]


def ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@lru_cache(maxsize=None)
def shape(name: str) -> str:
    return str(build_shape(name, tensor_types=q4_k_m_types(name)))


def flag(flags: list[str], name: str) -> int:
    return int(next(f.split()[1] for f in flags if f.split()[0] == name))


def last_line(out: subprocess.CompletedProcess) -> str:
    return out.stdout.rstrip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("given", [
    ["-b", "64", "-ub", "512"],  # the case: llama.cpp runs -ub 64, and -b stays 64
    ["-ub", "4096"],  # without -b: n_ubatch capped at the default n_batch, 2048
    ["-b", "1024"],  # the table's -ub stop at -b
    ["-b", "100000000", "-ub", "100000000"],  # both capped at the context solved for
    ["-c", "8192", "-b", "64", "-ub", "512"],
    ["-c", "1000", "-b", "4096", "-ub", "4096"],  # n_batch capped at n_ctx as asked (before its padding to 256)
])
def test_batch_and_ubatch_are_what_llama_cpp_runs_with_the_flags_as_given(gemma: str, given: list[str]) -> None:
    """llama_context::llama_context: n_batch = min(n_ctx, -b), n_ubatch = min(n_batch, -ub). ggfit's config and its
    printed flags carry what llama.cpp's own context resolves from the user's flags (the rest from ggfit's flags)."""
    out = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", *given, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    asked = dict(zip(given[::2], map(int, given[1::2])))
    flags = data["flags"]
    run = measure(gemma, LlamaParams(
        n_ctx=asked.get("-c", flag(flags, "-c")), n_batch=asked.get("-b", flag(flags, "-b")),
        n_ubatch=asked.get("-ub", flag(flags, "-ub")), n_seq_max=4, kv_unified=True, flash_attn="on"),
        mode="dry", log_level="info")
    assert run.ok, run.message
    llama = (run.api["ctx_n_batch"], run.api["ctx_n_ubatch"])
    assert (data["config"]["n_batch"], data["config"]["n_ubatch"]) == llama
    assert (flag(flags, "-b"), flag(flags, "-ub")) == llama
    text = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", *given)
    for name, v in asked.items():  # a flag llama.cpp changes is said, with the value it runs; ggfit changes none
        ran = dict(zip(("-b", "-ub"), llama)).get(name, v)
        assert (f"{name} {v} -> {ran} (llama.cpp caps" in text.stdout) == (ran != v), text.stdout
    assert "-b 64 -> " not in text.stdout
    if "-b" not in asked and flag(flags, "-b") > 2048:  # a -b above llama.cpp's default is ggfit's, and it says so
        assert f"-b {flag(flags, '-b')} is ggfit's proposal" in text.stdout
    rec = re.search(r"recommended: -c (\d+) -ub (\d+)", text.stdout)
    if rec:  # the recommendation says the -ub llama.cpp runs, and the table's column agrees
        assert int(rec.group(2)) == llama[1]
        columns = re.search(r"^  -ctk/-ctv +(.*)$", text.stdout, re.M).group(1)
        assert f"-ub {llama[1]}" in columns or (columns.strip() == "-ub = -c" and llama[1] == int(rec.group(1)))


def test_the_what_fits_instead_list_is_in_json_with_its_flags() -> None:
    args = ["fit", "gemma3-270m", "--budget", "900MiB", "--margin", "0MiB", "--backend", "cpu", "-c", "32768", "-ub",
            "4096", "-b", "4096", "-fa", "off"]
    text, js = ggfit(*args), ggfit(*args, "--json")
    assert text.returncode == js.returncode == 1, (text.stderr, js.stderr)
    data = json.loads(js.stdout)
    listed = text.stdout.split("(one change at a time):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    alts = data["what_to_change"]
    assert [f"  {a['line']}" for a in alts] == listed and len(alts) == 3
    for a in alts:  # each with its whole command: the change applied to the flags as given
        assert a["flags"][0].startswith("-m ") and set(a["change"]) <= set(a["flags"])
        assert "-c 32768" in a["flags"] or a["change"][0].startswith("-c ")
    assert data["verdict"]["line"] == last_line(text).removeprefix("verdict: ")
    assert data["verdict"]["verdict"] == "does_not_fit" and data["verdict"]["exit_code"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("model, budget, lever", [("qwen36-35b-a3b", "8GiB", "--n-cpu-moe"),
                                                  ("llama-8b", "4GiB", "-ngl")])
def test_fit_without_c_solves_the_placement_when_the_full_offload_fits_nothing(model: str, budget: str,
                                                                                 lever: str) -> None:
    """The issue's cases: the full offload fits no context; the table is solved for ggfit's placement (a MoE model
    keeps experts on the CPU, a dense one gets the largest -ngl), and the recommendation carries its flags."""
    path = shape(model)
    args = ["fit", path, "--budget", budget, "--backend", "cuda", "--host-budget", "64GiB"]
    text, js = ggfit(*args), ggfit(*args, "--json")
    assert text.returncode == js.returncode == 0, (text.stdout[-600:], js.stderr)
    data = json.loads(js.stdout)
    tp = data["table_placement"]
    assert tp is not None and any(f.startswith(lever + " ") for f in data["flags"])
    assert all(f in data["flags"] for f in (" ".join(tp["flags"][i:i + 2]) for i in range(0, len(tp["flags"]), 2)))
    assert data["fits"] and data["recommended"]["n_ctx"] > 0 and data["verdict"]["verdict"] == "fits"
    assert "offload fewer layers" not in text.stdout and "nothing fits" not in text.stdout
    assert f"ggfit's placement {' '.join(tp['flags'])}" in last_line(text)
    assert data["verdict"]["line"] == last_line(text).removeprefix("verdict: ")
    # the full offload, as given, fits no context: what the table was solved without
    full = json.loads(ggfit("fit", path, "--budget", budget, "--backend", "cuda", "-c", "256", "--host-budget",
                            "64GiB", "--json").stdout)
    assert not full["fits"]


@pytest.mark.slow
def test_nothing_fits_never_advises_ngl_without_a_gpu_to_free() -> None:
    path = shape("llama-8b")
    for backend, said in (("cpu", None), ("metal", "unified"), ("cuda", "no placement fits")):
        args = ["fit", path, "--budget", "2GiB", "--backend", backend, "--host-budget", "4GiB"]
        text, js = ggfit(*args), ggfit(*args, "--json")
        assert text.returncode == js.returncode == 1, (backend, text.stderr, js.stderr)
        line = next(ln for ln in text.stdout.splitlines() if ln.startswith("nothing fits"))
        assert ("-ngl" not in line or backend == "cuda") and (said is None or said in line), line
        assert json.loads(js.stdout)["what_to_change"][0]["line"] == line
    moe = ggfit("quants", shape("qwen36-35b-a3b"), "--budget", "1GiB", "--margin", "100MiB", "-c", "8192", "--backend",
                "cuda")
    assert moe.returncode == 1 and "--n-cpu-moe" in last_line(moe) and "-ngl" not in last_line(moe)
    cpu = ggfit("quants", shape("qwen36-35b-a3b"), "--budget", "1GiB", "--margin", "100MiB", "-c", "8192", "--backend",
                "cpu")
    assert cpu.returncode == 1 and "-ngl" not in last_line(cpu) and "--n-cpu-moe" not in last_line(cpu)


@pytest.mark.slow
def test_with_c_a_placement_that_fits_is_the_verdict_in_text_and_json() -> None:
    """-c 32768 at 8 GiB: the full offload is over budget, --n-cpu-moe N fits. The output does not end in "no context
    fits with these settings": the verdict, the same in both, says the placement fits, and both exit 0."""
    args = ["fit", shape("qwen36-35b-a3b"), "--budget", "8GiB", "--backend", "cuda", "-c", "32768", "--host-budget",
            "64GiB"]
    text, js = ggfit(*args), ggfit(*args, "--json")
    assert text.returncode == js.returncode == 0, (text.stderr, js.stderr)
    data = json.loads(js.stdout)
    n = data["placement"]["value"]
    assert data["placement"]["lever"] == "n_cpu_moe" and not data["fits"]
    assert "no context fits with these settings" not in text.stdout
    verdict = last_line(text)
    assert verdict.startswith("verdict: does NOT fit as given (over budget by ") and f"--n-cpu-moe {n}" in verdict
    assert data["verdict"] == {"verdict": "fits_with_placement", "line": verdict.removeprefix("verdict: "),
                               "exit_code": 0, "flags": data["placement"]["flags"]}
    assert data["what_to_change"][0]["change"] == [f"--n-cpu-moe {n}"]
    assert data["what_to_change"][0]["flags"] == data["placement"]["flags"]


@pytest.mark.parametrize("args", [
    ["fit", "gemma3-270m", "--budget", "200MiB", "--margin", "0MiB", "--backend", "cpu"],  # nothing fits, no -c
    ["fit", "gemma3-270m", "--budget", "200MiB", "--margin", "0MiB", "--backend", "cpu", "-c", "4096"],
    ["fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "4096"],  # fits
    ["quants", "gemma3-270m", "--budget", "100MiB", "--margin", "0MiB", "--backend", "cpu", "-c", "4096"],
    ["quants", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "4096"],
])
def test_json_exits_as_the_text_does(args: list[str]) -> None:
    text, js = ggfit(*args), ggfit(*args, "--json")
    assert text.returncode == js.returncode, (text.returncode, js.returncode, js.stderr)
    assert text.returncode == (0 if "2GiB" in args else 1)
    json.loads(js.stdout)
