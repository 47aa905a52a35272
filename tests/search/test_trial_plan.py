"""A study's trial goes through the plan pipeline (issue 45): FitRequest.trial -> fitter.fit.plan.predict_plan ->
Plan.pred, the same bytes as `fit -c` predicts for the same flags, held to the study's budgets (Budgets.held)."""

from __future__ import annotations

from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.fit.plan import plan, predict_plan
from fitter.fit.request import Budgets, FitRequest
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import PINNED
from search.candidate import Candidate
from search.study.objective import Predictor

MiB = 2**20


def test_a_trials_plan_is_fits_prediction_of_its_flags() -> None:
    path = resolve_model("gemma3-270m")
    cfg = RunConfig(n_ctx=8192, n_ubatch=256, type_k="q8_0", type_v="q8_0", flash_attn="on")
    p = Predictor(Backend.CPU, Frontend.SERVER, avail=300 * MiB).plan(Candidate(model_path=path, params={}, config=cfg))
    header, spec = load_model_spec(path)
    direct = predict(header, spec, cfg, Backend.CPU, Frontend.SERVER)
    assert p.pred.buffers == direct.buffers and p.pred.total_device_bytes == direct.total_device_bytes
    assert p.avail == 300 * MiB and p.fits == (direct.total_device_bytes <= 300 * MiB)
    # fit -c's plan starts with the same step: the same buffers, to the byte
    budgets = Budgets.parse("300MiB", "0", Backend.CPU)
    fit = plan(FitRequest(model="gemma3-270m", config=cfg, backend=Backend.CPU, frontend=Frontend.SERVER, build=PINNED,
                          budgets=budgets))
    assert fit.pred.buffers == p.pred.buffers


def test_a_trial_with_a_draft_reads_it_from_its_config() -> None:
    path = resolve_model("gemma3-270m")
    cfg = RunConfig(n_ctx=4096, spec_type="draft-simple", draft_model=path)
    req = FitRequest.trial(path, cfg, Backend.CPU, Frontend.SERVER, PINNED, Budgets.held(1000 * MiB))
    assert req.model_draft == path
    with_draft = predict_plan(req)
    alone = predict_plan(FitRequest.trial(path, cfg.model_copy(update={"spec_type": "none", "draft_model": None}),
                                          Backend.CPU, Frontend.SERVER, PINNED, Budgets.held(1000 * MiB)))
    assert with_draft.draft is not None and with_draft.pred.total_device_bytes > alone.pred.total_device_bytes


def test_held_budgets_are_the_studys_per_device() -> None:
    b = Budgets.held(500 * MiB, {"RPC0": 500 * MiB, "RPC1": 200 * MiB})
    assert b.avail == {"RPC0": 500 * MiB, "RPC1": 200 * MiB} and len(b.devices) == 2 and b.margin_bytes == 0
    assert Budgets.held(500 * MiB).avail == 500 * MiB
