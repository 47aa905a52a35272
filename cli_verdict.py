"""`ggfit fit`'s answer after its prediction: the table and its recommendation, the placement, the verdict (one for the
text and the JSON, issue 49), the list of what fits instead, and -b / -ub as llama.cpp runs them. Each function reads
a fitter.fit.plan.Plan."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitter.fit.plan import Plan


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def verdict_line(r: Plan) -> str:
    """The verdict in words: `fit`'s last line, and JSON's verdict.line."""
    from fitter.fit.solver import excess

    over, p, verdict = excess(r.pred, r.avail), r.placement, r.verdict
    if verdict == "fits":
        if r.rec is None:
            return f"fits as given, headroom {_mib(-over)}"
        tp = r.table_placement
        line = f"fits at -c {r.rec.n_ctx}" + (
            f" with ggfit's placement {' '.join(tp.flags)} (with the placement given, no context fits)" if tp else "")
        return line + (f"; with {' '.join(p.flags)}, -c {p.n_ctx} fits too" if p is not None else "")
    if r.rec is None and r.solutions:  # without -c: no context fits
        why = "no context fits, not even -c 256"
    else:
        why = f"over budget by {_mib(over)}" if over > 0 else "over the host budget"
    if verdict == "fits_with_placement":
        assert p is not None
        return f"does NOT fit as given ({why}); fits at -c {p.n_ctx} with ggfit's placement {' '.join(p.flags)}"
    changes = [a.line for a in r.alternatives if a.update is not None]
    return f"does NOT fit ({why})" + (f"; what fits instead: {'; '.join(changes)}" if changes else "")


def batch_notes(r: Plan) -> list[str]:
    """-b and -ub as llama.cpp runs them (llama_context::llama_context: n_batch = min(n_ctx, -b) for a causal model,
    n_ubatch = min(n_batch, -ub)), and a -b that is ggfit's proposal rather than the user's."""
    from fitter.llama.cparams import DEFAULT_N_BATCH

    cp, b, ub = r.pred.context, r.asked.get("-b"), r.asked.get("-ub")
    n_ctx = r.cfg.n_ctx or (r.rec.n_ctx if r.rec else r.spec.n_ctx_train)
    dflt = DEFAULT_N_BATCH
    out = []
    if b is not None and b != cp.n_batch:  # builds before #16148 raise it to GGML_KQ_MASK_PAD
        why = f"caps n_batch at n_ctx, {n_ctx}" if cp.n_batch < b else "raises n_batch to 64 (GGML_KQ_MASK_PAD)"
        out.append(f"-b {b} -> {cp.n_batch} (llama.cpp {why})")
    if ub is not None and ub != cp.n_ubatch:
        src = (f"-b {b}" if b is not None and cp.n_batch == b else
               f"-b {dflt} by default" if b is None and cp.n_batch == dflt else f"itself capped at n_ctx: {cp.n_batch}")
        out.append(f"-ub {ub} -> {cp.n_ubatch} (llama.cpp caps n_ubatch at n_batch, {src})")
    if b is None and cp.n_batch > dflt:
        out.append(f"-b {cp.n_batch} is ggfit's proposal: llama.cpp's default -b {dflt} would cap -ub {cp.n_ubatch} "
                   f"at {dflt}")
    return out


def alternatives_json(r: Plan) -> list[dict[str, Any]]:
    """The what-fits-instead list as `fit` prints it, each with its whole llama-server command."""
    return [{"change": a.flags, "reason": a.reason, "line": a.line, "flags": r.alternative_flags(a)}
            for a in r.alternatives]


def placement_lines(p) -> list[str]:
    """A PlacementChoice in words: its flags, what they move, its device and host bytes, and its lever's table."""
    what = ("MoE experts of the first {v} layers on the CPU (every layer on the GPU)" if p.lever == "n_cpu_moe"
            else "{v} layers on the GPU" + (", every MoE expert on the CPU" if p.n_cpu_moe else "")).format(v=p.value)
    out = [f"{' '.join(p.flags)}: {what}; device {_mib(p.total_device_bytes)} (headroom {_mib(p.headroom_bytes)}), "
           f"host {_mib(p.host_bytes)}"]
    if p.table:
        lever = "--n-cpu-moe" if p.lever == "n_cpu_moe" else "-ngl"
        out.append(f"  largest -c that fits the device, by {lever}: " + ", ".join(f"{v}: {c:,}" for v, c in p.table))
    return out


MMAP_NOTE = ("note: host memory counts the CPU weights' own bytes; with mmap (the default) loading reads the whole "
             "file through the page cache, so the process's peak RSS reaches the file size while it loads")


def print_placement(r: Plan) -> None:
    p = r.placement
    if p is None:
        if r.placement_why and r.table_placement is None and not (r.rec is None and r.solutions):
            print(f"\nplacement: {r.placement_why}")
        return
    first, *rest = placement_lines(p)
    print(f"\nplacement for -c {p.n_ctx}: {first}")
    for line in rest:
        print(line)
    print("llama-server \\\n  " + " \\\n  ".join(r.placement_flags or ()))
    if not r.cfg.no_mmap:
        print(MMAP_NOTE)


def print_recommendation(r: Plan) -> None:
    spec, rec = r.spec, r.rec
    print()
    print_solutions(r.solutions)
    tp = r.table_placement
    if tp is not None:
        first, *rest = placement_lines(tp)
        print(f"with the placement given, no context fits: the table is for ggfit's placement (solved for -c "
              f"{tp.n_ctx}), {first}")
        for line in rest:
            print(line)
        if not r.cfg.no_mmap:
            print(MMAP_NOTE)
    if rec is None:
        from fitter.fit.plan import nothing_fits_line

        print(f"\n{r.alternatives[0].line if r.alternatives else nothing_fits_line(r)}")
        return
    # the resolved context's -ub: llama.cpp caps n_ubatch at n_batch and n_batch at n_ctx, and so do the flags
    print(f"\nrecommended: -c {rec.n_ctx} -ub {r.pred.context.n_ubatch} -ctk {rec.type_k} -ctv {rec.type_v}"
          + (f" {' '.join(tp.flags)}" if tp is not None else "")
          + (" with the draft" if rec.draft else "") + f" (target: the training context {spec.n_ctx_train:,})")
    if r.draft is not None and not rec.draft:
        from fitter.fit.solver import recommend

        keep = recommend([s for s in r.solutions if s.draft], spec.n_ctx_train)
        print("the draft is left out: " + (
            f"with it the largest context is {keep.n_ctx:,}; keep it with -c {keep.n_ctx} -ub {min(keep.n_ubatch, keep.n_batch, keep.n_ctx)} "
            f"-ctk {keep.type_k} -ctv {keep.type_v}" if keep else "with it nothing fits"))


def print_solutions(solutions) -> None:
    """The table; a context below its column's -ub is marked: llama.cpp caps n_batch at n_ctx and n_ubatch at n_batch,
    so it runs that context's -ub (what the recommendation and the flags print)."""
    table: dict[tuple, dict[int, int]] = defaultdict(dict)
    ubs: list[int] = sorted({s.n_ubatch for s in solutions})
    for s in solutions:
        table[(s.type_k, s.type_v, s.draft)][s.n_ubatch] = s.n_ctx
    # the one -ub asked, above every context: it runs -ub = -c throughout, and the column says so
    whole = {u for u in ubs if len(ubs) == 1 and all(row.get(u, 0) < u for row in table.values())}
    print("largest -c that fits (0 = none), by K/V type and -ub:")
    print(f"  {'-ctk/-ctv':<16}" + "".join(f"{'-ub = -c' if u in whole else '-ub ' + str(u):>12} " for u in ubs))
    below = False
    for (tk, tv, d), row in table.items():
        label = f"{tk}/{tv}" + (" +draft" if d else "")
        cells = []
        for u in ubs:
            n = row.get(u, 0)
            mark = 0 < n < u and u not in whole
            below = below or mark
            cells.append(f"{n:>12,}" + ("*" if mark else " "))
        print(f"  {label:<16}" + "".join(cells))
    if whole or below:
        print(f"  {'*' if below else '-ub = -c'}: llama.cpp caps n_batch at n_ctx and n_ubatch at n_batch: at a context "
              "below the column's -ub it runs -ub = -c")


def print_what_to_change(r: Plan) -> None:
    from fitter.fit.solver import excess

    over = excess(r.pred, r.avail)
    if over <= 0:
        print("over the host budget. What fits instead: a placement with less on the CPU, or a larger --host-budget")
        return
    print(f"over budget by {over / 2**20:,.2f} MiB. What fits instead (one change at a time):")
    for alt in r.alternatives:
        print(f"  {alt.line}")
