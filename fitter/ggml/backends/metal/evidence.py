"""The evidence Metal's default --margin rests on: configs that ran and configs that ran out of memory on a Mac, with
ggfit's total against the budget for each (the Metal buffers: MTL0, MTL0_Mapped; not CPU_Mapped or CPU).

A config that ran says the memory outside the buffers was at most `budget - total`: an upper bound. One that ran out
of memory says it was more than `budget - total`: a lower bound. The default margin must lie in (largest lower
bound, smallest upper bound], so that with it every config that ran fits and every one that did not, does not
(metal_bounds below; fitter.fit.margin turns it into the default). `total_bytes` is ggfit's prediction for the case with the model of the day;
tests/fit/test_metal_margin.py recomputes every one from the case's synthetic twin and the flags, with the case's
--llama-build, and fails when they drift apart (then the figure here, and the bound, must be updated).

The twins (tests/fit/test_metal_margin.py builds them) are full-size sparse headers of the published shapes, with the
tensor types llama-quantize gives the quant and its file layout (llama_model_loader::weight_name_comparer order:
output.weight, output_norm.weight, token_embd.weight, then blk.0 ...), so that the token embedding lies inside the
Metal mapped range, as in the public b8999 log (MTL0_Mapped 5,133.75 MiB = the 4,588 MiB of Metal tensors its
breakdown prints + the 545.62 MiB CPU_Mapped token embedding).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from fitter.ggml.backends.base import Overhead

MiB = 1024**2


class Case(NamedTuple):
    name: str  # how the output names it
    model: str  # the model as run
    twin: str  # the synthetic header that stands for it (a key of tests/fit/test_metal_margin.py's TWINS)
    draft_twin: str | None  # -md, likewise
    build: str  # --llama-build
    flags: tuple[str, ...]  # llama-server flags, as given
    budget_bytes: int  # the Metal working set (recommendedMaxWorkingSetSize)
    outcome: Literal["ran", "oom"]
    total_bytes: int  # ggfit's total against the budget for it (the Metal buffers)
    source: str

    @property
    def overhead_bound(self) -> int:
        """What the memory outside the buffers was at most (ran) or more than (oom)."""
        return self.budget_bytes - self.total_bytes


_SEED = ("issue 13's seed: a 32 GB M4 Mac mini (Metal working set 25,559 MiB), llama-server, months of use; "
         "Qwen3.6-35B-A3B Q4_K_M, a 20,182 MiB file")
_AUGUST = ("issue 13's August seed, the same Mac: with the Qwen3.5-0.8B Q4_K_S draft, a build between b9430 and b10502 "
           "whose draft figures (+1,170 MiB from -ub 1024 to 2048) place it before #23861 (b9440 stands for it)")
_SERVER = ("-b", "2048", "-fa", "on", "-np", "1", "--kv-unified")
_DRAFT_KV = ("-ctk", "q8_0", "-ctv", "q8_0", "--spec-draft-type-k", "q8_0", "--spec-draft-type-v", "q8_0")
_SEED_BUDGET = 25559 * MiB

EVIDENCE: tuple[Case, ...] = (
    Case("b9430 seed, -c 262144 -ub 2048 q8_0", "Qwen3.6-35B-A3B Q4_K_M", "qwen36-35b-a3b-q4_k_m", None, "b9430",
         ("-c", "262144", "-ub", "2048", "-ctk", "q8_0", "-ctv", "q8_0", *_SERVER), _SEED_BUDGET, "ran",
         26141551104, _SEED),
    Case("b9430 seed, -c 262144 -ub 4096 q8_0", "Qwen3.6-35B-A3B Q4_K_M", "qwen36-35b-a3b-q4_k_m", None, "b9430",
         ("-c", "262144", "-ub", "4096", "-ctk", "q8_0", "-ctv", "q8_0", *_SERVER[2:], "-b", "4096"), _SEED_BUDGET,
         "oom", 28209342976, _SEED),
    Case("b9430 seed, -c 262144 -ub 2048 f16", "Qwen3.6-35B-A3B Q4_K_M", "qwen36-35b-a3b-q4_k_m", None, "b9430",
         ("-c", "262144", "-ub", "2048", *_SERVER), _SEED_BUDGET, "oom", 28658133504, _SEED),
    Case("August draft, -c 131072 -ub 2048", "Qwen3.6-35B-A3B Q4_K_M + Qwen3.5-0.8B Q4_K_S draft",
         "qwen36-35b-a3b-q4_k_m", "qwen35-0.8b-q4_k_s", "b9440", ("-c", "131072", "-ub", "2048", *_DRAFT_KV, *_SERVER),
         _SEED_BUDGET, "oom", 28673857312, _AUGUST),
    Case("August draft, -c 98304 -ub 2048", "Qwen3.6-35B-A3B Q4_K_M + Qwen3.5-0.8B Q4_K_S draft",
         "qwen36-35b-a3b-q4_k_m", "qwen35-0.8b-q4_k_s", "b9440", ("-c", "98304", "-ub", "2048", *_DRAFT_KV, *_SERVER),
         _SEED_BUDGET, "oom", 27969214240, _AUGUST),
    Case("August draft, -c 98304 -ub 1024", "Qwen3.6-35B-A3B Q4_K_M + Qwen3.5-0.8B Q4_K_S draft",
         "qwen36-35b-a3b-q4_k_m", "qwen35-0.8b-q4_k_s", "b9440", ("-c", "98304", "-ub", "1024", *_DRAFT_KV, *_SERVER),
         _SEED_BUDGET, "ran", 25708447520, _AUGUST),
    Case("b8999 log, Qwen3.5-9B -c 262144", "Qwen3.5-9B-Q4_K_S (unsloth)", "qwen35-9b-q4_k_s", None, "b8999",
         ("-c", "262144", "-b", "512", "-ngl", "999", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-np", "1"),
         16384 * MiB, "ran", 10829795360,
         "public llama-server log on an M4 Pro (tests/data/llama_logs/03-metal-b8999.log): loaded, its breakdown's "
         "total is the 16,384 MiB working set; the twin's weights are 40.50 MiB under unsloth's mix"),
)


class Bounds(NamedTuple):
    """What the evidence says of the memory outside the buffers: more than `lower` (by `lower_case`, out of memory)
    and at most `upper` (by `upper_case`, ran)."""
    lower: int
    lower_case: Case | None
    upper: int
    upper_case: Case


def metal_bounds(cases: tuple[Case, ...] = EVIDENCE) -> Bounds:
    """(largest lower bound, smallest upper bound) over the cases (EVIDENCE above); refuses evidence that
    contradicts itself (a config that ran out of memory needing more than one that ran allows)."""
    ran = [c for c in cases if c.outcome == "ran"]
    oom = [c for c in cases if c.outcome == "oom"]
    hi = min(ran, key=lambda c: c.overhead_bound)
    lo = max(oom, key=lambda c: c.overhead_bound) if oom else None
    b = Bounds(lo.overhead_bound if lo else -(1 << 62), lo, hi.overhead_bound, hi)
    if b.lower >= b.upper // MiB * MiB:
        raise ValueError(f"the Metal evidence contradicts itself: {lo and lo.name} needs more than {hi.name} allows")
    return b


def metal_margin() -> Overhead:
    """Metal's whole default margin: the smallest upper bound, in whole MiB."""
    b = metal_bounds()
    low = (f"; those that ran out of memory only say more than {b.lower / MiB:,.2f} MiB ({b.lower_case.name})"
           if b.lower_case else "")
    return Overhead(b.upper // MiB * MiB,
                    f"from {len(EVIDENCE)} Metal configs that ran or ran out of memory (fitter/ggml/backends/metal/evidence.py): "
                    f"at most {b.upper / MiB:,.2f} MiB outside the buffers, by {b.upper_case.name} "
                    f"({b.upper_case.budget_bytes / MiB:,.0f} MiB working set, ran){low}")
