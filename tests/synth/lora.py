"""Synthetic LoRA adapters for a synthetic base model (`--lora FILE`).

`build_lora(base, targets=("attn_q", "attn_v"), rank=8)` writes (and caches next to the models, under
``${GGFIT_CACHE:-~/.cache/ggfit}/synth/``) an adapter GGUF as convert_lora_to_gguf.py writes one and
src/llama-adapter.cpp reads it: general.type "adapter", adapter.type "lora", adapter.lora.alpha, the base's
general.architecture, and for every base tensor `blk.N.<target>.weight` (or a global such as `output.weight`,
`token_embd.weight`) a pair `<name>.lora_a` [ne0 of the base, rank(, n_expert)] and `<name>.lora_b`
[rank, ne1 of the base(, n_expert)]; token_embd's pair is flipped (lora_a [rank, n_vocab], lora_b
[rank, n_embd]: build_inp_embd reads lora_b untransposed). Not a registered builder: an adapter is no model.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Sequence

from fitter.gguf.reader import read_header
from tests.synth.common import cache_dir, write_gguf


def build_lora(base: str | os.PathLike[str], targets: Sequence[str] = ("attn_q", "attn_v"), *, rank: int = 8,
               ftype: str = "f32", alpha: float = 16.0, layers: Sequence[int] | None = None,
               alora_tokens: Sequence[int] | None = None, general_type: str = "adapter",
               adapter_type: str = "lora", arch: str | None = None, seed: int = 0) -> Path:
    """The cached adapter for `base`; `targets`: tensor suffixes of every layer (`attn_q`, `ffn_up_exps`) or
    global names (`output`, `token_embd`); `layers`: which layers (default all)."""
    base = Path(base)
    opts: dict[str, Any] = dict(targets=list(targets), rank=rank, ftype=ftype, alpha=alpha,
                                layers=None if layers is None else list(layers), alora=alora_tokens and list(alora_tokens),
                                general_type=general_type, adapter_type=adapter_type, arch=arch, seed=seed)
    src = hashlib.sha256(Path(inspect.getsourcefile(build_lora) or __file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([base.name, opts, src], sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"lora-{key}.gguf"
    if path.exists():
        return path
    header = read_header(str(base))
    shapes = {t.name: t.shape for t in header.tensors}
    n_layer = max((int(n.split(".")[1]) for n in shapes if n.startswith("blk.")), default=-1) + 1
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for target in targets:
        names = [f"{target}.weight"] if target in ("output", "token_embd") else [
            f"blk.{il}.{target}.weight" for il in (layers if layers is not None else range(n_layer))]
        for name in names:
            ne = shapes[name]
            if target == "token_embd":
                tensors += [(name + ".lora_a", (rank, ne[1])), (name + ".lora_b", (rank, ne[0]))]
            else:
                tensors += [(name + ".lora_a", (ne[0], rank, *ne[2:])), (name + ".lora_b", (rank, ne[1], *ne[2:]))]
    hp: dict[str, Any] = {"general.type": general_type, "adapter.type": adapter_type, "adapter.lora.alpha": float(alpha)}
    if alora_tokens:
        from gguf import GGUFValueType

        hp["adapter.alora.invocation_tokens"] = (list(alora_tokens), GGUFValueType.UINT32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, arch or header.architecture or "", hp, tensors, ftype=ftype, seed=seed,
                   name="synthetic lora")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
