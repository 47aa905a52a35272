"""llama-server's memory over a session (issue 48): resident memory after each of N requests, measured here.

    PYTHONPATH=. python3 benchmarks/session_here.py [--out benchmarks/results/session-cpu-here.json] [--only LABEL]

Each case starts the pinned llama-server (`python3 -m search.build_server`; CPU, `--no-repack`, `-lv 4` so that
its prompt-cache trace lines are printed) and sends N requests of distinct random token prompts (`/completion`,
`n_predict` G, `ignore_eos`), one at a time. After each it reads the server's VmRSS and RssAnon (/proc: anonymous
memory, without the mmapped weights' pages) and the prompt cache's state from the log ("cache state: N prompts,
X MiB"), with the state and checkpoint sizes the log printed. Models: the bundled Gemma 3 270M and synthetic SWA
(gemma3) and hybrid (qwen35) models of tests/synth, built with the parameters recorded beside the results.
`tests/session/test_session_recorded.py` replays the recording against fitter.session.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# synthetic models: large enough per token that the cache's growth stands out of the process's noise
SYNTH = {
    "synth-gemma3": ("gemma3", dict(n_layer=12, n_embd=256, n_head=8, n_head_kv=8, head_dim=64, n_ff=512,
                                    sliding_window=512, n_ctx_train=16384)),
    "synth-qwen35": ("qwen35", dict(n_layer=8, n_embd=256, n_head=8, n_head_kv=8, head_dim=128, n_rot=32,
                                    ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16, n_ff=512, n_ctx_train=16384)),
    # a draft for synth-gemma3 (the same vocabulary): its state travels with the target's (-md, "@key" in a case)
    "synth-gemma3-draft": ("gemma3", dict(n_layer=6, n_embd=128, n_head=4, n_head_kv=4, head_dim=32, n_ff=256,
                                          sliding_window=512, n_ctx_train=16384)),
}
DRAFT = ["-md", "@synth-gemma3-draft", "--spec-type", "draft-simple"]
OFF, CAP = ["--cache-ram", "0"], ["--cache-ram", "64"]
# (label, model, -c, prompt tokens, generated tokens, llama-server flags, requests)
CASES = [
    ("gemma-p600-default", "gemma3-270m", 8192, 600, 8, [], 50),
    ("gemma-p600-cap64", "gemma3-270m", 8192, 600, 8, CAP, 12),
    ("gemma-p600-off", "gemma3-270m", 8192, 600, 8, OFF, 12),
    ("gemma-p200-nolimit", "gemma3-270m", 4096, 200, 8, ["--cache-ram", "-1"], 50),
    ("sgemma-p2000-default", "synth-gemma3", 16384, 2000, 8, [], 50),
    ("sgemma-p300-default", "synth-gemma3", 16384, 300, 8, [], 50),
    ("sgemma-p1000-cap64", "synth-gemma3", 16384, 1000, 8, CAP, 10),
    ("sgemma-p1000-off", "synth-gemma3", 16384, 1000, 8, OFF, 10),
    ("sgemma-p1000-ckpt1", "synth-gemma3", 16384, 1000, 8, ["--ctx-checkpoints", "1"], 6),
    ("sgemma-p2000-draft", "synth-gemma3", 16384, 2000, 8, DRAFT, 4),
    ("sqwen-p500-default", "synth-qwen35", 16384, 500, 8, [], 50),
    ("sqwen-p500-cap64", "synth-qwen35", 16384, 500, 8, CAP, 10),
    ("sqwen-p500-off", "synth-qwen35", 16384, 500, 8, OFF, 10),
]
_CACHE = re.compile(r"cache state: (\d+) prompts, ([\d.]+) MiB")
_CKPT = re.compile(r"created context checkpoint .*n_tokens = (\d+), size = ([\d.]+) MiB")
_SAVE = re.compile(r"saving prompt with length (\d+), total state size = ([\d.]+) MiB")


def model_path(key: str) -> str:
    if key in SYNTH:
        from tests.synth import build

        name, params = SYNTH[key]
        return str(build(name, **params))
    from fitter.bundled import resolve_model

    return resolve_model(key)


def _mem(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _log_facts(lines: list[str]) -> dict:
    """The prompt cache's last state, and the checkpoints and saves printed in `lines`."""
    facts: dict = {"checkpoints": [], "saves": []}
    for ln in lines:
        if m := _CACHE.search(ln):
            facts["cache_prompts"], facts["cache_mib"] = int(m.group(1)), float(m.group(2))
        elif m := _CKPT.search(ln):
            facts["checkpoints"].append([int(m.group(1)), float(m.group(2))])
        elif m := _SAVE.search(ln):
            facts["saves"].append([int(m.group(1)), float(m.group(2))])
    return facts


def run_case(label: str, key: str, n_ctx: int, prompt: int, gen: int, flags: list[str], n_req: int,
             threads: int, env: dict[str, str] | None = None) -> dict:
    from fitter.llama.model import load_model_spec
    from search.server import LlamaServer, find_llama_server, free_port

    path = model_path(key)
    _, spec = load_model_spec(path)
    binary = find_llama_server()
    port = free_port()
    cmd = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-fit", "off", "--no-warmup",
           "--no-repack", "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-lv", "4",
           *(model_path(f[1:]) if f.startswith("@") else f for f in flags)]
    srv = LlamaServer(cmd, port=port, env={**os.environ, **(env or {})})
    rows = []
    try:
        if not srv.wait_healthy(time.perf_counter() + 300):
            raise RuntimeError(f"{label}: llama-server did not start: {srv.log[-2000:]}")
        load = _mem(srv.proc.pid)
        rng = random.Random(label)
        seen = len(srv.proc.lines)
        for k in range(1, n_req + 1):
            tokens = [rng.randrange(100, spec.n_vocab) for _ in range(prompt)]
            r = srv.request("POST", "/completion", {"prompt": tokens, "n_predict": gen, "ignore_eos": True,
                                                     "temperature": 0.0, "top_k": 1}, 900)
            time.sleep(0.05)
            lines = srv.proc.lines[seen:]
            seen += len(lines)
            row = {"request": k, **_mem(srv.proc.pid), **_log_facts(lines),
                   "prompt_n": r.get("timings", {}).get("prompt_n"), "predicted_n": r.get("tokens_predicted")}
            rows.append(row)
            print(f"{label} {k}/{n_req}: rss {row['VmRSS'] / 2**20:.1f} MiB anon {row['RssAnon'] / 2**20:.1f} MiB "
                  f"cache {row.get('cache_prompts')} / {row.get('cache_mib')} MiB", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    return {"label": label, "model": key, "synth": SYNTH.get(key), "n_ctx": n_ctx, "prompt": prompt, "gen": gen,
            "flags": flags, "command": cmd[1:], "after_load": load, "requests": rows,
            "log_head": [ln for ln in srv.proc.lines if "prompt cache is" in ln or "n_parallel" in ln]}


def flags_of(args: list[str]):
    from fitter.session.server import CacheFlags

    names = {"--cache-ram": "cache_ram_mib", "--ctx-checkpoints": "ctx_checkpoints"}
    return CacheFlags(**{names[a]: int(v) for a, v in zip(args[::2], args[1::2]) if a in names})


def predicted(case: dict, at: list[int]):
    """fitter.session's prediction for a recorded case (the model rebuilt: bundled, or tests.synth's cached GGUF)."""
    from fitter.fit.memory import predict
    from fitter.llama.cparams import RunConfig
    from fitter.llama.model import load_model_spec
    from fitter.session.server import server_session

    header, spec = load_model_spec(model_path(case["model"]))
    flags = case["flags"]
    if "-md" in flags:  # draft-simple with a synthetic draft
        dpath = model_path(flags[flags.index("-md") + 1][1:])
        dh, dspec = load_model_spec(dpath)
        pred = predict(header, spec, RunConfig(n_ctx=case["n_ctx"], draft_model=dpath, spec_type="draft-simple"),
                       draft=(dh, dspec))
        assert pred.draft_context is not None
        return server_session(spec, pred.context, case["prompt"], case["gen"], at, flags_of(flags),
                              draft=(dspec, pred.draft_context, False))
    cp = predict(header, spec, RunConfig(n_ctx=case["n_ctx"])).context
    return server_session(spec, cp, case["prompt"], case["gen"], at, flags_of(flags))


def compare(case: dict) -> list[dict]:
    """Measured vs predicted after 1, 10 and the last request: the log's cache size, and the growth of the server's
    anonymous resident memory since request 1 (predicted: fitter.session's bytes, plus the allocator's share from
    request 4 on, ServerSession.allocator_bytes)."""
    rows = case["requests"]
    at = sorted({1, min(10, len(rows)), len(rows)})
    s = predicted(case, at)
    base = s.points[0].bytes
    out = []
    for p in s.points:
        m = rows[p.requests - 1]
        grow = p.bytes - base + (s.allocator_bytes if p.requests >= 4 else 0)
        out.append({"requests": p.requests, "cache_mib_logged": m.get("cache_mib", 0.0),
                    "cache_mib_predicted": round(p.cache_bytes / 2**20, 3),
                    "growth_measured": m["RssAnon"] - rows[0]["RssAnon"], "growth_predicted": grow,
                    "rss_measured": m["VmRSS"], "rss_predicted": rows[0]["VmRSS"] + grow})
    return out


def print_compare(doc: dict) -> None:
    print(f"{'case':<22}{'N':>4}{'cache log':>11}{'cache pred':>11}{'grow meas':>11}{'grow pred':>11}{'diff':>8}"
          f"{'RSS meas':>10}{'RSS pred':>10}")
    for case in doc["cases"]:
        for r in compare(case):
            d = r["growth_measured"] - r["growth_predicted"]
            print(f"{case['label']:<22}{r['requests']:>4}{r['cache_mib_logged']:>11}{r['cache_mib_predicted']:>11}"
                  f"{r['growth_measured'] / 2**20:>11.1f}{r['growth_predicted'] / 2**20:>11.1f}{d / 2**20:>8.1f}"
                  f"{r['rss_measured'] / 2**20:>10.1f}{r['rss_predicted'] / 2**20:>10.1f}")


def main() -> None:
    from search.server import find_llama_server, parse_build, server_version

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/session-cpu-here.json"))
    ap.add_argument("--only", action="append", default=[], help="run these case labels only (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="print the recording beside the prediction, run nothing")
    a = ap.parse_args()
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {"cases": []}
    if a.compare:
        print_compare(doc)
        return
    binary = find_llama_server()
    doc["build"] = parse_build(server_version(binary))
    doc["machine"] = {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}
    doc["how"] = "PYTHONPATH=. python3 benchmarks/session_here.py"
    for case in CASES:
        if a.only and case[0] not in a.only:
            continue
        res = run_case(*case, threads=a.threads)
        doc["cases"] = [c for c in doc["cases"] if c["label"] != case[0]] + [res]
        out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
