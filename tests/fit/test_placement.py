"""Placement (issue 15): the flags in llama-server's words, the weights' devices, host memory, the placement solver,
per-GPU and host budgets, and the study's placement parameters. Exactness against llama.cpp on CUDA is
tests/fit/test_gpu_placement_recorded.py; on this CPU build llama.cpp's own dry run checks the overrides' plumbing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.bundled import resolve_model
from fitter.fit.budget import BudgetError, parse_budgets, parse_host_budget
from fitter.fit.memory import placement_of, predict
from fitter.fit.solver import solve_placement
from fitter.llama.cparams import LLM_FFN_EXPS_REGEX, Backend, ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.model import load_model_spec
from fitter.llama.weights import CPU_DEV
from fitter.oracle.check import llama_params
from fitter.oracle.llama_run import measure
from search.space import SearchSpace, SpaceDef
from tests.synth.shapes import build_shape, q4_k_m_types

ROOT = Path(__file__).resolve().parents[2]
MiB, GiB = 2**20, 2**30
BUDGET_3090 = 22000 * MiB - 1024 * MiB  # 22,000 MiB held free, less the default margin


@lru_cache(maxsize=None)
def _model(shape: str):
    return load_model_spec(str(build_shape(shape, tensor_types=q4_k_m_types(shape))))


def test_placement_flags_round_trip_in_llama_servers_words() -> None:
    args = ["-ot", r"blk\.1\.ffn_up_exps=CPU,attn=CUDA0", "--n-cpu-moe", "3", "-cmoe", "-nkvo", "--no-op-offload",
            "-sm", "none", "-mg", "1", "-ts", "3/1", "-ot", "output=CPU"]
    cfg = RunConfig.from_server_args(args).config
    assert cfg.override_tensor == (r"blk\.1\.ffn_up_exps=CPU", "attn=CUDA0", "output=CPU")
    assert (cfg.n_cpu_moe, cfg.cpu_moe, cfg.no_kv_offload, cfg.no_op_offload) == (3, True, True, True)
    assert (cfg.split_mode, cfg.main_gpu, cfg.tensor_split) == ("none", 1, (3.0, 1.0))
    flat = [a for g in cfg.to_server_args() for a in g]
    assert RunConfig.from_server_args(flat).config == cfg
    # common/common.h: --cpu-moe is LLM_FFN_EXPS_REGEX to the CPU; --n-cpu-moe N one "blk\.i<regex>" per layer
    assert cfg.tensor_overrides() == [
        (r"blk\.1\.ffn_up_exps", "CPU"), ("attn", "CUDA0"), ("output", "CPU"), (LLM_FFN_EXPS_REGEX, "CPU"),
        *[(rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU") for i in range(3)]]


def test_n_cpu_moe_patterns_match_only_their_layers_experts() -> None:
    pats = dict(RunConfig(n_cpu_moe=2).tensor_overrides())
    hits = [n for n in ("blk.0.ffn_up_exps.weight", "blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_down_exps.bias",
                        "blk.10.ffn_up_exps.weight", "blk.1.ffn_up_shexp.weight", "blk.0.attn_q.weight")
            if any(re.search(p, n) for p in pats)]
    assert hits == ["blk.0.ffn_up_exps.weight", "blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_down_exps.bias"]


@pytest.mark.slow
def test_weights_follow_the_overrides_and_the_layer_split() -> None:
    header, spec = _model("qwen36-35b-a3b")
    wp = placement_of(spec, RunConfig(n_cpu_moe=4), Backend.CUDA)
    assert wp.device_of("blk.3.ffn_up_exps.weight", 3) == CPU_DEV
    assert wp.device_of("blk.4.ffn_up_exps.weight", 4) == 0
    assert wp.device_of("blk.3.attn_gate.weight", 3) == 0
    assert wp.device_of("token_embd.weight", "input") == CPU_DEV
    two = placement_of(spec, RunConfig(tensor_split=(3.0, 1.0)), Backend.CUDA)
    # 40 layers, the NextN layer and the output layer: 42 offloaded, split 3:1 at upper_bound(il / 42)
    assert two.layer_dev.count(0) == 32 and two.layer_dev.count(1) == 10
    assert placement_of(spec, RunConfig(split_mode="none", main_gpu=1), Backend.CUDA).gpus == [1]


@pytest.mark.slow
def test_host_bytes_count_mapped_weights_by_their_tensors() -> None:
    header, spec = _model("qwen36-35b-a3b")
    cfg = RunConfig(n_ctx=4096, n_cpu_moe=8)
    mapped, copied = (predict(header, spec, cfg.model_copy(update={"no_mmap": m}), Backend.CUDA) for m in (False, True))
    mrow = next(b for b in mapped.buffers if b.device == "CPU_Mapped")
    crow = next(b for b in copied.buffers if b.device == "CUDA_Host" and b.kind == "model")
    assert mrow.tensor_bytes == crow.tensor_bytes  # the same tensors, mapped or copied into pinned memory
    assert mrow.bytes > mrow.tensor_bytes  # the mapped range spans the GPU layers' tensors between them
    assert mapped.host_bytes == mapped.total_host_bytes - mrow.bytes + mrow.tensor_bytes
    assert mapped.device_totals() == {"CUDA0": mapped.total_device_bytes}


@pytest.mark.slow
def test_solver_moves_experts_layer_by_layer_the_fewest_that_fit() -> None:
    header, spec = _model("qwen36-35b-a3b")
    base = RunConfig(n_ctx=262144)
    choice, why = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, BUDGET_3090, 64 * GiB)
    assert choice is not None and choice.lever == "n_cpu_moe" and not why
    n = choice.value

    def total(k: int) -> int:
        return predict(header, spec, base.model_copy(update={"n_cpu_moe": k}), Backend.CUDA).total_device_bytes

    assert total(n) <= BUDGET_3090 < total(n - 1)
    assert choice.flags == ["--n-cpu-moe", str(n)] and choice.n_ctx == 262144
    assert dict(choice.table)[n] >= 262144 and dict(choice.table)[0] < 262144  # more experts on the CPU, longer -c
    # the host budget bounds what lands in RAM: the experts moved cannot exceed it
    none, why = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, BUDGET_3090, 1 * GiB, table=False)
    assert none is None and "host budget" in why


@pytest.mark.slow
def test_solver_lowers_ngl_for_a_dense_model_and_refuses_on_metal() -> None:
    header, spec = _model("llama-8b")
    base = RunConfig(n_ctx=131072)
    small = 12 * GiB
    choice, _ = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, small, None, table=False)
    assert choice is not None and choice.lever == "n_gpu_layers"

    def total(k: int) -> int:
        return predict(header, spec, base.model_copy(update={"n_gpu_layers": k}), Backend.CUDA).total_device_bytes

    assert total(choice.value) <= small < total(choice.value + 1)
    none, why = solve_placement(header, spec, base, Backend.METAL, Frontend.SERVER, small, None)
    assert none is None and "unified" in why and "free nothing" in why


def test_budgets_one_per_gpu_and_the_host_budget() -> None:
    buds = parse_budgets("24GiB,12GiB", "cuda")
    assert [b.bytes for b in buds] == [24 * GiB, 12 * GiB] and "GPU 1" in buds[1].source
    with pytest.raises(BudgetError, match="one value per GPU is for CUDA"):
        parse_budgets("24GiB,24GiB", "metal")
    assert parse_host_budget("64GiB").bytes == 64 * GiB
    meminfo = "MemTotal: 100 kB\nMemAvailable: 2048 kB\n"
    assert parse_host_budget(None, meminfo=_tmp_meminfo(meminfo), system="Linux").bytes == 2048 * 1024


def _tmp_meminfo(text: str) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".meminfo", delete=False)
    f.write(text)
    f.close()
    return f.name


@pytest.mark.slow
def test_fit_proposes_an_expert_placement_with_flags_and_json() -> None:
    path = str(build_shape("qwen36-35b-a3b", tensor_types=q4_k_m_types("qwen36-35b-a3b")))
    r = subprocess.run([sys.executable, "cli.py", "fit", path, "--backend", "cuda", "--budget", "22000MiB", "-c",
                        "262144", "--host-budget", "64GiB", "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    out = json.loads(r.stdout)
    assert not out["fits"] and out["placement"]["lever"] == "n_cpu_moe"
    n = out["placement"]["value"]
    assert f"--n-cpu-moe {n}" in out["placement"]["flags"] and "-c 262144" in out["placement"]["flags"]
    cfg = RunConfig.from_server_args([a for f in out["placement"]["flags"][1:] for a in f.split(" ", 1)]).config
    header, spec = _model("qwen36-35b-a3b")
    assert predict(header, spec, cfg, Backend.CUDA).total_device_bytes == out["placement"]["total_device_bytes"]
    text = subprocess.run([sys.executable, "cli.py", "fit", path, "--backend", "cuda", "--budget", "22000MiB", "-c",
                           "262144", "--host-budget", "64GiB"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    # issue 49: the verdict says the placement fits, and exits 0 (README: exit codes)
    assert text.returncode == 0 and f"placement for -c 262144: --n-cpu-moe {n}" in text.stdout
    last = text.stdout.rstrip().splitlines()[-1]
    assert last.startswith("verdict: does NOT fit as given (over budget by ") and f"--n-cpu-moe {n}" in last
    assert out["verdict"]["verdict"] == "fits_with_placement" and r.returncode == 0


@pytest.mark.slow
def test_unknown_buffer_type_and_row_split_are_refused() -> None:
    header, spec = _model("llama-8b")
    with pytest.raises(ConfigError, match="CUDA0, CUDA1"):
        predict(header, spec, RunConfig(n_ctx=4096, override_tensor=("x=CUDA2",), tensor_split=(1, 1)), Backend.CUDA)
    with pytest.raises(ConfigError, match="-sm row"):
        predict(header, spec, RunConfig(n_ctx=4096, split_mode="row"), Backend.CUDA)


def test_study_space_searches_placement() -> None:
    space = SearchSpace(SpaceDef(n_cpu_moe=[0, 8, 16], n_gpu_layers=[99]), models=["/m/a.gguf"], n_ctx_train=4096,
                        ctx_need=1024)
    assert space.dims["n_cpu_moe"] == [0, 8, 16] and space.consts["n_gpu_layers"] == 99
    cand = space.candidate({"n_cpu_moe": 8})
    assert (cand.config.n_cpu_moe, cand.config.n_gpu_layers) == (8, 99)
    assert ["--n-cpu-moe", "8"] in cand.config.to_server_args()


@pytest.mark.slow
def test_the_cpu_builds_dry_run_takes_the_overrides() -> None:
    """llama.cpp itself parses the overrides here: CPU is a buffer type of this build, CUDA0 is not."""
    path = resolve_model("gemma3-270m")
    header, spec = load_model_spec(path)
    for cfg, status in ((RunConfig(n_ctx=512, override_tensor=(r"blk\.1\.=CPU",), no_kv_offload=True), "ok"),
                        (RunConfig(n_ctx=512, override_tensor=("blk=CUDA0",)), "error")):
        run = measure(path, llama_params(resolve_context(spec, cfg, Frontend.SERVER), cfg), mode="dry", log_level="info")
        assert run.status == status, run.message
        if status == "ok":
            p = predict(header, spec, cfg, Backend.CPU)
            assert run.breakdown_total("model") == sum(b.tensor_bytes or b.bytes for b in p.buffers if b.kind == "model")
        else:
            assert "unknown buffer type 'CUDA0'" in run.message


@pytest.mark.slow
def test_fit_with_a_budget_per_gpu_splits_by_the_budgets_and_checks_each_gpu() -> None:
    path = str(build_shape("qwen36-35b-a3b", tensor_types=q4_k_m_types("qwen36-35b-a3b")))
    r = subprocess.run([sys.executable, "cli.py", "fit", path, "--backend", "cuda", "--budget", "16GiB,8GiB", "--margin", "1GiB", "-c",
                        "65536", "--host-budget", "64GiB", "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    out = json.loads(r.stdout)
    totals = out["device_totals"]
    assert set(totals) == {"CUDA0", "CUDA1"} and totals["CUDA0"] > totals["CUDA1"]  # -ts 16,8 from the budgets
    assert out["headroom_bytes"] == max(totals["CUDA0"] - 15 * GiB, totals["CUDA1"] - 7 * GiB) * -1
    p = out["placement"]
    assert p is not None and "-ts 16,8" in p["flags"] and p["headroom_bytes"] >= 0


@pytest.mark.slow
def test_a_moe_model_too_big_even_with_every_expert_on_the_cpu_gets_fewer_layers_too() -> None:
    header, spec = _model("qwen36-35b-a3b")
    base = RunConfig(n_ctx=32768)
    choice, _ = solve_placement(header, spec, base, Backend.CUDA, Frontend.SERVER, 2 * GiB, None, table=False)
    assert choice is not None and choice.lever == "n_gpu_layers" and choice.n_cpu_moe == spec.n_layer
    assert choice.flags == ["--n-cpu-moe", str(spec.n_layer), "-ngl", str(choice.value)]
    cfg = base.model_copy(update=choice.update)
    assert predict(header, spec, cfg, Backend.CUDA).total_device_bytes == choice.total_device_bytes <= 2 * GiB
