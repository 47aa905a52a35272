"""`ggfit calibrate --log`: users' own llama.cpp logs (tests/data/llama_logs, public, with their sources in
index.json), read and compared with the prediction for the build and settings they print.

Every number asserted from a log is the number the log prints. Which logs are predicted, and with what model:
a synthetic twin of the log's model (tests/synth: the published hyperparameters, a predicted quant mix),
written where the log says which model it is and ggfit has a builder for its architecture:

  log                          tool        backend  build                     twin
  03-metal-b8999               llama-server Metal   b8999 (its build line)    Qwen3.5-9B, Q4_K_S mix
  10-metal-b9010               llama-cli   Metal    b9010 (its build line)    Qwen3-4B, Q4_K_M mix
  05-cuda-bunknown             llama-server CUDA    none: --llama-build given  Qwen3.6-27B with its MTP layer (F16)
  07-cuda-bunknown             llama-server CUDA    none: --llama-build given  Llama 3.1 8B (F16)
  13-metal-bunknown            llama-server Metal   none: --llama-build given  Qwen3.6-35B-A3B (F16)
  20-metal-bunknown            llama-cli   Metal    none: --llama-build given  gpt-oss-20b (F16)
  26-metal-fit-print           llama-fit-params Metal none: --llama-build given Gemma 3 4B (F16, as the file)

Every other log is checked for parsing only (its model is not named, has no builder, or the excerpt holds no
settings): among them CPU (16-19), Vulkan (04, 08), CUDA 01/02/05/06/14/15/21/22, and the llama-fit-params
logs 23 and 25 (late 2025).

Model buffers are exact only where the twin's quant mix is the file's (10); KV, recurrent state and output
buffers are exact in every predicted log. Compute buffers follow each log's build's rules; COMPUTE_TOLERANCE
records the relative error per log as an upper bound (the issue's target with the build given: 2% median, 5%
worst; the Metal logs with a build line: 03 and 10 exact, 26 within its whole MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import PINNED, resolve_build
from fitter.oracle import user_log
from fitter.oracle.calibrate import compare_log
from fitter.oracle.user_log import LogError, parse_user_log, read_user_log

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "data" / "llama_logs"
MiB = 2**20


def mib(x: float) -> int:
    return round(x * MiB)


# --- twins -------------------------------------------------------------------------------------------

_Q35_9B = dict(n_layer=32, n_embd=4096, n_head=16, n_head_kv=4, head_dim=256, n_rot=64, n_ff=12288,
               full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
               n_vocab=248320, n_ctx_train=262144)  # Qwen3.5-9B (the log: 8 attention layers of 4 KV heads x 256)
_Q3_4B = dict(n_layer=36, n_embd=2560, n_head=32, n_head_kv=8, head_dim=128, n_ff=9728, n_vocab=151936,
              n_ctx_train=40960, tie_embeddings=True)  # Qwen3-4B


def _quantized(arch: str, quant: str, **kw: object) -> str:
    """A sparse full-size twin with the tensor types fitter.fit.quants predicts for `quant`."""
    from fitter.fit.quants import predict_quant
    from fitter.gguf.reader import read_header
    from tests.synth import build

    f16 = build(arch, sparse=True, **kw)
    types = {t.name: t.type_name.lower() for t in predict_quant(read_header(f16), quant).tensors}
    return str(build(arch, sparse=True, tensor_types=types, **kw))


@pytest.fixture(scope="module")
def twins() -> dict[str, str]:
    from tests.synth import build
    from tests.synth.shapes import build_shape

    return {
        "03": _quantized("qwen35", "Q4_K_S", **_Q35_9B),
        "10": _quantized("qwen3", "Q4_K_M", **_Q3_4B),
        # Qwen3.6-27B: 64 layers (16 with attention: 4 KV heads of 256), gated delta net 16 key / 48 value heads,
        # one MTP layer (the log's recurrent state counts 65 layers)
        "05": str(build("qwen35", sparse=True, n_layer=64, n_embd=5120, n_head=24, n_head_kv=4, head_dim=256, n_rot=64,
                        n_ff=17408, full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
                        ssm_dt_rank=48, n_vocab=248320, n_ctx_train=262144, n_nextn=1)),
        "07": str(build_shape("llama-8b")),
        "13": str(build_shape("qwen36-35b-a3b")),
        "20": str(build_shape("gpt-oss-20b")),
        # Gemma 3 4B: 34 layers (5 sliding-window of 1024 to 1 global), 8 heads, 4 KV heads of 256
        "26": str(build("gemma3", sparse=True, n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, head_dim=256,
                        n_ff=10240, n_vocab=262208, n_ctx_train=131072, sliding_window=1024,
                        rope_freq_base=1000000.0, rope_freq_base_swa=10000.0)),
    }


# --- parsing: every log of the corpus --------------------------------------------------------------

# file -> (build line, backend, tool, {(kind, buffer): MiB printed})
PARSED: dict[str, tuple[tuple[int, str | None] | None, str | None, str | None, dict[tuple[str, str], float]]] = {
    "01-cuda-b9525.log": ((9525, "ad1b88ca0"), "CUDA", None,
                          {("output", "CUDA_Host"): 2.00, ("kv", "CUDA0"): 189.00, ("rs", "CUDA0"): 1576.50}),
    "02-cuda-b10615.log": (None, "CUDA", None,
                           {("output", "CUDA_Host"): 0.49, ("kv", "CUDA0"): 182.75, ("state", "CUDA0"): 1.31 + 10.00 + 0.33}),
    "03-metal-b8999.log": ((8999, "b97ebdc98"), "Metal", None,
                           {("model", "CPU_Mapped"): 545.62, ("model", "MTL0_Mapped"): 5133.75, ("output", "CPU"): 0.95,
                            ("kv", "MTL0"): 4352.00, ("rs", "MTL0"): 50.25, ("compute", "MTL0"): 832.60,
                            ("compute", "CPU"): 528.29}),
    "04-vulkan-b9849.log": (None, "Vulkan", "llama-server",
                            {("model", "CPU_Mapped"): 2152.50, ("model", "Vulkan1"): 1341.76, ("output", "Vulkan_Host"): 4.00,
                             ("kv", "Vulkan1"): 48.00 + 48.00, ("compute", "Vulkan1"): 560.07,
                             ("compute", "Vulkan_Host"): 142.09}),
    "05-cuda-bunknown.log": (None, "CUDA", None,
                             {("output", "CUDA_Host"): 3.79, ("kv", "CUDA0"): 4352.00, ("rs", "CUDA0"): 598.50,
                              ("compute", "CUDA0"): 495.00, ("compute", "CUDA_Host"): 276.29}),
    "06-cuda-bunknown.log": (None, "CUDA", None,
                             {("output", "CUDA_Host"): 0.95, ("kv", "CPU"): 4608.00, ("kv", "CUDA0"): 3584.00,
                              ("rs", "CPU"): 93.52, ("rs", "CUDA0"): 56.11}),
    "07-cuda-bunknown.log": (None, "CUDA", None,
                             {("output", "CUDA_Host"): 0.49, ("kv", "CPU"): 2304.00, ("kv", "CUDA0"): 1792.00,
                              ("compute", "CUDA0"): 248.00, ("compute", "CUDA_Host"): 48.01}),
    "08-vulkan-bunknown.log": (None, "Vulkan", None,
                               {("model", "CPU_Mapped"): 2555.45, ("model", "Vulkan1"): 3123.80,
                                ("output", "Vulkan_Host"): 3.79, ("kv", "CPU"): 96.00, ("kv", "Vulkan1"): 160.00,
                                ("rs", "CPU"): 100.50, ("rs", "Vulkan1"): 100.50, ("compute", "Vulkan1"): 498.00}),
    # a fit pass: the KV line is a 0.00 MiB dummy, the cache's size line (2176 MiB) stands in for it
    "09-metal-bunknown.log": (None, "Metal", None,
                              {("output", "CPU"): 0.95, ("kv", "MTL0"): 2176.00, ("rs", "MTL0"): 351.75,
                               ("compute", "MTL0"): 501.00, ("compute", "CPU"): 272.29 * 2}),
    "10-metal-b9010.log": ((9010, "d05fe1d7d"), "Metal", None,
                           {("model", "CPU_Mapped"): 304.28, ("model", "MTL0_Mapped"): 2375.91, ("kv", "MTL0"): 288.00,
                            ("compute", "MTL0"): 301.75}),
    "11-metal-b10950.log": (None, "Metal", None, {("compute", "MTL0"): 53.43, ("compute", "CPU"): 22.68}),
    "12-metal-bunknown.log": (None, "Metal", None, {("compute", "MTL0"): 300.25, ("compute", "CPU"): 4.51}),
    "13-metal-bunknown.log": (None, "Metal", None,
                              {("model", "CPU"): 272.81, ("model", "MTL0"): 21171.18, ("kv", "MTL0"): 2720.00}),
    "14-cuda-bunknown.log": (None, "CUDA", None,
                             {("compute", "CUDA0"): 1366.07, ("compute", "CUDA1"): 636.07, ("compute", "CUDA2"): 632.07,
                              ("compute", "CUDA3"): 5223.02, ("compute", "CUDA_Host"): 1063.09}),
    "15-cuda-bunknown.log": (None, "CUDA", None, {("rs", "CUDA0"): 50.25}),
    "16-cpu-bunknown.log": (None, "CPU", None, {("model", "CPU_Mapped"): 8300.36, ("output", "CPU"): 0.58}),
    "17-cpu-bunknown.log": (None, "CPU", None, {("compute", "CPU"): 534.50}),
    "18-cpu-bunknown.log": (None, "CPU", None, {("compute", "CPU"): 70.50}),
    "19-cpu-b11026.log": (None, "CPU", None, {("compute", "CPU"): 271.17}),  # b11026 is in the header, not a log line
    "20-metal-bunknown.log": (None, "Metal", None,
                              {("output", "CPU"): 0.77, ("kv", "MTL0"): 3072.00 + 18.00, ("compute", "MTL0"): 420.08,
                               ("compute", "CPU"): 268.77}),
    "21-cuda-bunknown.log": (None, "CUDA", "llama-server", {}),
    "22-cuda-b8284.log": ((8284, "00de61534"), "CUDA", None, {}),
    "23-cuda-b6895-fit-params.log": ((6895, "4341dc8bc"), "CUDA", "llama-fit-params", {}),
    # no buffer line: the breakdown table's (or --fit-print's) whole MiB stand in, "context" = KV + RS + outputs
    "24-cuda-b6895-breakdown.log": ((6895, "4341dc8bc"), "CUDA", "llama-server",
                                    {("model", "CUDA0"): 17904, ("context", "CUDA0"): 384, ("compute", "CUDA0"): 898,
                                     ("model", "CPU"): 58259, ("compute", "CPU"): 12}),
    "25-cuda-b7003-fit-params.log": ((7003, "596a297cb"), "CUDA", "llama-fit-params", {}),
    "26-metal-fit-print.log": (None, "Metal", "llama-fit-params",
                               {("model", "MTL0"): 7401, ("context", "MTL0"): 814, ("compute", "MTL0"): 517,
                                ("model", "CPU"): 1280, ("compute", "CPU"): 154}),
}


def test_the_table_covers_the_corpus() -> None:
    index = json.loads((LOGS / "index.json").read_text())
    assert sorted(e["file"] for e in index["logs"]) == sorted(p.name for p in LOGS.glob("*.log")) == sorted(PARSED)


@pytest.mark.parametrize("name", sorted(PARSED))
def test_every_printed_buffer_is_read(name: str) -> None:
    build, backend, tool, buffers = PARSED[name]
    log = read_user_log(LOGS / name)
    assert log.build == build
    assert log.backend == backend
    assert log.tool == tool
    assert {(k, b): round(n / MiB, 2) for k, b, n in log.buffers()} == {k: round(v, 2) for k, v in buffers.items()}


def test_settings_and_model_as_printed() -> None:
    s = read_user_log(LOGS / "03-metal-b8999.log").settings
    assert (s.n_ctx, s.n_ctx_seq, s.n_batch, s.n_ubatch, s.n_seq_max) == (262144, 262144, 512, 512, 1)
    assert (s.flash_attn, s.type_k, s.type_v, s.kv_unified, s.offloaded_layers, s.total_layers, s.mmap) == \
        ("enabled", "q8_0", "q8_0", False, 33, 33, True)
    # n_seq_max and kv_unified from the KV cache's "4/1 seqs" (llama-server -np auto)
    s = read_user_log(LOGS / "05-cuda-bunknown.log").settings
    assert (s.n_seq_max, s.kv_unified, s.n_ctx_seq, s.n_ubatch, s.flash_attn) == (4, True, 131072, 512, "enabled")
    # "Flash Attention was auto, set to enabled", the iSWA caches without the full-size warning
    s = read_user_log(LOGS / "20-metal-bunknown.log").settings
    assert (s.flash_attn_resolved, s.swa_full, s.type_k) == (True, False, "f16")
    # ollama's runner: load_mode none (no mmap), llama-server's slots line in 21
    assert read_user_log(LOGS / "13-metal-bunknown.log").settings.mmap is False
    s = read_user_log(LOGS / "21-cuda-bunknown.log").settings
    assert (s.n_seq_max, s.kv_unified) == (1, False)
    assert read_user_log(LOGS / "24-cuda-b6895-breakdown.log").model.path == "/opt/models/qwen_3-30b3a-f16.gguf"
    assert read_user_log(LOGS / "12-metal-bunknown.log").worst_case == (512, 1, 1)


def test_memory_breakdown_table_with_unaccounted() -> None:
    rows = read_user_log(LOGS / "24-cuda-b6895-breakdown.log").breakdown
    dev, host = rows
    assert (dev.name, dev.description, dev.total_mib, dev.free_mib, dev.self_mib, dev.model_mib, dev.context_mib,
            dev.compute_mib, dev.unaccounted_mib) == ("CUDA0", "RTX 4090", 24077, 945, 19187, 17904, 384, 898, 3945)
    assert (host.name, host.self_mib, host.model_mib, host.context_mib, host.compute_mib, host.unaccounted_mib) == \
        ("Host", 58271, 58259, 0, 12, None)
    # common_memory_breakdown_print (the function's later name), a negative unaccounted on a unified-memory Mac
    rows = read_user_log(LOGS / "03-metal-b8999.log").breakdown
    assert [(r.name, r.self_mib, r.model_mib, r.context_mib, r.compute_mib, r.unaccounted_mib) for r in rows] == \
        [("MTL0", 9822, 4588, 4402, 832, -9772), ("Host", 1602, 545, 0, 1056, None)]


def test_llama_fit_params_output() -> None:
    log = read_user_log(LOGS / "23-cuda-b6895-fit-params.log")
    assert (log.fit_projected_mib, log.fit_free_mib) == (61807, 24077)
    assert [(d.name, d.used_mib) for d in log.fit_devices] == [("CUDA0", 19187)]
    assert log.fit_args is not None and log.fit_args.startswith("-c 4096 -ngl 48 -ot blk\\.14\\.ffn_(up|down|gate)")
    assert log.model.path == "/opt/models/qwen_3-30b3a-f16.gguf"
    log = read_user_log(LOGS / "25-cuda-b7003-fit-params.log")
    assert (log.fit_projected_mib, log.fit_free_mib) == (410593, 97017)
    assert [(d.name, d.used_mib) for d in log.fit_devices] == [("CUDA0", 201672), ("CUDA1", 208920)]
    log = read_user_log(LOGS / "26-metal-fit-print.log")
    assert [(d.name, d.model_mib, d.context_mib, d.compute_mib) for d in log.fit_devices] == \
        [("MTL0", 7401, 814, 517), ("host", 1280, 0, 154)]


def test_failed_allocations_in_exact_bytes() -> None:
    log = read_user_log(LOGS / "21-cuda-bunknown.log")
    assert [(a.buffer, a.bytes) for a in log.alloc_failures] == [(None, mib(51748.72)), ("CUDA1", 54262464512)]


# --- what users paste ------------------------------------------------------------------------------

def _body(name: str) -> list[str]:
    return [ln for ln in (LOGS / name).read_text().splitlines() if not ln.startswith("#")]


def test_windows_line_endings_colours_and_prefixes_read_the_same() -> None:
    lines = _body("03-metal-b8999.log")
    plain = parse_user_log("\n".join(lines))
    dressed = "\r\n".join(
        (f"2026-05-14 22:14:30.{i:03d} | " if i % 3 == 0 else f"0.08.770.{i:03d} I " if i % 3 == 1 else "[34353] ")
        + (f"\x1b[32m{ln}\x1b[0m" if i % 2 else ln)
        for i, ln in enumerate(lines)
    )
    got = parse_user_log(dressed)
    assert got.buffers() == plain.buffers() and got.settings == plain.settings and got.build == plain.build
    assert got.breakdown == plain.breakdown
    # a module tag before llama_context's lines (srv, cmn, ...)
    tagged = parse_user_log("\n".join(("ctx  " + ln) if ln.startswith("llama_context:") else ln for ln in lines))
    assert tagged.settings == plain.settings


def test_a_truncated_log_reads_what_is_there(tmp_path: Path) -> None:
    text = (LOGS / "03-metal-b8999.log").read_text()
    cut = text[: text.index("sched_reserve:       MTL0 compute buffer size =") + 52]  # mid-line
    p = tmp_path / "cut.log"
    p.write_text(cut)
    log = read_user_log(p)
    assert ("kv", "MTL0", mib(4352.00)) in log.buffers()
    assert not any(k == "compute" for k, _, _ in log.buffers())


def test_reading_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (LOGS / "03-metal-b8999.log").read_text()
    p = tmp_path / "long.log"
    p.write_text(text + "srv  update_slots: all slots are idle\n" * 20000)
    monkeypatch.setattr(user_log, "MAX_LOG_BYTES", len(text.encode()) + 1000)
    log = read_user_log(p)
    assert log.truncated and log.bytes_read == len(text.encode()) + 1000
    assert ("compute", "MTL0", mib(832.60)) in log.buffers()


@pytest.mark.parametrize("content, why", [
    (b"GGUF\x03\x00\x00\x00" + bytes(4000), "a binary file"),
    (bytes(range(256)) * 100, "a binary file"),
    (b"", "no line llama.cpp prints"),
    (b"hello\nworld\n" * 1000, "no line llama.cpp prints"),
    (b"x" * (8 << 20), "no line llama.cpp prints"),  # one 8 MiB line: read, cut per line, refused quickly
], ids=["gguf", "bytes", "empty", "text", "one-long-line"])
def test_what_is_not_a_log_is_one_clear_line(tmp_path: Path, content: bytes, why: str) -> None:
    p = tmp_path / "x.log"
    p.write_bytes(content)
    with pytest.raises(LogError, match=why):
        read_user_log(p)
    out = _ggfit("calibrate", "--log", str(p))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("ggfit: error: ") and why in out.stderr, out.stderr


def test_missing_file_and_directory(tmp_path: Path) -> None:
    for path, why in ((tmp_path / "none.log", "no such file"), (tmp_path, "a directory")):
        out = _ggfit("calibrate", "--log", str(path))
        assert out.returncode == 2 and out.stderr == f"ggfit: error: --log {path}: {why}" + (
            ", not a log file\n" if why == "a directory" else "\n")


# --- calibrate --log ---------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GGFIT_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    return tmp_path / "ggfit" / "calibration.json"


def _ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ))


def _json(*args: str) -> dict:
    out = _ggfit("calibrate", *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _rows(data: dict) -> dict[tuple[str, str], tuple[int | None, int | None]]:
    return {(r["kind"], r["side"]): (r["predicted_bytes"], r["printed_bytes"]) for r in data["rows"]}


TOL = 5243  # a two-decimal MiB figure is known to +-0.005 MiB (fitter.oracle.llama_log.PRINT_TOLERANCE_BYTES)

# Today's relative error of the compute buffers (predicted - printed) / printed, per log, as an upper bound:
# every build is still predicted with the pinned build's rules. Why each is off, from the leads:
COMPUTE_TOLERANCE = {
    # relative error of the predicted compute buffer, with each log's build's rules (fitter.llama_builds.changes)
    "03": {"device": 0.00001, "host": 0.00001},  # Metal b8999: exact (-1.96% before Metal's reorder was modelled)
    "10": {"device": 0.001},  # Metal b9010: exact
    "05": {"device": 0.021, "host": 0.001},  # CUDA, a build of the log's date (2026-05-14; no build line): +2.0%
    # no build line, compared as the pinned build: CUDA0 +72 MiB; Metal +4.7%, and the breakdown's Host compute is
    # twice the CPU compute buffer (as in log 03's table)
    "07": {"device": 0.30, "host": 0.001},
    "20": {"device": 0.05, "host": 0.48},
}


def _check_compute(key: str, data: dict) -> None:
    rows = _rows(data)
    for side, tol in COMPUTE_TOLERANCE[key].items():
        p, m = rows[("compute", side)]
        assert p is not None and m is not None and abs(p - m) <= tol * m, (key, side, p, m)


def test_metal_server_log_of_b8999(store: Path, twins: dict[str, str]) -> None:
    data = _json("--log", str(LOGS / "03-metal-b8999.log"), twins["03"])
    assert data["build"].startswith("llama.cpp b8999 b97ebdc98") and data["backend"] == "metal"
    rows = _rows(data)
    for key, printed in ((("kv", "device"), 4352.00), (("rs", "device"), 50.25), (("output", "host"), 0.95),
                         (("model", "host"), 545.62)):
        p, m = rows[key]
        assert m == mib(printed) and abs(p - m) <= TOL, (key, p, m)
    assert data["config"]["n_ctx"] == 262144 and data["config"]["type_k"] == "q8_0" and data["config"]["flash_attn"] == "on"
    _check_compute("03", data)
    # stored for qwen35 on metal, b8999: a ratio printed / predicted per compute buffer, here 1 (exact to the print)
    cal = data["stored"]["calibration"]
    assert (cal["architecture"], cal["backend"], cal["llama_cpp"], cal["source"]) == ("qwen35", "metal", "b8999", "log")
    p, m = rows[("compute", "device")]
    assert abs(p - m) <= TOL and cal["device"]["a"] == 0 and cal["device"]["b"] == 1.0
    assert json.loads(store.read_text())["format"] == 2


def test_stored_log_residual_applies_to_that_build_only(store: Path, twins: dict[str, str]) -> None:
    _json("--log", str(LOGS / "03-metal-b8999.log"), twins["03"])
    again = _json("--log", str(LOGS / "03-metal-b8999.log"), twins["03"])  # the same log: still one point
    assert len(again["stored"]["calibration"]["logs"]) == 1
    header, spec = load_model_spec(twins["03"])
    cfg = RunConfig(n_ctx=65536, type_k="q8_0", type_v="q8_0", flash_attn="on", n_parallel=1)
    raw = predict(header, spec, cfg, Backend.METAL, build=resolve_build("b8999"), calibrated=False)
    got = predict(header, spec, cfg, Backend.METAL, build=resolve_build("b8999"))
    assert [a.llama_cpp for a in got.calibration] == ["b8999"]
    ratio = again["stored"]["calibration"]["device"]["b"]
    dev = [b for b in raw.buffers if b.kind == "compute" and b.device == "MTL0"][0].bytes
    assert [b for b in got.buffers if b.kind == "compute" and b.device == "MTL0"][0].bytes == round(ratio * dev)
    assert predict(header, spec, cfg, Backend.METAL, build=PINNED).calibration == []
    assert predict(header, spec, cfg, Backend.CUDA, build=resolve_build("b8999")).calibration == []
    listed = _ggfit("calibrate", "--list")
    assert "qwen35 on metal, llama.cpp b8999" in listed.stdout and "learned from 03-metal-b8999.log" in listed.stdout


def test_metal_llama_cli_log_of_b9010(store: Path, twins: dict[str, str]) -> None:
    data = _json("--log", str(LOGS / "10-metal-b9010.log"), twins["10"], "--no-store")
    assert data["build"].startswith("llama.cpp b9010 d05fe1d7d") and data["stored"] is None and not store.exists()
    rows = _rows(data)
    # the twin's Q4_K_M mix is the file's: the weights are exact
    for key, printed in ((("model", "device"), 2375.91), (("model", "host"), 304.28), (("kv", "device"), 288.00)):
        p, m = rows[key]
        assert m == mib(printed) and abs(p - m) <= TOL, (key, p, m)
    assert data["config"]["n_ctx"] == 2048 and "n_ubatch" in data["assumed"]  # the fixture kept no n_ubatch line
    _check_compute("10", data)


def test_cuda_log_without_build_line_needs_llama_build(store: Path, twins: dict[str, str]) -> None:
    log = str(LOGS / "07-cuda-bunknown.log")
    out = _ggfit("calibrate", "--log", log, twins["07"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == (f"ggfit: error: {log}: no llama.cpp build line in it (like 'build: 9102 (7d442abf5)'), and "
                          "what llama.cpp reserves depends on the build; give it with --llama-build bNNNN, a commit or "
                          "a date (llama-server --version prints it)\n")
    assert "1,792.00 MiB" in out.stdout  # what the log says is still shown
    assert not store.exists()
    data = _json("--log", log, twins["07"], "--llama-build", "pinned", "--no-store")
    rows = _rows(data)
    # -ngl read from the KV cache's split: 14 of 32 layers' KV on CUDA0, i_gpu_start = 32 + 1 - 15 = 18
    assert data["config"]["n_gpu_layers"] == 15 and data["backend"] == "cuda"
    for key, printed in ((("kv", "device"), 1792.00), (("kv", "host"), 2304.00), (("output", "host"), 0.49)):
        p, m = rows[key]
        assert m == mib(printed) and abs(p - m) <= TOL, (key, p, m)
    _check_compute("07", data)


def test_cuda_server_log_of_a_hybrid_with_recurrent_state(store: Path, twins: dict[str, str]) -> None:
    log = str(LOGS / "05-cuda-bunknown.log")
    assert _ggfit("calibrate", "--log", log, twins["05"]).returncode == 2  # no build line (b484 is not llama.cpp's)
    data = _json("--log", log, twins["05"], "--llama-build", "2026-05-14", "--no-store")
    cfg = data["config"]
    assert (cfg["n_ctx"], cfg["n_parallel"], cfg["kv_unified"], cfg["type_k"], cfg["flash_attn"]) == \
        (131072, 4, True, "q8_0", "on")  # n_ctx from n_ctx_seq (unified), 4/1 seqs: -np auto
    rows = _rows(data)
    for key, printed in ((("kv", "device"), 4352.00), (("rs", "device"), 598.50), (("output", "host"), 3.79)):
        p, m = rows[key]
        assert m == mib(printed) and abs(p - m) <= TOL, (key, p, m)
    _check_compute("05", data)


def test_iswa_llama_cli_log_and_a_moe_hybrid(store: Path, twins: dict[str, str]) -> None:
    data = _json("--log", str(LOGS / "20-metal-bunknown.log"), twins["20"], "--llama-build", "pinned", "--no-store")
    p, m = _rows(data)[("kv", "device")]
    assert m == mib(3072.00 + 18.00) and abs(p - m) <= 2 * TOL  # the full cache and the 768-cell SWA cache
    assert data["config"]["n_ctx"] == 131072 and "n_ctx" in data["assumed"]  # from the KV cache's cells
    _check_compute("20", data)
    data = _json("--log", str(LOGS / "13-metal-bunknown.log"), twins["13"], "--llama-build", "pinned", "--no-store")
    p, m = _rows(data)[("kv", "device")]
    assert m == mib(2720.00) and abs(p - m) <= TOL and data["config"]["no_mmap"] is True


def test_log_without_its_model_prints_what_it_says(store: Path) -> None:
    out = _ggfit("calibrate", "--log", str(LOGS / "01-cuda-b9525.log"))
    assert out.returncode == 0, out.stderr
    assert "1,576.50" in out.stdout and "189.00" in out.stdout and "llama.cpp b9525 ad1b88ca0" in out.stdout
    assert "not predicted: the log's model is not on this machine: give it as MODEL" in out.stdout
    data = _json("--log", str(LOGS / "24-cuda-b6895-breakdown.log"), "--llama-build", "2025-11-01")
    assert data["missing"].startswith("the log's model (/opt/models/qwen_3-30b3a-f16.gguf) is not on this machine")
    assert data["log"]["breakdown"][0]["unaccounted_mib"] == 3945 and data["stored"] is None
    assert not store.exists()


def test_fit_params_log_of_a_2025_build_is_dated(store: Path) -> None:
    """b6895 (October 2025) was outside the builds ggfit could date until issue 49 took the range back to b6000."""
    log = str(LOGS / "23-cuda-b6895-fit-params.log")
    out = _ggfit("calibrate", "--log", log)
    assert out.returncode == 0, out.stderr
    assert "llama.cpp b6895 4341dc8bc 2025-10-31" in out.stdout
    out = _ggfit("calibrate", "--log", log, "--llama-build", "2025-11-01")
    assert out.returncode == 0, out.stderr
    assert "llama-fit-params projected 61,807 MiB of device memory vs 24,077 MiB free" in out.stdout
    assert "llama-fit-params arguments: -c 4096 -ngl 48 -ot" in out.stdout


def test_backend_ggfit_does_not_model_needs_backend(store: Path, gemma: str) -> None:
    data = _json("--log", str(LOGS / "04-vulkan-b9849.log"), "gemma3-270m", "--llama-build", "b9849")
    assert data["missing"].startswith("the log's backend is Vulkan; ggfit models metal, cuda and cpu: give --backend")
    assert data["rows"] and all(r["predicted_bytes"] is None for r in data["rows"])


def test_options_that_go_with_log() -> None:
    for args, msg in ((("--llama-build", "b9010"), "--llama-build goes with --log FILE"),
                      (("--no-store",), "--no-store goes with --log FILE"),
                      (("--log", "x.log", "--list"), "--log with --list or --clear: use one at a time")):
        out = _ggfit("calibrate", *args)
        assert out.returncode == 2 and out.stderr.startswith(f"ggfit: error: {msg}"), out.stderr


def test_compare_log_reads_the_config_from_the_log(twins: dict[str, str]) -> None:
    cmp = compare_log(read_user_log(LOGS / "03-metal-b8999.log"), twins["03"])
    assert cmp.config is not None and cmp.prediction is not None
    cp = cmp.prediction.context
    assert (cp.n_ctx, cp.n_ctx_seq, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified, cp.flash_attn) == \
        (262144, 262144, 512, 512, 1, False, True)
    assert cmp.assumed == {"frontend": "llama-server (the log does not say which tool wrote it)"}


def test_the_model_the_log_names_is_used_when_it_is_here(tmp_path: Path, store: Path, twins: dict[str, str]) -> None:
    # 10's lines, with the loader's line naming a file that is on this machine (the twin)
    body = _body("10-metal-b9010.log")
    body.insert(1, f"llama_model_loader: loaded meta data with 30 key-value pairs and 399 tensors from {twins['10']} "
                   "(version GGUF V3 (latest))")
    p = tmp_path / "user.log"
    p.write_text("\n".join(body) + "\n")
    data = _json("--log", str(p), "--no-store")
    assert data["model"] == twins["10"] and data["architecture"] == "qwen3"
    assert f"model: the log's own {twins['10']}" in data["notes"]
    p_, m = _rows(data)[("kv", "device")]
    assert m == mib(288.00) and abs(p_ - m) <= TOL


def test_backend_given_for_a_vulkan_log(store: Path, gemma: str) -> None:
    # Vulkan1 is the device, Vulkan_Host host memory: compared side by side with CUDA0 and CUDA_Host
    data = _json("--log", str(LOGS / "04-vulkan-b9849.log"), "gemma3-270m", "--backend", "cuda", "--no-store",
                 "--llama-build", "b9849")  # the build its source names (the kept lines have no build line)
    assert data["backend"] == "cuda" and data["missing"] is None
    rows = {(r["kind"], r["side"]): r for r in data["rows"]}
    assert rows[("compute", "device")]["printed_buffers"] == ["Vulkan1"]
    assert rows[("compute", "device")]["predicted_buffers"] == ["CUDA0"]
    assert rows[("compute", "device")]["printed_bytes"] == mib(560.07)
    assert data["config"]["n_parallel"] == 4 and data["config"]["kv_unified"] is True  # -np auto, as printed


def test_llama_fit_params_fit_print_log(store: Path, twins: dict[str, str]) -> None:
    # no buffer line: --fit-print's whole MiB per device (model, context = KV + RS + outputs, compute), floored
    log = str(LOGS / "26-metal-fit-print.log")
    data = _json("--log", log, twins["26"], "--llama-build", "2026-04-20", "--no-store")
    assert data["config"]["n_ctx"] == 32768 and data["assumed"]["n_ctx"].startswith("32768 (--ctx-size 32768 on")
    assert data["frontend"] == "library"  # llama-fit-params: common_context_params_to_llama, n_outputs_max = n_batch
    rows = _rows(data)
    for key, printed in ((("model", "device"), 7401), (("model", "host"), 1280), (("context", "device"), 814),
                         (("compute", "device"), 517)):
        p, m = rows[key]
        assert m == printed * MiB and m <= p < m + MiB, (key, p, m)
    p, m = rows[("compute", "host")]
    assert m == 154 * MiB and abs(p - m) <= 0.72 * m  # the host compute of an April build: the era rules' part


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pinned_llama_server_log_matches_the_prediction(tmp_path: Path, store: Path, llama_server: str,
                                                        gemma: str) -> None:
    """A whole real log (-v) of the pinned llama-server, run here on the CPU: its build line
    ("build 0 (0c1e57098bba)", no build number) is the pinned build, the model it loads is here, the fit pass's
    dry load before the run is set apart, and every buffer the run prints is the prediction within the print's
    precision."""
    import signal
    import time

    log = tmp_path / "server.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([llama_server, "-m", gemma, "-c", "4096", "-np", "2", "--no-repack", "-v",
                                 "-t", "1", "--no-warmup", "--host", "127.0.0.1", "--port", str(_free_port())],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "server is listening" not in log.read_text(errors="replace") and "listening on" not in \
                log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ulog = read_user_log(log)
    # build 0 (None) from the sdist's vendored tree alone, 1 from the whole sdist (a one-commit shallow clone)
    assert ulog.build in ((None, "0c1e57098bba"), (1, "0c1e57098bba"))
    assert ulog.tool == "llama-server" and ulog.backend == "CPU"
    assert ulog.model.path == gemma and ulog.breakdown and ulog.breakdown[0].name == "Host"
    assert ulog.notes == ["the log's first load is llama.cpp's fit pass (a dry run, no_alloc): the run after it is "
                          "compared"]
    data = _json("--log", str(log))  # MODEL: the one the log loads
    assert data["build"].startswith("llama.cpp b11312 0c1e57098") and data["model"] == gemma
    assert data["config"]["n_ctx"] == 4096 and data["config"]["n_parallel"] == 2 and data["frontend"] == "server"
    for r in data["rows"]:
        lines = 2 if r["kind"] == "kv" else len(r["printed_buffers"])  # the iSWA model prints two KV caches
        assert r["printed_bytes"] is not None and abs(r["diff_bytes"]) <= TOL * lines, r
    cal = data["stored"]["calibration"]
    assert cal["llama_cpp"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f" and cal["device"]["b"] == 1.0
