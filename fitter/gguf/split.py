"""Split models as llama-model-loader reads them: a file whose `split.count` is above 1 is one shard of a model
named `<prefix>-0000i-of-0000N.gguf`; every shard is read, their tensors merged, the metadata the first shard's."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from fitter.errors import GGUFError
from fitter.gguf.constants import GGUFValueType, Keys
from fitter.gguf.header import GGUFHeader, TensorInfo, _show


def _split_key(part: GGUFHeader, key: str, vtype: GGUFValueType, required: bool) -> int | None:
    """A split.* key as llama-model-loader reads it: of exactly this type, required or not."""
    where = part.shards[0].location
    if key not in part.metadata:
        if required:
            raise GGUFError(0, f"split model: missing key {key}", where)
        return None
    at = part.key_offsets.get(key, 0)
    if part.value_types.get(key) != vtype:
        got = part.value_types.get(key)
        raise GGUFError(at, f"key {key} has type {got.name if got else '?'}, llama.cpp expects {vtype.name}", where)
    return part.metadata[key]


def _split_locations(location: str, idx: int, count: int) -> list[str] | None:
    """All shard locations, from one shard's name, as llama_split_prefix/llama_split_path build them."""
    base, query = location, ""
    if location.startswith(("http://", "https://")) and "?" in location:
        base, rest = location.split("?", 1)
        query = "?" + rest
    postfix = f"-{idx + 1:05d}-of-{count:05d}.gguf"
    if len(base) <= len(postfix) or not base.endswith(postfix):
        return None
    prefix = base[: -len(postfix)]
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf{query}" for i in range(1, count + 1)]


def whole_model(given: GGUFHeader, loc: str, read_one: Callable[[str, int], GGUFHeader]) -> GGUFHeader:
    """The model `given` (read from `loc`) is a shard of, its other shards read by `read_one(location, shard)`;
    `given` itself when it is not split."""
    n_split = _split_key(given, Keys.Split.LLM_KV_SPLIT_COUNT, GGUFValueType.UINT16, required=False)
    if not n_split or n_split <= 1:
        return given
    idx = _split_key(given, Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, required=True)
    assert idx is not None  # required: a missing key raises
    if idx >= n_split:
        raise GGUFError(given.key_offsets[Keys.Split.LLM_KV_SPLIT_NO], f"split.no is {idx} but split.count is {n_split}", loc)
    shards = _split_locations(loc, idx, n_split)
    if shards is None:
        raise GGUFError(
            0,
            f"split.count is {n_split} and split.no {idx}, so the file name must end in "
            f"'-{idx + 1:05d}-of-{n_split:05d}.gguf' (llama.cpp finds the other shards by name)",
            loc,
        )
    parts: list[GGUFHeader] = []
    for i, shard_loc in enumerate(shards):
        if i == idx:
            part = given
            if i != 0:
                part.tensors = [replace(t, shard=i) for t in part.tensors]
        else:
            part = read_one(shard_loc, i)
            no = _split_key(part, Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, required=True)
            if no != i:
                raise GGUFError(part.key_offsets[Keys.Split.LLM_KV_SPLIT_NO], f"split.no is {no}, expected {i}", shard_loc)
        parts.append(part)
    first = parts[0]
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for i, part in enumerate(parts):
        for t in part.tensors:
            if t.name in names:
                raise GGUFError(part.shards[0].data_offset, f"tensor '{_show(t.name)}' is in more than one shard", shards[i])
            names.add(t.name)
            tensors.append(t)
    want = _split_key(first, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, GGUFValueType.INT32, required=True)
    if want != len(tensors):
        raise GGUFError(
            first.key_offsets[Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT],
            f"split.tensors.count is {want} but the {n_split} shards hold {len(tensors)} tensors",
            shards[0],
        )
    return GGUFHeader(first.metadata, tensors, [p.shards[0] for p in parts], first.value_types, first.key_offsets)
