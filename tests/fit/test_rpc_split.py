"""fitter.fit.split: the -ts ggfit proposes over several devices starts from llama.cpp's own split by the budgets
(llama_model::load_tensors' upper_bound over the cumulative shares) and moves layers only where a device is over its
budget; not front to back (which left the first device most of the layers: -ts 17,1,1)."""

from __future__ import annotations

import pytest

from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.fit.split import _proportional, propose_split
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec

MiB = 2**20


@pytest.fixture(scope="module")
def gemma():
    return load_model_spec(resolve_model("gemma3-270m"))


@pytest.mark.parametrize("shares", [[1, 1, 1], [4000, 2000, 2000], [3, 1], [1, 5, 2, 2]])
def test_the_start_is_llama_cpps_own_split_by_the_shares(gemma, shares: list[int]) -> None:
    """_proportional(n, shares) as -ts: the same placement as -ts shares itself (fitter.llama.weights mirrors
    load_tensors)."""
    header, spec = gemma
    counts = _proportional(len(spec.layers) + 1, shares)
    eps = ",".join(f"h{i}:1" for i in range(len(shares)))
    base = RunConfig(n_ctx=4096, n_ubatch=512, rpc=eps)
    by_shares = predict(header, spec, base.model_copy(update={"tensor_split": tuple(map(float, shares))}),
                        Backend.RPC, Frontend.SERVER)
    by_counts = predict(header, spec, base.model_copy(update={"tensor_split": tuple(map(float, counts))}),
                        Backend.RPC, Frontend.SERVER)
    assert by_counts.device_totals() == by_shares.device_totals() and sum(counts) == len(spec.layers) + 1


def test_room_everywhere_keeps_the_budgets_split(gemma) -> None:
    """Budgets that hold the training context any way: the proposal is llama.cpp's split by the budgets (7,6,6 for
    three equal ones; 2:1:1 budgets give 10,5,4), not the front-to-back fill's 17,1,1."""
    header, spec = gemma
    base = RunConfig(n_ubatch=512, rpc="a:1,b:2,c:3")
    for avail, ts in (([2000, 2000, 2000], (7.0, 6.0, 6.0)), ([4000, 2000, 2000], (10.0, 5.0, 4.0))):
        sp = propose_split(header, spec, base, Backend.RPC, Frontend.SERVER,
                           {f"RPC{i}": a * MiB for i, a in enumerate(avail)})
        assert sp.tensor_split == ts and sp.n_ctx == spec.n_ctx_train


def test_a_device_over_its_budget_gives_layers_to_the_roomiest(gemma) -> None:
    """A small last device (the output layer's 170 MiB on it): layers move off it, onto the device with most room,
    and every device fits."""
    header, spec = gemma
    avail = {"RPC0": 1000 * MiB, "RPC1": 300 * MiB, "RPC2": 300 * MiB}
    sp = propose_split(header, spec, RunConfig(n_ubatch=512, rpc="a:1,b:2,c:3"), Backend.RPC, Frontend.SERVER, avail)
    assert sp.tensor_split == (14.0, 4.0, 1.0) and sp.n_ctx == spec.n_ctx_train
    assert sp.pred is not None and all(sp.pred.device_totals()[d] <= a for d, a in avail.items())
