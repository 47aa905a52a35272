"""Record llama.cpp's compute graph, node by node, for ggfit's graph builders to be checked against.

Metal reorders each split's nodes before ggml-alloc sizes the compute buffer (fitter.ggml.backends.metal.common), so
the Metal prediction is only as good as ggfit's node list: the same ops in the same order, each with the same number
of uses (the reorder's fusion checks read them). llama.cpp prints that list when GGML_SCHED_DEBUG=2 is set
(ggml_backend_sched_print_assignments: index, op, name, use count; views are skipped, their indices kept). The graph
is the same whatever the backend: this records the CPU dry run of a release (the last graph reserved: the worst-case
batch) for the synthetic models of tests/synth.

    python3 benchmarks/eras/graph_nodes.py 0.3.36            # the pinned build (the installed llama_cpp)
    python3 benchmarks/eras/graph_nodes.py 0.3.23            # PYTHONPATH=/work/eras/site/0.3.23 in the child

writes benchmarks/results/graph-nodes-<release>.json, replayed by tests/ggml/test_graph_nodes.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (model id, tests.synth builder, overrides): small models of every family ggfit builds graphs for; the three whose
# head size (16) q8_0's block does not divide keep f16 K/V (F16_KV)
MODELS = [
    ("llama", "llama", {}), ("qwen3", "qwen3", {}), ("qwen3moe", "qwen3moe", {}), ("gemma3", "gemma3", {}),
    ("gemma4", "gemma4", {}), ("gpt-oss", "gpt-oss", {}), ("deepseek2", "deepseek2", {}), ("glm4moe", "glm4moe", {}),
    ("qwen35", "qwen35", {}), ("qwen35moe", "qwen35moe", {}), ("qwen3next", "qwen3next", {}), ("phi3", "phi3", {}),
]
F16_KV = {"llama", "deepseek2", "phi3"}
# the context: one sequence, flash attention, q8_0 K/V, a ubatch of 512 over 4,096 cells
CONTEXT = {"n_ctx": 4096, "n_batch": 512, "n_ubatch": 512, "n_seq_max": 1, "flash_attn": "on", "type_k": 8, "type_v": 8}
_NODE = re.compile(r"node #\s*(\d+) \(\s*([^)]*?)\s*\):\s+(.{20}) \(\s*\S+\) \[.*?\] use=(\d+)")


def parse_nodes(log: str) -> list[list]:
    """[index, op description, name, use count] of every printed node of the last graph in a GGML_SCHED_DEBUG=2 log."""
    last = log.split("## SPLIT #0")[-1]
    return [[int(m.group(1)), m.group(2), m.group(3).strip(), int(m.group(4))] for m in _NODE.finditer(last)]


def record(release: str) -> dict:
    from tests.synth import build

    env = dict(os.environ, GGML_SCHED_DEBUG="2")
    if release != "0.3.36":
        env["PYTHONPATH"] = f"/work/eras/site/{release}"
    out: dict = {"release": release, "context": CONTEXT, "models": {}}
    for mid, builder, overrides in MODELS:
        path = str(build(builder, **overrides))
        fields = dict(CONTEXT, type_k=1, type_v=1) if mid in F16_KV else CONTEXT
        req = {"model_path": path, "contexts": [{"id": "c", "fields": fields}]}
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks/eras/child.py"), json.dumps(req)], env=env,
                           capture_output=True, text=True, timeout=600)
        events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        ctx = next((e for e in events if e.get("event") == "context"), None)
        if ctx is None or not ctx["ok"]:
            out["models"][mid] = {"builder": builder, "overrides": overrides, "ok": False}
            continue
        n = re.findall(r"graph nodes\s*=\s*(\d+)", ctx["log"])
        nodes = parse_nodes(ctx["log"])
        out["models"][mid] = {"builder": builder, "overrides": overrides, "ok": True, "type_kv": fields["type_k"],
                              "n_nodes": int(n[-1]) if n else nodes[-1][0] + 1, "nodes": nodes}
        print(f"{release} {mid}: {out['models'][mid]['n_nodes']} nodes", flush=True)
    return out


def main() -> int:
    release = sys.argv[1] if len(sys.argv) > 1 else "0.3.36"
    data = record(release)
    dst = ROOT / "benchmarks/results" / f"graph-nodes-{release}.json"
    dst.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"written: {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
