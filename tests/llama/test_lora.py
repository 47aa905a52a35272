"""LoRA adapters (--lora, --lora-scaled) against the pinned llama.cpp on the CPU.

Each case loads a synthetic base model for real with synthetic adapters (tests/synth/lora.py) in llama.cpp's
child (`measure(loras=...)`: llama_adapter_lora_init after the model, llama_set_adapters_lora on the context, then
a decode, whose re-reserve sizes the graph with the adapters, as llama-server's warm-up does) and compares:
- the `<buf> LoRA buffer size = X MiB` lines (buffer name, bytes to the printed 0.01 MiB);
- the compute buffer, to the byte (llama_get_memory_breakdown after the decode);
- that the adapters do move the compute buffer where the case says so (else the case would prove nothing).
Plus: the graph caches (an adapter keys every one; a reused trace equals a scratch build), the flags' round trip
through llama-server's words, and the refusals (one line, exit 2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fitter.cache import CACHES
from fitter.fit.memory import predict
from fitter.ggml.backends.base import Backend
from fitter.llama import context as C
from fitter.llama.cparams import ConfigError, Frontend, RunConfig
from fitter.llama.graph_details import graph_details
from fitter.llama.lora import LoraError, lora_details, read_lora
from fitter.llama.model import load_model_spec
from fitter.oracle.check import llama_params
from fitter.oracle.llama_run import measure
from tests.synth import build
from tests.synth.lora import build_lora

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BASES = {
    "llama": dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, n_ff=512),
    "qwen3": dict(n_layer=3, head_dim=128, n_head=8, n_head_kv=1),
    "qwen3moe": dict(n_layer=3, n_embd=256, n_expert=16, n_expert_used=4, head_dim=64, n_ff_exp=512),
}
DENSE = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_gate", "ffn_down")


def _base(arch: str) -> Path:
    if arch not in BASES:
        from tests.llama.test_compute import MODELS

        kind, arg = MODELS[arch]
        return build(kind, **arg)
    return build(arch, **BASES[arch])


def _cfg(n_ctx: int, ub: int, fa: str, **kw) -> dict:
    return dict(n_ctx=n_ctx, n_batch=512, n_ubatch=ub, flash_attn=fa, n_parallel=1, **kw)


# (base, [(targets, adapter options, scale)], config, whether the adapters move the compute buffer)
CASES = [
    ("llama", [(("ffn_down", "ffn_gate", "ffn_up"), dict(rank=16, ftype="f16"), 1.0)], _cfg(256, 128, "on"), True),
    ("llama", [(("token_embd", "output"), dict(rank=16), 1.0)], _cfg(256, 128, "on"), False),
    ("llama", [(DENSE, dict(rank=64), 1.0)], _cfg(256, 256, "off", no_mmap=True), False),
    ("qwen3", [((*DENSE, "output"), dict(rank=32, ftype="q8_0"), 1.0)], _cfg(512, 256, "on"), True),
    ("qwen3moe", [(("ffn_up_exps", "ffn_down_exps", "attn_k"), dict(rank=32, ftype="q8_0"), 1.0)],
     _cfg(512, 64, "off"), True),
    ("qwen3moe", [(("ffn_gate_inp", "ffn_gate_exps"), dict(rank=64, ftype="f16"), 1.0)], _cfg(512, 512, "on"), False),
    # two adapters on the same weights (llama_context's unordered_map: the newest first), one more scaled
    ("llama", [(("ffn_up", "ffn_down"), dict(rank=16, ftype="f16"), 1.0),
               (("ffn_up", "attn_q"), dict(rank=48, seed=1), 0.5)], _cfg(256, 128, "on"), True),
    # several sequences (-np 4 with a unified cache, -np 2 split), -ngl (all CPU on this build)
    ("qwen3moe", [(("ffn_up_exps", "ffn_gate_exps", "ffn_down_exps", "attn_v"), dict(rank=24, ftype="f16"), 1.0)],
     dict(_cfg(1024, 256, "off", n_gpu_layers=2), n_parallel=4, kv_unified=True), True),
    ("llama", [(DENSE, dict(rank=32, ftype="q8_0"), 1.0)], dict(_cfg(1024, 512, "on"), n_parallel=2), True),
    # the order matters here (a rank-512 pair after a rank-16 one on ffn_up, or before it): given small, large
    ("llama", [(("ffn_up",), dict(rank=16), 1.0), (("ffn_up",), dict(rank=512, seed=1), 1.0)],
     _cfg(512, 128, "on"), True),
    # deepseek2 without q_lora (MHA): wq, wkv_a_mqa and wkv_b are plain ggml_mul_mat; adapters there change no graph
    ("deepseek2-lite-mha", [(("attn_kv_a_mqa", "attn_kv_b", "attn_q"), dict(rank=64), 1.0)], _cfg(1024, 256, "on"),
     False),
    # a zero scale: the weights are loaded, the context leaves the adapter out of its graph
    ("llama", [(("ffn_down", "ffn_gate", "ffn_up"), dict(rank=16, ftype="f16"), 0.0)], _cfg(256, 128, "on"), False),
]


@pytest.mark.parametrize("arch,adapters,cfg,moves", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_llama_cpp(arch: str, adapters: list, cfg: dict, moves: bool) -> None:
    base = _base(arch)
    loras = tuple((str(build_lora(base, targets, **opts)), scale) for targets, opts, scale in adapters)
    config = RunConfig(**cfg, lora=loras)
    header, spec = load_model_spec(str(base))
    pred = predict(header, spec, config, Backend.CPU, Frontend.SERVER)
    plain = predict(header, spec, config.model_copy(update={"lora": ()}), Backend.CPU, Frontend.SERVER)
    run = measure(str(base), llama_params(pred.context, config), mode="load", decode_tokens=8, loras=loras,
                  log_level="info").raise_for_status()
    printed = [(b.buffer, b.mib) for b in run.report.buffers if b.kind == "lora"]
    rows = [b for b in pred.buffers if b.kind == "lora"]
    assert printed == [(b.device, round(b.bytes / MIB, 2)) for b in rows]
    assert all(b.counts for b in rows)
    assert [b.device for b in rows] == ["CPU" if config.no_mmap else "CPU_Mapped"] * len(loras)
    assert pred.by_kind("compute") == run.breakdown_total("compute")
    assert (pred.by_kind("compute") != plain.by_kind("compute")) == moves
    assert pred.by_kind("model") == plain.by_kind("model")


ARCHS = ("qwen2", "mistral3", "phi3", "gemma2", "gemma3", "gemma4", "gemma4-ple256", "gpt-oss", "glm4moe",
         "deepseek2", "deepseek2-lite-mha", "qwen35", "qwen35moe", "qwen3next")


@pytest.mark.parametrize("model", ARCHS)
def test_every_architecture(model: str) -> None:
    """An adapter on every matrix of every trunk layer (one adapter per set of layers that has the same matrices:
    attention layers, recurrent layers, dense or MoE FFNs, shared experts), and on the output: llama.cpp's compute
    buffer to the byte and its LoRA lines. deepseek2 multiplies its attention matrices plainly (no build_lora_mm)."""
    from fitter.gguf.reader import read_header
    from tests.llama.test_compute import MODELS

    kind, arg = MODELS[model]
    base = build(kind, **arg)
    header, spec = load_model_spec(str(base))
    layers_of: dict[str, list[int]] = {}
    for t in read_header(str(base)).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(t.shape) >= 2 and parts[-1] == "weight" and "norm" not in t.name \
                and "conv" not in t.name and int(parts[1]) < spec.n_layer:
            layers_of.setdefault(".".join(parts[2:-1]), []).append(int(parts[1]))
    groups: dict[tuple[int, ...], list[str]] = {}
    for suffix, layers in layers_of.items():
        groups.setdefault(tuple(sorted(layers)), []).append(suffix)
    loras = tuple((str(build_lora(base, tuple(sorted(ts)) + (("output",) if header.tensor("output.weight") else ()),
                                  rank=16, layers=list(ls), seed=i)), 1.0)
                  for i, (ls, ts) in enumerate(sorted(groups.items())))
    config = RunConfig(**_cfg(1024, 256, "on"), lora=loras)
    pred = predict(header, spec, config, Backend.CPU)
    run = measure(str(base), llama_params(pred.context, config), mode="load", decode_tokens=8, loras=loras,
                  log_level="info").raise_for_status()
    assert pred.by_kind("compute") == run.breakdown_total("compute")
    assert [(b.buffer, b.mib) for b in run.report.buffers if b.kind == "lora"] == [
        (b.device, round(b.bytes / MIB, 2)) for b in pred.buffers if b.kind == "lora"]


def test_lora_buffer_follows_the_base_weights_device() -> None:
    """With a GPU backend each pair lands in its base tensor's buffer type: -ngl and -ot move the adapter's bytes
    with the weights (CUDA0 / CPU_Mapped), and the tensors sum to the same total."""
    base = _base("qwen3moe")
    lora = str(build_lora(base, ("attn_q", "ffn_up_exps", "output"), rank=16))
    header, spec = load_model_spec(str(base))

    def rows(**kw) -> dict[str, int]:
        p = predict(header, spec, RunConfig(n_ctx=512, lora=((lora, 1.0),), **kw), Backend.CUDA)
        return {b.device: b.bytes for b in p.buffers if b.kind == "lora"}

    full = rows()
    assert list(full) == ["CUDA0"]
    moe = rows(cpu_moe=True)
    assert set(moe) == {"CUDA0", "CPU_Mapped"} and moe["CUDA0"] < full["CUDA0"]
    assert set(rows(n_gpu_layers=0)) == {"CPU_Mapped"}
    assert set(rows(n_gpu_layers=0, no_mmap=True)) == {"CUDA_Host"}  # the GPU's pinned host buffer type
    # Metal maps the file: the GPU's weights sit in MTL0_Mapped buffers, and so do their pairs
    p = predict(header, spec, RunConfig(n_ctx=512, lora=((lora, 1.0),)), Backend.METAL)
    assert [(b.device, b.bytes) for b in p.buffers if b.kind == "lora"] == [("MTL0_Mapped", full["CUDA0"])]


def test_an_adapter_keys_every_graph_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same spec, context and header details with and without the adapter: two answers; with it, a graph traced at
    one n_ctx and reused at others equals the same buffers built from scratch."""
    from fitter.llama.cparams import resolve_context

    base = _base("llama")
    header, spec = load_model_spec(str(base))
    d = graph_details(header)
    ad = read_lora(str(build_lora(base, ("ffn_down", "ffn_gate", "ffn_up"), rank=16, ftype="f16")))
    dl = lora_details(d, [ad])
    assert lora_details(d, [ad]) is dl  # one object: the caches key on it
    cfg = RunConfig(**_cfg(256, 128, "on"))
    cp = resolve_context(spec, cfg, Frontend.SERVER)
    assert C.compute_buffers(spec, cp, details=dl)[0].bytes != C.compute_buffers(spec, cp, details=d)[0].bytes
    real = C._allocated
    for n_ctx in (4096, 1024, 2304, 256):
        cp = resolve_context(spec, cfg.model_copy(update={"n_ctx": n_ctx}), Frontend.SERVER)
        got = C.compute_buffers(spec, cp, details=dl)
        with monkeypatch.context() as m:
            m.setattr(C, "_allocated", lambda c, ga, det, key, *a, **kw: real(c, ga, det, None, *a))
            CACHES.clear("compute")
            assert C.compute_buffers(spec, cp, details=dl) == got


def test_server_flags_round_trip() -> None:
    cfg, _, unknown = RunConfig.from_server_args(["--lora", "a.gguf,b.gguf", "--lora-scaled", "c.gguf:0.25",
                                                  "--lora", "d.gguf"])
    assert not unknown
    assert cfg.lora == (("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 0.25), ("d.gguf", 1.0))
    args = [w for g in cfg.to_server_args() for w in g]
    assert args[args.index("--lora-scaled") + 1] == "c.gguf:0.25"
    assert RunConfig.from_server_args(args).config == cfg
    with pytest.raises(ConfigError, match="lora-scaled format: FNAME:SCALE"):
        RunConfig.from_server_args(["--lora-scaled", "c.gguf"])


def test_adapter_refusals(tmp_path: Path) -> None:
    """llama_adapter_lora_init_impl's reasons, as one GGFitError line naming --lora and the file."""
    base = _base("llama")
    header, spec = load_model_spec(str(base))
    good = build_lora(base, ("attn_q",))
    cfg = lambda p: RunConfig(n_ctx=256, lora=((str(p), 1.0),))  # noqa: E731
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])  # the last tensor's data runs past the end
    cases = [
        (tmp_path / "missing.gguf", "no such file"),
        (cut, "truncated"),
        (base, "expect general.type to be 'adapter'"),
        (build_lora(base, ("attn_q",), adapter_type="control_vector"), "expect adapter.type to be 'lora'"),
        (build_lora(_base("qwen3"), ("attn_q",)), "model arch and LoRA arch mismatch"),
        (build_lora(build("llama", **dict(BASES["llama"], n_embd=128)), ("attn_q",)), "incorrect shape"),
    ]
    for path, why in cases:
        with pytest.raises(LoraError, match=why) as e:
            predict(header, spec, cfg(path), Backend.CPU)
        assert str(e.value).startswith(f"--lora {path}: ")


def test_cli_lora_rows_and_error_line(tmp_path: Path) -> None:
    base = _base("llama")
    lora = build_lora(base, ("attn_q", "ffn_up"), rank=8)
    out = subprocess.run([sys.executable, "cli.py", "fit", str(base), "--backend", "cpu", "--budget", "4GiB", "-c",
                          "256", "--lora", str(lora), "--json"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import json

    data = json.loads(out.stdout)
    assert [b["device"] for b in data["buffers"] if b["kind"] == "lora"] == ["CPU_Mapped"]
    # --check: llama.cpp's dry run with the adapter (its LoRA line; its graph reserved before the adapter applies)
    chk = subprocess.run([sys.executable, "cli.py", "fit", str(base), "--backend", "cpu", "--budget", "4GiB", "-c",
                          "256", "--lora", str(lora), "--check", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert chk.returncode == 0, chk.stderr
    rows = {r["kind"]: r for r in json.loads(chk.stdout)["check"]["rows"]}
    assert abs(rows["lora"]["predicted_bytes"] - rows["lora"]["measured_bytes"]) <= 0.005 * MIB
    assert rows["compute"]["predicted_bytes"] == rows["compute"]["measured_bytes"]
    bad = subprocess.run([sys.executable, "cli.py", "fit", str(base), "--backend", "cpu", "--budget", "4GiB",
                          "--lora", str(base)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"ggfit: error: --lora {base}: expect general.type to be 'adapter', "
                                               "but got: '' (not a LoRA adapter)"]


def test_probe_applies_the_adapters() -> None:
    """`ggfit probe MODEL --lora FILE` (python runner): llama.cpp loads the adapter after the model and applies it to
    the context; an adapter of another architecture is llama.cpp's own refusal."""
    from search.probe import probe_cli
    from search.workload import Workload

    base = _base("llama")
    wl = Workload.from_flags(prompt_tokens=16, gen_tokens=2, repeats=1, kind="prose")
    code, text = probe_cli(str(base), ["-c", "256", "--lora", str(build_lora(base, ("attn_q", "ffn_up")))],
                           runner="python", budget=None, llama_server=None, timeout=120, workload=wl, as_json=False)
    assert code == 0 and text.startswith("ok"), text
    other = build_lora(_base("qwen3"), ("attn_q",))
    code, text = probe_cli(str(base), ["-c", "256", "--lora", str(other)], runner="python", budget=None,
                           llama_server=None, timeout=120, workload=wl, as_json=False)
    assert code == 1 and "model arch and LoRA arch mismatch" in text, text
