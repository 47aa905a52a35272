"""fitter.gguf.constants: gguf-py's constants that ggfit reads, run from a selection of gguf-py's own lines.

What is checked: every name equals gguf-py's by value (each enum's members, the block sizes, every key string);
the selection is cached, and read back by the next process; a cache that cannot be written, or a corrupt entry,
still gives the same constants (the whole file, or the entry written again)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import gguf

from fitter.gguf import constants as c

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
import fitter.gguf.constants as c
print(json.dumps({"module": c.GGMLQuantizationType.__module__, "whole": "gguf.constants" in sys.modules,
                  "q4_k": [int(c.GGMLQuantizationType.Q4_K), list(c.GGML_QUANT_SIZES[c.GGMLQuantizationType.Q4_K])],
                  "arch": c.Keys.General.ARCHITECTURE, "gguf_imported": "gguf" in sys.modules}))
"""


def _child(cache: Path) -> dict:
    import json

    env = dict(os.environ, GGFIT_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _keys(cls: type) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, v in vars(cls).items():
        if name.startswith("_"):
            continue
        out[name] = _keys(v) if isinstance(v, type) else v
    return out


def test_equal_to_gguf_by_value() -> None:
    for ours, theirs in ((c.GGMLQuantizationType, gguf.GGMLQuantizationType), (c.LlamaFileType, gguf.LlamaFileType),
                         (c.GGUFValueType, gguf.GGUFValueType)):
        assert [(m.name, int(m)) for m in ours] == [(m.name, int(m)) for m in theirs]
    assert {int(k): v for k, v in c.GGML_QUANT_SIZES.items()} == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    assert c.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K]
    assert _keys(c.Keys) == _keys(gguf.Keys)
    assert (c.GGUF_MAGIC, c.GGUF_DEFAULT_ALIGNMENT, c.GGML_QUANT_VERSION) == (
        gguf.GGUF_MAGIC, gguf.GGUF_DEFAULT_ALIGNMENT, gguf.GGML_QUANT_VERSION)
    assert c.GGUFValueType.get_type("x") == c.GGUFValueType.STRING  # a method of the selected class runs


def test_members_pickle_to_themselves() -> None:
    q = c.GGMLQuantizationType.Q4_K
    assert pickle.loads(pickle.dumps(q)) is q


def test_selection_cached_and_read_back(tmp_path: Path) -> None:
    first = _child(tmp_path)
    assert first["module"] == "fitter.gguf.constants" and not first["whole"] and not first["gguf_imported"]
    entries = list((tmp_path / "gguf-constants").iterdir())
    assert len(entries) == 1
    stamp = entries[0].stat().st_mtime_ns
    second = _child(tmp_path)
    assert second == first
    assert entries[0].stat().st_mtime_ns == stamp  # read, not written again
    assert first["q4_k"] == [12, [256, 144]] and first["arch"] == "general.architecture"


def test_corrupt_entry_written_again(tmp_path: Path) -> None:
    _child(tmp_path)
    (entry,) = (tmp_path / "gguf-constants").iterdir()
    data = entry.read_bytes()
    entry.write_bytes(data[:len(data) // 2])  # a torn write
    assert _child(tmp_path)["module"] == "fitter.gguf.constants"
    assert entry.read_bytes() == data


def test_unwritable_cache_loads_the_whole_file(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the cache's parent is a file: nothing can be stored under it
    got = _child(blocked)
    assert got["whole"] and got["module"] == "gguf.constants" and not got["gguf_imported"]
    assert got["q4_k"] == [12, [256, 144]]
