"""Where a command's instructions go, phase by phase: the interpreter, typer, ggfit's imports, the command line, the
header, the graphs, Metal's plans, the traces, the predictions, the output, the exit.

fit_speed.py gives each command's whole count; this splits one run of one command (the table, `fit` without `-c`, on
fit_speed's 20 GB qwen35moe header by default) under callgrind. A driver marks each phase's start and end with a call
callgrind dumps its counts before (`--dump-before=getppid`, a C function nothing else on these paths calls), and
every interval goes to the phase innermost then (a Metal plan and a trace are built inside a prediction's graph: their
instructions are theirs, not the graph's or the prediction's). The counts are the same on every run of one tree
(PYTHONHASHSEED=0), so a phase that moves by a percent shows. The driver imports up front the modules whose functions
it marks (the command would import them later), and its marks add about 1% to fit_speed's count of the command.

    python benchmarks/fit_phases.py                  # the table
    python benchmarks/fit_phases.py quants           # or any command's arguments after the model:
    python benchmarks/fit_phases.py fit -c 131072 -ctk q8_0 -ctv q8_0 -ub 2048

The budget and backend are fit_speed's (--budget 25559MiB --backend metal). Needs valgrind on the PATH.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The driver, run as `python -c DRIVER NAMES_FILE ARGV...` from the tree: each phase's start and end marked, then the
# labels of the intervals the dumps close written to NAMES_FILE.
_DRIVER = """
import functools, os, sys
mark = os.getppid  # callgrind dumps its counts before each call (--dump-before=getppid)
out, sys.argv = sys.argv[1], ["ggfit", *sys.argv[2:]]
labels = []  # the phase each interval belongs to, in order
stack = ["interpreter and site"]

def enter(label):
    labels.append(stack[-1]); mark(); stack.append(label)

def leave():
    labels.append(stack[-1]); mark(); stack.pop()

enter("import typer")
import typer
leave()
enter("import ggfit (cli and fitter)")
import cli
import fitter
import fitter.fit.memory, fitter.fit.solver, fitter.llama.context, fitter.llama.traced_graph, typer.main
import fitter.ggml.backends.metal.segments as segments
leave()

def phase(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def marked(*a, **k):
        enter(label)
        try:
            return f(*a, **k)
        finally:
            leave()
    setattr(owner, name, marked)
    return marked

phase(typer.main, "get_command", "command line (typer builds the command)")
phase(fitter, "load_model_spec", "header and model spec")
predict = phase(fitter.fit.memory, "predict", "predictions (past their graphs)")
fitter.fit.solver.predict = predict
if sys.argv[1] == "quants":  # (imported here for quants alone: the other commands never import them)
    import fitter.fit.quant_fit as quant_fit
    quant_fit.predict = predict
    phase(quant_fit, "predict_all", "quants: each ftype's tensor types")
    phase(quant_fit, "quantized_header", "quants: each ftype's header")
    phase(quant_fit, "requantized_spec", "quants: each ftype's model spec")
phase(fitter.llama.context, "_prepare", "graphs (built, placed, split)")
phase(segments._Plan, "run", "Metal plans (reorder, chunks)")
phase(fitter.llama.traced_graph._Traced, "__init__", "traces")
stack[0] = "the rest (parsing, solver, output)"
try:
    cli.main()
except SystemExit:
    pass
labels.append(stack[-1])
mark()
labels.append("exit")  # the last interval: the interpreter's teardown (no dump closes it: the final count does)
with open(out, "w") as f:
    f.write("\\n".join(labels))
"""


def totals(dump: str) -> int:
    with open(dump) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{dump}: no totals line")


def phases(argv: list[str]) -> list[tuple[str, int, int]]:
    """(phase, instructions, intervals) in first-seen order, for one run of `ggfit ARGV` from this tree."""
    from fit_speed import child_env

    env = child_env()  # byte code cached, as on a user's machine
    env["PYTHONHASHSEED"] = "0"
    with tempfile.TemporaryDirectory(prefix="ggfit-phases-") as tmp:
        env["GGFIT_CACHE"] = os.path.join(tmp, "cache")
        names = os.path.join(tmp, "names")
        run = [sys.executable, "-c", _DRIVER, names, *argv]
        subprocess.run(run, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=True)  # warm: header cache, byte code
        subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=getppid",
                        f"--callgrind-out-file={tmp}/cg.out", *run], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        with open(names) as f:
            labels = f.read().split("\n")
        dumps = sorted(glob.glob(f"{tmp}/cg.out.*"), key=lambda p: int(p.rsplit(".", 1)[1])) + [f"{tmp}/cg.out"]
        if len(dumps) != len(labels):
            raise RuntimeError(f"{len(dumps)} callgrind dumps for {len(labels)} intervals")
        out: dict[str, list[int]] = {}
        for label, dump in zip(labels, dumps):
            e = out.setdefault(label, [0, 0])
            e[0] += totals(dump)
            e[1] += 1
    return [(label, n, k) for label, (n, k) in out.items()]


def main() -> int:
    if shutil.which("valgrind") is None:
        print("fit_phases.py needs valgrind (callgrind) on the PATH")
        return 1
    from fit_speed import model_path

    path = model_path()
    args = sys.argv[1:] or ["fit"]
    argv = [args[0], path, "--budget", "25559MiB", "--backend", "metal", *args[1:]]
    print(f"ggfit {' '.join(argv)}")
    rows = phases(argv)
    total = sum(n for _, n, _ in rows)
    print(f"{'phase':<44}{'instructions':>14}{'share':>8}{'intervals':>11}")
    for label, n, k in rows:
        print(f"{label:<44}{n / 1e6:>13,.1f}M{100 * n / total:>7.1f}%{k:>11}")
    print(f"{'total':<44}{total / 1e6:>13,.1f}M")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
