"""search's errors: user errors (one line, exit 2, as fitter's GGFitError)."""

from fitter.errors import GGFitError


class ProbeError(GGFitError):
    """The probe could not be attempted (bad arguments, no llama-server); llama.cpp's own failures are statuses."""
