"""Errors a user can act on. The CLI prints their message as one line and exits with code 2."""


class GGFitError(Exception):
    """Base of every error that is the input's fault, not ggfit's."""


class SourceError(GGFitError):
    """The model file or URL cannot be read (missing, not a file, HTTP failure, no Range support)."""


class GGUFError(GGFitError):
    """The bytes are not a GGUF header ggfit can trust; the message names the offset and the problem."""

    def __init__(self, offset: int, problem: str, source: str | None = None):
        self.offset = offset
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}invalid GGUF at byte {offset}: {problem}")


class UnsupportedModelError(GGFitError):
    """A valid GGUF whose architecture (or a feature of it) ggfit does not model yet."""
