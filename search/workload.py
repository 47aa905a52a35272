"""Probe workloads: real text that ships with every Python, cut into distinct prompts.

Two corpora, both from the running interpreter's own standard library, so a probe needs no data
files and gives the same prompts wherever the same Python runs:

- ``code``: the source of a fixed list of pure-Python standard-library modules (``CODE_MODULES``),
  concatenated in that order (a missing module is skipped);
- ``prose``: English documentation, the values of ``pydoc_data.topics.topics`` in sorted key order.

``Workload.prompts()`` returns one text per run (warm-up first, then the repeats), each starting at a
different line of the corpus so that no two prompts share a prefix (a prompt cache cannot help) and
long enough for ``prompt_tokens`` tokens with any tokenizer (``CHARS_PER_TOKEN`` characters per token,
more than any real vocabulary packs). The exact cut happens where the model's own tokenizer is: the
python runner tokenizes in its child, the server runner through llama-server's ``/tokenize``; the
first ``prompt_tokens`` tokens (BOS included when the model adds one) are the prompt.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from search.errors import ProbeError

CHARS_PER_TOKEN = 8  # text handed over per prompt token; tokenizers average ~3-5 chars per token

# Pure-Python modules present in every CPython 3.9+ (order fixed: the corpus must not depend on a dir listing)
CODE_MODULES = (
    "json/decoder.py", "json/encoder.py", "textwrap.py", "heapq.py", "bisect.py", "functools.py",
    "collections/__init__.py", "argparse.py", "shutil.py", "tempfile.py", "string.py", "fractions.py",
    "statistics.py", "difflib.py", "pprint.py", "dataclasses.py", "enum.py", "typing.py", "inspect.py",
    "subprocess.py", "threading.py", "queue.py", "csv.py", "configparser.py", "logging/__init__.py",
    "http/client.py", "email/message.py", "zipfile.py", "tarfile.py", "pathlib.py", "ast.py", "tokenize.py",
)

Kind = Literal["code", "prose"]


@functools.lru_cache(maxsize=2)
def corpus(kind: Kind) -> str:
    """The whole text of one corpus (hundreds of KiB)."""
    if kind == "prose":
        from pydoc_data.topics import topics  # noqa: PLC0415

        return "\n\n".join(topics[k].strip() for k in sorted(topics))
    if kind == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        parts = []
        for rel in CODE_MODULES:
            p = stdlib / rel
            try:
                parts.append(f"# {rel}\n" + p.read_text(encoding="utf-8"))
            except OSError:
                continue
        if not parts:
            raise RuntimeError(f"no standard-library source found under {stdlib}")
        return "\n\n".join(parts)
    raise ValueError(f"unknown corpus {kind!r} (code or prose)")


class Workload(BaseModel):
    """What a probe asks of llama.cpp: a prompt of ``prompt_tokens`` tokens, then ``gen_tokens`` decoded tokens.

    ``warmup`` runs are done and discarded first (caches, page faults, thread spin-up), then ``repeats``
    measured runs; the result reports their median and spread. Every run gets its own prompt.
    Generation is greedy and ignores end-of-sequence, so exactly ``gen_tokens`` tokens are decoded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind = "prose"
    prompt_tokens: int = Field(128, ge=1, description="prompt length in the model's tokens (BOS included)")
    gen_tokens: int = Field(32, ge=1, description="tokens to decode after the prompt")
    repeats: int = Field(3, ge=1, description="measured runs (median reported)")
    warmup: int = Field(1, ge=0, description="discarded runs before the measured ones")

    @classmethod
    def from_flags(cls, *, prompt_tokens: int, gen_tokens: int, repeats: int, kind: str) -> "Workload":
        """The workload of `ggfit probe --kind --prompt-tokens --gen-tokens --repeats`; a bad value is a one-line
        ProbeError naming the flag and what it accepts (not pydantic's message)."""
        if kind not in ("prose", "code"):
            raise ProbeError(f"--kind {kind}: use prose or code")
        for flag, v in (("--prompt-tokens", prompt_tokens), ("--gen-tokens", gen_tokens), ("--repeats", repeats)):
            if v < 1:
                raise ProbeError(f"{flag} {v}: use 1 or more")
        return cls(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, kind=kind)

    @property
    def runs(self) -> int:
        return self.warmup + self.repeats

    def prompts(self) -> list[str]:
        """One text per run (warm-up runs first), each from a different place in the corpus."""
        text = corpus(self.kind)
        need = self.prompt_tokens * CHARS_PER_TOKEN + 256
        # start offsets: spread over the corpus, snapped to the next line start
        n = self.runs
        out = []
        for i in range(n):
            start = (len(text) * i) // n
            nl = text.find("\n", start)
            start = nl + 1 if 0 <= nl < len(text) - 1 else start
            chunk = text[start:start + need]
            while len(chunk) < need:  # wrap around for very long prompts
                chunk += "\n\n" + text[: need - len(chunk)]
            out.append(chunk)
        return out
