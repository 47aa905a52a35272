"""optimise --rpc: each device against its own budget (Predictor.per_device) and each trial with the -ts ggfit
proposes at its own context (Predictor.placed, fitter.fit.split.split_at), not a fixed 1,1,..."""

from __future__ import annotations

from fitter.bundled import resolve_model
from fitter.fit.split import _proportional, split_at
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from search.candidate import Candidate
from search.study.objective import Predictor
from tests.fit.test_rpc import fake_server  # noqa: F401 (the fixture)

MiB = 2**20


def _cand(n_ctx: int, trial: bool = True) -> Candidate:
    """A candidate the space proposed (params given), or llama.cpp's defaults (trial=False)."""
    return Candidate(model_path=resolve_model("gemma3-270m"), params={"n_ctx": n_ctx} if trial else {},
                     config=RunConfig(n_ctx=n_ctx, n_ubatch=512, rpc="a:1,b:2,c:3"))


def test_a_trial_takes_the_split_ggfit_proposes_at_its_context() -> None:
    avail = {"RPC0": 1000 * MiB, "RPC1": 300 * MiB, "RPC2": 300 * MiB}
    p = Predictor(Backend.RPC, Frontend.SERVER, per_device=avail, avail=avail["RPC0"])
    header, spec = load_model_spec(resolve_model("gemma3-270m"))
    cand = p.placed(_cand(32768))
    ts = cand.config.tensor_split
    assert ts == split_at(header, spec, _cand(32768).config, Backend.RPC, Frontend.SERVER, avail) == (14.0, 4.0, 1.0)
    assert p.device_bytes(p.predict(_cand(32768))) <= p.avail  # every device within its own budget
    small = p.placed(_cand(4096)).config.tensor_split  # room everywhere: llama.cpp's split by the budgets
    assert small == tuple(float(c) for c in _proportional(19, list(avail.values())))


def test_a_given_ts_is_kept_and_a_split_that_fits_nowhere_is_over() -> None:
    avail = {"RPC0": 200 * MiB, "RPC1": 200 * MiB, "RPC2": 100 * MiB}
    p = Predictor(Backend.RPC, Frontend.SERVER, per_device=avail, avail=avail["RPC0"])
    given = _cand(4096).model_copy(update={"config": _cand(4096).config.model_copy(update={"tensor_split": (1.0,) * 3})})
    assert p.placed(given).config.tensor_split == (1.0, 1.0, 1.0)
    assert p.device_bytes(p.predict(_cand(32768))) > p.avail  # the 170 MiB output layer fits no split here


def test_llama_cpps_defaults_split_by_the_budgets() -> None:
    """The compare's baseline (no params: not proposed by the space) is predicted with llama.cpp's split by free
    memory, the budgets here; a trial of the same config keeps ggfit's split."""
    avail = {"RPC0": 1000 * MiB, "RPC1": 300 * MiB, "RPC2": 300 * MiB}
    p = Predictor(Backend.RPC, Frontend.SERVER, per_device=avail, avail=avail["RPC0"])
    assert p.placed(_cand(32768)).config.tensor_split == (14.0, 4.0, 1.0)
    assert p.placed(_cand(32768, trial=False)).config.tensor_split == tuple(float(a) for a in avail.values())
    assert p.placed(_cand(32768)).config.tensor_split == (14.0, 4.0, 1.0)


def test_optimise_takes_the_budgets_as_fit_does(fake_server) -> None:  # noqa: F811
    """optimise --rpc's budgets: one per device or auto (each server's answer), each less its own margin; only --rpc
    and the servers' backends are fixed (no -ts)."""
    from cli_options import BudgetOptions, RunnerName
    from cli_search import _rpc_study
    from fitter.fit.margin import default_margin

    mac = fake_server([(20 * 2**30, 25559 * MiB)], max_size=21 * 2**30)
    cpu = fake_server([(8 * 2**30, 8 * 2**30)])
    be, fixed, b = _rpc_study(f"{mac},{cpu}", RunnerName.server, BudgetOptions(budget="auto"))
    assert be == Backend.RPC and fixed == {"rpc": f"{mac},{cpu}", "rpc_backends": ("MTL", "CPU")}
    assert b.avail == {"RPC0": 20 * 2**30 - default_margin("metal"), "RPC1": 8 * 2**30 - default_margin("rpc")}
    _, fixed, b = _rpc_study("a:1,b:2", RunnerName.server, BudgetOptions(budget="3GiB,1GiB"))
    assert fixed == {"rpc": "a:1,b:2"} and b.avail == {"RPC0": 3 * 2**30 - 301 * MiB, "RPC1": 2**30 - 301 * MiB}
