"""llama-bench's results, read back from what it printed: `-o md` (its default, the markdown table), `-o csv`,
`-o json`, `-o jsonl` and `-o sql`, and ggfit's own `probe --json` results (a prefill and a decode rate each).

Each printer of tools/llama-bench/llama-bench.cpp is mirrored: the field names and types of test::get_fields and
test::get_field_type; markdown_printer's column names (get_field_display_name), its size, params, test and t/s cells
and its `build:` footer; csv_printer's quoted cells; json_printer's and jsonl_printer's objects; sql_printer's
INSERT lines. Text around the output (llama-bench's log on stderr, pasted with it) is skipped."""

from __future__ import annotations

import csv
import json
import re
from typing import Any, Iterable

from fitter.errors import GGFitError
from fitter.record import Record


class BenchFileError(GGFitError):
    """A llama-bench result file ggfit cannot read (missing, empty, not one of llama-bench's formats)."""


class BenchRow(Record):
    """One llama-bench test: its settings and its rate, by llama-bench's field names (test::get_fields); None where
    the format does not say. The markdown table prints a column only where a value differs from llama-bench's
    default: -b, -ub, -ctk, -ctv and --n-cpu-moe left out are their defaults (2048, 512, f16, f16, 0), named in
    extra["assumed"]; the others left out (-fa, -t, -ngl on a CPU backend, ...) are None."""

    test: str  # as markdown_printer prints it: pp512, tg128, pp512+tg128, pp512 @ d4096
    avg_ts: float  # tokens per second: the mean over the repetitions
    stddev_ts: float | None = None
    n_prompt: int | None = None
    n_gen: int | None = None
    n_depth: int | None = None
    model_type: str | None = None  # llama_model_desc: "llama 8B Q4_K - Medium"
    model_size: int | None = None  # bytes (markdown: its GiB/MiB to 2 decimals)
    model_n_params: int | None = None  # (markdown: its B/M to 2 decimals)
    model_filename: str | None = None
    backends: str | None = None  # test::get_backend: "CUDA", "Metal,BLAS", "CPU"
    gpu_info: str | None = None
    cpu_info: str | None = None
    build_commit: str | None = None
    build_number: int | None = None
    n_gpu_layers: int | None = None
    n_cpu_moe: int | None = None
    n_ubatch: int | None = None
    n_batch: int | None = None
    n_threads: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    flash_attn: int | None = None  # -1 auto, 0 off, 1 on (older builds' true/false as 1/0)
    split_mode: str | None = None
    main_gpu: int | None = None
    tensor_split: str | None = None  # "0.00", "3.00/1.00"
    tensor_buft_overrides: str | None = None  # "none", "exps=CPU"
    no_kv_offload: bool | None = None
    no_op_offload: bool | None = None
    format: str = ""  # md, csv, json, jsonl, sql, probe
    extra: dict[str, Any] | None = None  # the row's other keys (llama-bench's others, ggfit's shape/ftype/flags)


# test::get_field_type (llama-bench.cpp): INT, BOOL and FLOAT fields; every other one is a STRING
_INT = frozenset({"build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params",
                  "n_gpu_layers", "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "no_op_offload",
                  "n_cpu_moe", "fit_target", "fit_min_ctx", "flash_attn"})
_BOOL = frozenset({"f16_kv", "no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"})
_FLOAT = frozenset({"avg_ts", "stddev_ts"})
_FIELDS = frozenset(BenchRow._names) - {"test", "format", "extra"}
_STR = frozenset(k for k, a in BenchRow.__annotations__.items() if a == "str | None")
_AS_BOOL = frozenset({"no_kv_offload", "no_op_offload"})  # BenchRow's bools (no_op_offload is an INT upstream)

# markdown_printer::get_field_display_name, reversed; plus names older builds printed
_MD_COLUMNS = {"model": "model_type", "size": "model_size", "params": "model_n_params", "backend": "backends",
               "ngl": "n_gpu_layers", "sm": "split_mode", "threads": "n_threads", "nkvo": "no_kv_offload",
               "fa": "flash_attn", "lm": "load_mode", "embd": "embeddings", "nopo": "no_op_offload", "noh": "no_host",
               "rpk": "repack", "dev": "devices", "ts": "tensor_split", "ot": "tensor_buft_overrides",
               "fitt": "fit_target", "fitc": "fit_min_ctx", "n_gpu_layers": "n_gpu_layers",
               "ub": "n_ubatch", "mmap": "use_mmap", "mmp": "use_mmap"}
# the columns markdown_printer::print_header leaves out where they equal cmd_params_defaults, at defaults that
# every build since n_cpu_moe's has kept (-b 2048, -ub 512, -ctk/-ctv f16, --n-cpu-moe 0): BenchRow.extra["assumed"]
_MD_DEFAULTS: dict[str, Any] = {"n_batch": 2048, "n_ubatch": 512, "type_k": "f16", "type_v": "f16", "n_cpu_moe": 0}

_TEST = re.compile(r"(?:pp\s*(\d+))?\s*\+?\s*(?:tg\s*(\d+))?(?:\s*@\s*d\s*(\d+))?", re.IGNORECASE)
_TS = re.compile(r"([0-9]+(?:\.[0-9]*)?(?:e[+-]?\d+)?)(?:\s*(?:±|Â±|\+/-|\+-)\s*([0-9]+(?:\.[0-9]*)?))?")
_SIZE = re.compile(r"([0-9.]+)\s*(KiB|MiB|GiB|TiB|B)", re.IGNORECASE)
_PARAMS = re.compile(r"([0-9.]+)\s*([KMBT]?)", re.IGNORECASE)
_BUILD = re.compile(r"^build:\s*(\S+)\s*\((\d+)\)")


def bench_label(n_prompt: int, n_gen: int, n_depth: int) -> str:
    """The test as markdown_printer::print_test names it: pp512, tg128, pp512+tg128, with " @ d4096" at a depth."""
    if n_prompt > 0 and n_gen == 0:
        s = f"pp{n_prompt}"
    elif n_gen > 0 and n_prompt == 0:
        s = f"tg{n_gen}"
    else:
        s = f"pp{n_prompt}+tg{n_gen}"
    return s + (f" @ d{n_depth}" if n_depth > 0 else "")


def _typed(field: str, value: Any) -> Any:
    """A value as test::get_field_type says (csv and sql print every value as a string; json its own types)."""
    if value is None or (isinstance(value, str) and field in _INT | _BOOL | _FLOAT and not value.strip()):
        return None
    if field in _BOOL or field in _AS_BOOL:
        if isinstance(value, str):
            return value.strip().lower() not in ("0", "false", "no", "")
        return bool(value)
    if field in _INT:
        if isinstance(value, bool):  # older builds' flash_attn: true / false
            return int(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return int(value.strip().lower() == "true")
        return int(float(value))
    if field in _FLOAT:
        return float(value)
    return value


def row_of(fields: dict[str, Any], fmt: str, where: str) -> BenchRow:
    """A BenchRow from llama-bench's fields by name (json, jsonl, csv, sql: test::get_fields and its values)."""
    try:
        kw = {k: _typed(k, v) for k, v in fields.items() if k in _FIELDS}
        kw.update({k: str(v) for k, v in kw.items() if k in _STR and v is not None and not isinstance(v, str)})
    except (TypeError, ValueError) as e:
        raise BenchFileError(f"{where}: a value llama-bench would not print ({e})") from None
    if kw.get("avg_ts") is None:
        raise BenchFileError(f"{where}: no avg_ts (llama-bench's tokens per second)")
    n_p, n_g, n_d = (kw.get(k) or 0 for k in ("n_prompt", "n_gen", "n_depth"))
    try:
        extra = {k: _typed(k, v) for k, v in fields.items() if k not in _FIELDS and k not in ("samples_ns", "samples_ts")}
    except (TypeError, ValueError) as e:
        raise BenchFileError(f"{where}: a value llama-bench would not print ({e})") from None
    return BenchRow(test=bench_label(n_p, n_g, n_d), format=fmt, extra=extra or None, **kw)


# --- markdown ------------------------------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _md_value(field: str, cell: str, where: str) -> Any:
    if field == "model_size":  # "4.58 GiB", "636.11 MiB"
        m = _SIZE.fullmatch(cell)
        if not m:
            raise BenchFileError(f"{where}: size {cell!r} is not llama-bench's (4.58 GiB)")
        return round(float(m.group(1)) * {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30,
                                          "tib": 2**40}[m.group(2).lower()])
    if field == "model_n_params":  # "8.03 B", "268.10 M"
        m = _PARAMS.fullmatch(cell)
        if not m:
            raise BenchFileError(f"{where}: params {cell!r} is not llama-bench's (8.03 B)")
        return round(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()])
    return _typed(field, cell)


def _md_row(columns: list[str], cells: list[str], where: str) -> BenchRow:
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    test = ts = None
    for name, cell in zip(columns, cells):
        if name == "test":
            test = cell
            continue
        if name == "t/s":
            ts = cell
            continue
        field = _MD_COLUMNS.get(name, name)
        try:
            value = _md_value(field, cell, where)
        except (TypeError, ValueError):
            raise BenchFileError(f"{where}: {name} {cell!r} is not a number") from None
        (kw if field in _FIELDS else extra)[field] = value
    mt = _TEST.fullmatch(test or "")
    if not test or not mt or not (mt.group(1) or mt.group(2)):
        raise BenchFileError(f"{where}: test {test!r} is not llama-bench's (pp512, tg128, pp512 @ d4096)")
    mv = _TS.fullmatch(ts or "")
    if not mv:
        raise BenchFileError(f"{where}: t/s {ts!r} is not llama-bench's (1234.56 ± 12.34)")
    kw["n_prompt"], kw["n_gen"], kw["n_depth"] = (int(g) if g else 0 for g in mt.groups())
    assumed = [k for k in _MD_DEFAULTS if k not in kw]
    for k in assumed:
        kw[k] = _MD_DEFAULTS[k]
    if assumed:
        extra["assumed"] = assumed
    return BenchRow(test=" ".join(test.split()), avg_ts=float(mv.group(1)),
                    stddev_ts=float(mv.group(2)) if mv.group(2) else None, format="md", extra=extra or None, **kw)


def _read_md(lines: list[str], path: str) -> list[BenchRow]:
    """markdown_printer's tables (print_header: the columns, `|---:|` below; print_test: a row; print_footer:
    `build: <commit> (<number>)`, which names the build of the rows above it)."""
    rows: list[BenchRow] = []
    columns: list[str] | None = None
    table_start = 0
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("|"):
            cells = _cells(s)
            if "t/s" in cells and "test" in cells:
                columns, table_start = cells, len(rows)
            elif columns is not None and not all(set(c) <= set("-: ") for c in cells):
                if len(cells) != len(columns):
                    raise BenchFileError(f"{path}:{i + 1}: {len(cells)} cells under {len(columns)} columns")
                rows.append(_md_row(columns, cells, f"{path}:{i + 1}"))
            continue
        m = _BUILD.match(s)
        if m and columns is not None:
            for j in range(table_start, len(rows)):
                if rows[j].build_commit is None:
                    rows[j] = rows[j].model_copy(update={"build_commit": m.group(1),
                                                         "build_number": int(m.group(2))})
    return rows


# --- csv, sql, json, jsonl, probe ----------------------------------------------------------------------------


def _read_csv(lines: list[str], start: int, path: str) -> list[BenchRow]:
    """csv_printer: the header (test::get_fields joined by commas), then each test's values, every one quoted."""
    body = []
    for line in lines[start:]:
        if not line.strip():
            break
        body.append(line)
    table = list(csv.reader(body))
    header = table[0]
    out = []
    for n, values in enumerate(table[1:], start + 2):
        if len(values) != len(header):
            raise BenchFileError(f"{path}:{n}: {len(values)} values under {len(header)} columns")
        out.append(row_of(dict(zip(header, values)), "csv", f"{path}:{n}"))
    return out


_SQL = re.compile(r"INSERT INTO llama_bench \(([^)]*)\) VALUES \((.*)\);\s*$")


def _read_sql(lines: list[str], path: str) -> list[BenchRow]:
    """sql_printer: `INSERT INTO llama_bench (fields) VALUES ('v', ...);`, one per test (values are not escaped)."""
    out = []
    for n, line in enumerate(lines, 1):
        m = _SQL.search(line)
        if m:
            names = [f.strip() for f in m.group(1).split(",")]
            values = re.findall(r"'([^']*)'", m.group(2))
            if len(values) != len(names):
                raise BenchFileError(f"{path}:{n}: {len(values)} values for {len(names)} fields")
            out.append(row_of(dict(zip(names, values)), "sql", f"{path}:{n}"))
    return out


def _probe_rows(d: dict[str, Any], where: str) -> list[BenchRow]:
    """A `ggfit probe --json` result: its prefill as a pp row (depth 0) and its decode as a tg row at the depth of
    the prompt it follows; a probe that did not run gives none."""
    if d.get("status") != "ok":
        return []
    cfg = d.get("config") or {}
    ctx = (d.get("params") or {}).get("context") or {}  # the python runner's: what llama.cpp was given
    fa = ctx.get("flash_attn_type", {"on": 1, "off": 0, "auto": -1}.get(str(cfg.get("flash_attn"))))
    commit = str((d.get("build") or {}).get("ggml_commit") or "").removesuffix("-dirty") or None
    common: dict[str, Any] = dict(
        model_filename=d.get("model_path"), n_gpu_layers=cfg.get("n_gpu_layers"), n_cpu_moe=cfg.get("n_cpu_moe"),
        n_ubatch=ctx.get("n_ubatch", cfg.get("n_ubatch")), n_batch=ctx.get("n_batch", cfg.get("n_batch")),
        n_threads=ctx.get("n_threads"), type_k=cfg.get("type_k"), type_v=cfg.get("type_v"), flash_attn=fa,
        no_kv_offload=cfg.get("no_kv_offload"), no_op_offload=cfg.get("no_op_offload"), build_commit=commit,
        format="probe", extra={"runner": d.get("runner"), "source": where})
    n_p, n_g = int(d.get("prompt_tokens") or 0), int(d.get("generated_tokens") or 0)

    def rate(key: str) -> tuple[float | None, float | None]:
        """The mean and the sample standard deviation of the measured runs' rates, as test::avg_ts and
        test::stdev_ts take them over llama-bench's samples; else the probe's median alone."""
        xs = [float(r[key]) for r in d.get("runs") or () if not r.get("warmup") and r.get(key)]
        if not xs:
            return (float(d[key]) if d.get(key) else None), None
        mean = sum(xs) / len(xs)
        sd = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        return mean, sd

    out = []
    (pp, pp_sd), (tg, tg_sd) = rate("prefill_tps"), rate("decode_tps")
    if pp and n_p:
        out.append(BenchRow(test=bench_label(n_p, 0, 0), avg_ts=pp, stddev_ts=pp_sd, n_prompt=n_p, n_gen=0, n_depth=0,
                            **common))
    if tg and n_g:
        out.append(BenchRow(test=bench_label(0, n_g, n_p), avg_ts=tg, stddev_ts=tg_sd, n_prompt=0, n_gen=n_g,
                            n_depth=n_p, **common))
    return out


def _objects(items: Iterable[Any], fmt: str, path: str) -> list[BenchRow]:
    out: list[BenchRow] = []
    for n, d in enumerate(items, 1):
        if not isinstance(d, dict):
            raise BenchFileError(f"{path}: item {n} is not an object")
        if "status" in d and "runner" in d and "config" in d:
            out += _probe_rows(d, f"{path}: item {n}")
        elif "avg_ts" not in d:
            raise BenchFileError(f"{path}: item {n} is neither a llama-bench result (it has no avg_ts) nor a ggfit "
                                 "probe result")
        else:
            out.append(row_of(d, fmt, f"{path}: {'line' if fmt == 'jsonl' else 'item'} {n}"))
    return out


def _read_json(text: str, path: str) -> list[BenchRow] | None:
    """json_printer's array, a single object, `{"rows": [...]}` (ggfit's benchmarks/results files), or
    jsonl_printer's one object per line; None when the text is no JSON."""
    s = text.strip()
    if not s.startswith(("[", "{")):
        a, b = text.find("\n[\n"), text.rfind("\n]")  # json_printer's `[` and `]` lines after a log
        if a < 0 or b <= a:
            return None
        s = text[a + 1:b + 2]
    try:
        data = json.loads(s)
    except ValueError:
        lines = [ln for ln in s.splitlines() if ln.strip().startswith("{")]
        try:
            return _objects([json.loads(ln) for ln in lines], "jsonl", path) if lines else None
        except ValueError:
            return None
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = data["rows"]
    return _objects(data if isinstance(data, list) else [data], "json", path)


def read_bench(path: str) -> list[BenchRow]:
    """Every test in a llama-bench output file (-o md, csv, json, jsonl, sql) or a ggfit probe result, in order.
    A missing, empty or unrecognised file is a BenchFileError (one line)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(256 * 2**20)
    except FileNotFoundError:
        raise BenchFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BenchFileError(f"{path}: a directory, not a llama-bench result") from None
    except OSError as e:
        raise BenchFileError(f"{path}: cannot read ({e.strerror or e})") from None
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    if not text.strip():
        raise BenchFileError(f"{path}: empty (llama-bench's output: -o md, csv, json or jsonl)")
    rows = _read_json(text, path)
    if rows is None:
        lines = text.splitlines()
        csv_at = next((i for i, ln in enumerate(lines) if ln.startswith("build_commit,")), None)
        if csv_at is not None:
            rows = _read_csv(lines, csv_at, path)
        elif any(ln.startswith("INSERT INTO llama_bench") for ln in lines):
            rows = _read_sql(lines, path)
        else:
            rows = _read_md(lines, path)
    if not rows:
        raise BenchFileError(f"{path}: no llama-bench results in it (llama-bench -o md, csv, json, jsonl or sql, "
                             "or ggfit probe --json)")
    return rows
