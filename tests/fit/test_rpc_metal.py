"""--rpc with a Mac's rpc-server serving its Metal device (`rpc-server -d MTL0`, RunConfig.rpc_backends MTL).

No recording exists (no Mac here): these tests hold the remote Metal device to the local Metal backend's rules where
the two coincide. Over RPC the client allocates with the remote Metal buffer type (alignment 32, Metal's
get_alloc_size where ggml_backend_rpc_buffer_type_get_alloc_size asks), but with RPC's ops (supports_op true for every
op), a real load's scheduler (layer pins) and no graph_optimize (RPC's is NULL: no Metal reorder), and the weights
copied, never mapped. A local Metal backend given those same three rules, and --no-mmap, must predict the same
buffers to the byte.
"""

from __future__ import annotations

import json

import pytest

from fitter.fit.memory import predict
from fitter.ggml.backends.metal.backend import MetalBackend
from fitter.llama.cparams import Backend, Frontend, RunConfig
from tests.fit.test_rpc import _ggfit, fake_server  # noqa: F401 (the fixture)
from tests.fit.test_rpc_recorded import _model


def _by_device(pred, names: dict[str, str]) -> dict:
    out: dict = {}
    for b in pred.buffers:
        key = (names.get(b.device, b.device), b.kind)
        out[key] = out.get(key, 0) + b.bytes
    return out


@pytest.fixture
def metal_as_rpc(monkeypatch):
    """The local Metal backend with the rules RPC imposes on a remote one: no reorder, a real load's layer pins,
    every op on the device."""
    monkeypatch.setattr(MetalBackend, "reorders_graph", property(lambda self: False))
    monkeypatch.setattr(MetalBackend, "keeps_layer_pins", True)
    monkeypatch.setattr(MetalBackend, "supports_op", lambda self, t: True)


@pytest.mark.parametrize("model", ["gemma3-270m", "qwen3-6l", "qwen3moe-6l", "qwen35-8l"])
@pytest.mark.parametrize("fa,ub,ctk", [("on", 512, "f16"), ("on", 8, "q8_0"), ("on", 64, "q4_0"), ("off", 512, "f16")])
def test_a_remote_mac_allocates_as_a_local_one_where_the_rules_coincide(metal_as_rpc, model: str, fa: str, ub: int,
                                                                        ctk: str) -> None:
    header, spec = _model(model)
    cfg = RunConfig(n_ctx=4096, n_ubatch=ub, flash_attn=fa, type_k=ctk, type_v=ctk if fa == "on" else "f16")
    local = predict(header, spec, cfg.model_copy(update={"no_mmap": True}), Backend.METAL, Frontend.SERVER)
    remote = predict(header, spec, cfg.model_copy(update={"rpc": "mac:50052", "rpc_backends": ("MTL",)}),
                     Backend.RPC, Frontend.SERVER)
    ours = _by_device(remote, {"RPC0": "MTL0", "CPU_Mapped": "CPU"})
    assert ours == _by_device(local, {}) and ("MTL0", "compute") in ours


def test_the_remote_macs_buffer_type_is_metals_not_the_cpus() -> None:
    """The same config with a CPU server: Metal's flash-attention scratch (pad, blk, tmp, f16 K/V) and the MoE
    routing scratch are in the Metal server's compute buffer only; the weights and caches are the same bytes (both
    alignments 32, Metal pads no quantized row)."""
    header, spec = _model("qwen3moe-6l")
    cfg = RunConfig(n_ctx=4096, n_ubatch=512, flash_attn="on", rpc="mac:50052")
    mac = _by_device(predict(header, spec, cfg.model_copy(update={"rpc_backends": ("MTL",)}), Backend.RPC,
                             Frontend.SERVER), {})
    cpu = _by_device(predict(header, spec, cfg, Backend.RPC, Frontend.SERVER), {})
    assert mac[("RPC0", "compute")] > cpu[("RPC0", "compute")]
    assert {k: v for k, v in mac.items() if k[1] != "compute"} == {k: v for k, v in cpu.items() if k[1] != "compute"}


def test_a_metal_server_is_told_by_its_max_size(fake_server) -> None:  # noqa: F811
    """GET_ALIGNMENT is 32 on a Metal server as on a CPU one; GET_MAX_SIZE is the Mac's maxBufferLength (the CPU's
    SIZE_MAX): --budget auto reads the backend so, and the free memory is Metal's working set less what it holds."""
    from cli_rpc import rpc_backends, rpc_budgets
    from fitter.ggml.backends.rpc.protocol import query_devices

    wss = 25559 * 2**20  # a 32 GB Mac's recommendedMaxWorkingSetSize
    mac = fake_server([(wss - 2 * 2**20, wss)], max_size=21 * 2**30)
    cpu = fake_server([(8 * 2**30, 8 * 2**30)])
    cuda = fake_server([(8 * 2**30, 8 * 2**30)], align=128)
    assert [d.backend for d in query_devices([mac, cpu, cuda])] == ["MTL", "CPU", "CUDA"]
    assert rpc_backends(f"{mac},{cpu},{cuda}", "auto", None) == ("MTL", "CPU", "CUDA")
    b = rpc_budgets(f"{mac},{cpu}", "auto")
    assert b[0].bytes == wss - 2 * 2**20 and "recommendedMaxWorkingSetSize" in (b[0].note or "")


def test_rpc_backend_names_the_mac_as_llama_cpp_does() -> None:
    from cli_rpc import rpc_backends

    assert rpc_backends("a:1,b:2", "4GiB", "metal") == ("MTL", "MTL")
    assert rpc_backends("a:1,b:2", "4GiB", "cuda,MTL") == ("CUDA", "MTL")
    r = _ggfit("fit", "gemma3-270m", "--rpc", "a:1", "--rpc-backend", "vulkan", "--budget", "1GiB", "--no-speed")
    assert r.returncode == 2 and "CPU, CUDA or MTL" in r.stderr


def test_run_config_takes_only_the_server_backends_rpc_knows() -> None:
    """RunConfig.rpc_backends holds llama.cpp's registry names that RPC's REMOTE_IDS maps; another is --rpc-backend's
    ConfigError, as a RunConfig built outside the CLI (a study's trial) would be refused."""
    from fitter.ggml.backends.rpc.backend import REMOTE_IDS
    from fitter.llama.flags import ConfigError

    for kind in REMOTE_IDS:
        assert RunConfig(rpc="a:1", rpc_backends=[kind]).rpc_backends == (kind,)
    with pytest.raises(ConfigError, match="--rpc-backend METAL"):
        RunConfig(rpc="a:1", rpc_backends=("METAL",))


def test_a_cuda_box_beside_a_mac() -> None:
    """Mixed backends: a CUDA main host (rpc-cuda) with a Mac's Metal rpc-server: RPC0 (the Mac) then CUDA0, each
    within its own budget; the Mac's device with Metal's buffer type."""
    r = _ggfit("fit", "gemma3-270m", "--rpc", "127.0.0.1:1", "--rpc-backend", "MTL", "--backend", "cuda",
               "--budget", "25559MiB,8GiB", "-c", "8192", "-fa", "on", "--json", "--no-speed")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "rpc-cuda" and list(out["split"]["device_totals"]) == ["RPC0", "CUDA0"]
    assert set(out["hosts"]) == {"127.0.0.1:1", "main"}
