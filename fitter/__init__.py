"""ggfit's fitter: GGUF header reader, model description, memory model, budget and solver.

Never imports `search` (search depends on fitter, not the reverse). Callers import each name from the module that
defines it (`from fitter.fit.memory import predict`, `from fitter.llama.cparams import RunConfig`), inside the
function that needs it where the module is heavy, so that `python -m fitter...` children and `ggfit --help` do not
pay for pydantic and the whole model. The package itself loads only its errors.
"""

from fitter.errors import GGFitError

__all__ = ["GGFitError"]
