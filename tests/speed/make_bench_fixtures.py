"""Writes tests/data/llama-bench/h200.{md,csv,jsonl,sql}: the 44 real llama-bench rows of
benchmarks/results/speed-h200.json (llama-bench -o json on an H200) printed again as llama-bench's other printers
print them (tools/llama-bench/llama-bench.cpp of the pinned build: markdown_printer, csv_printer, jsonl_printer,
sql_printer), one llama-bench invocation (a `flags` group) per markdown table.

    PYTHONPATH=. python3 tests/speed/make_bench_fixtures.py
"""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "llama-bench"
FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
          "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
          "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn",
          "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings",
          "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth",
          "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts")  # test::get_fields
STRING = {"build_commit", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "cpu_mask", "type_k",
          "type_v", "split_mode", "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode",
          "test_time"}


def value(field: str, v: object) -> str:
    """test::get_values' string: std::to_string of ints, bools as 0/1, doubles as %f."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:f}"
    return str(v)


def csv_text(rows: list[dict]) -> str:  # csv_printer
    out = [",".join(FIELDS)]
    for r in rows:
        out.append(",".join('"' + value(f, r[f]).replace('"', '""') + '"' for f in FIELDS))
    return "\n".join(out) + "\n"


def json_value(f: str, v: object) -> str:  # format_json_value
    if f in STRING:
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return value(f, v)


def jsonl_text(rows: list[dict]) -> str:  # jsonl_printer
    out = []
    for r in rows:
        s = "{" + "".join(f'"{f}": {json_value(f, r[f])}, ' for f in FIELDS)
        s += f'"samples_ns": [ {", ".join(str(x) for x in r["samples_ns"])} ],'
        s += f'"samples_ts": [ {", ".join(f"{x:g}" for x in r["samples_ts"])} ]' + "}"
        out.append(s)
    return "\n".join(out) + "\n"


def sql_text(rows: list[dict]) -> str:  # sql_printer (print_header's CREATE TABLE, then one INSERT per test)
    types = {f: "TEXT" if f in STRING else "REAL" if f in ("avg_ts", "stddev_ts") else "INTEGER" for f in FIELDS}
    out = ["CREATE TABLE IF NOT EXISTS llama_bench ("]
    out += [f"  {f} {types[f]}{',' if i < len(FIELDS) - 1 else ''}" for i, f in enumerate(FIELDS)]
    out += [");", ""]
    for r in rows:
        out.append(f"INSERT INTO llama_bench ({', '.join(FIELDS)}) VALUES ("
                   + ", ".join(f"'{value(f, r[f])}'" for f in FIELDS) + ");")
    return "\n".join(out) + "\n"


WIDTH = {"model": -30, "t/s": 20, "size": 10, "params": 10, "n_gpu_layers": 3, "n_ubatch": 8, "flash_attn": 3,
         "test": 15, "repack": 3, "backend": -10, "n_cpu_moe": 10}  # markdown_printer::get_field_width
NAME = {"n_gpu_layers": "ngl", "flash_attn": "fa", "repack": "rpk"}  # get_field_display_name


def cell(text: str, width: int) -> str:
    """printf's " %*s |": padded to |width| bytes (the UTF-8 ± is 2 bytes: print_test widens t/s by 1)."""
    pad = abs(width) - len(text.encode())
    return " " + (text + " " * pad if width < 0 else " " * pad + text) + " |" if pad > 0 else f" {text} |"


def md_cell(f: str, r: dict) -> str:
    if f == "model":
        return r["model_type"]
    if f == "size":
        s = r["model_size"]
        return f"{s / 2**20:.2f} MiB" if s < 2**30 else f"{s / 2**30:.2f} GiB"
    if f == "params":
        n = r["model_n_params"]
        return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"
    if f == "backend":
        return r["backends"]
    if f == "test":
        p, g, d = r["n_prompt"], r["n_gen"], r["n_depth"]
        t = f"pp{p}" if p and not g else f"tg{g}" if g and not p else f"pp{p}+tg{g}"
        return t + (f" @ d{d}" if d else "")
    if f == "t/s":
        return f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
    return value(f, r[f])


def md_text(rows: list[dict], common: list[str]) -> str:  # markdown_printer, one run of llama-bench per flags group
    out = []
    for _, group in groupby(rows, key=lambda r: r["flags"]):
        g = list(group)
        flags = g[0]["flags"] + common
        fields = ["model", "size", "params", "backend", "n_gpu_layers"]  # a GPU backend: ngl
        if "-ncmoe" in flags:
            fields.append("n_cpu_moe")
        if "," in flags[flags.index("-ub") + 1]:
            fields.append("n_ubatch")
        fields += ["flash_attn", "repack", "test", "t/s"]  # -fa 1 and --repack 0 differ from the defaults
        out.append("|" + "".join(cell(NAME.get(f, f), WIDTH[f]) for f in fields))
        out.append("|" + "".join(" " + "-" * (abs(WIDTH[f]) - 1) + (":" if WIDTH[f] > 0 else "-") + " |"
                                 for f in fields))
        for r in g:
            out.append("|" + "".join(cell(md_cell(f, r), WIDTH[f] + (f == "t/s")) for f in fields))
        out.append("")
        out.append(f"build: {g[0]['build_commit']} ({g[0]['build_number']})")
    return "\n".join(out) + "\n"


def main() -> None:
    data = json.loads((ROOT / "benchmarks" / "results" / "speed-h200.json").read_text())
    rows = data["rows"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "h200.md").write_text(md_text(rows, data["common"]))
    (OUT / "h200.csv").write_text(csv_text(rows))
    (OUT / "h200.jsonl").write_text(jsonl_text(rows))
    (OUT / "h200.sql").write_text(sql_text(rows[-4:]))


if __name__ == "__main__":
    main()
