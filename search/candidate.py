"""A proposal of a study's search space: the `RunConfig` to predict and probe, the probe options that are not RunConfig
fields (threads, draft p_min), and the llama-server command it stands for."""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fitter.llama.cparams import RunConfig


class Candidate(BaseModel):
    """One proposal: what to predict and probe."""

    model_config = ConfigDict(frozen=True)

    model_path: str
    config: RunConfig
    threads: int | None = None  # None: run_probe's default
    draft_p_min: float | None = None
    params: dict[str, Any] = Field(default_factory=dict)  # the Optuna parameters it came from

    def flags(self, *, model_label: str | None = None, binary: str = "llama-server") -> list[list[str]]:
        """llama-server's argv as (flag, value) groups, one per line (RunConfig.to_server_args): only flags that
        differ from llama-server's defaults, the probe's threads and draft p_min, ``--repack``/``--no-repack`` (the
        probe's) and ``-fit off`` (what ggfit measured: no automatic fitting)."""
        c = self.config
        extra: list[list[str]] = []
        if self.threads:
            extra += [["-t", str(self.threads)], ["-tb", str(self.threads)]]
        if c.spec_type != "none" and self.draft_p_min is not None:
            extra.append(["--spec-draft-p-min", f"{self.draft_p_min:g}"])
        return [[binary], *c.to_server_args(model_label or self.model_path, extra=extra), ["-fit", "off"]]

    def command(self, **kw) -> str:
        """The llama-server command, one flag a line (shell continuation lines)."""
        lines = [" ".join(_quote(x) for x in g) for g in self.flags(**kw)]
        return " \\\n  ".join(lines)

    def short(self, model_label: str | None = None) -> str:
        """One line: the searched flags only (with ``-m model_label`` first when given)."""
        groups = self.flags(model_label=model_label or "M")[1 if model_label else 2:]
        return " ".join(" ".join(g) for g in groups if g[0] not in _NOT_SEARCHED)

    def key(self) -> str:
        """Identity of the run (two proposals with the same key are the same llama.cpp run)."""
        payload = {"model": self.model_path, "config": self.config.model_dump(mode="json"), "threads": self.threads,
                   "p_min": self.draft_p_min}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


_NOT_SEARCHED = ("--repack", "--no-repack", "-fit")  # what every probe passes (the probe's choices, not the space's)


def _quote(s: str) -> str:
    return shlex.quote(s)
