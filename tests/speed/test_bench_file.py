"""fitter.speed.bench_file: llama-bench's output read back in every format it prints.

The truth is benchmarks/results/speed-h200.json: 44 rows llama-bench -o json printed on an H200 (pinned build).
tests/data/llama-bench/h200.{md,csv,jsonl,sql} are those rows as llama-bench's markdown_printer, csv_printer,
jsonl_printer and sql_printer print them (tests/speed/make_bench_fixtures.py); each must read back as the JSON does,
to the precision the format prints. probe-gemma3-270m-cpu.json is a real `ggfit probe --json` run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.errors import GGFitError
from fitter.speed.bench_file import BenchFileError, BenchRow, bench_label, read_bench

ROOT = Path(__file__).resolve().parents[2]
TRUTH = ROOT / "benchmarks" / "results" / "speed-h200.json"
DATA = ROOT / "tests" / "data" / "llama-bench"
EXACT = ("test", "n_prompt", "n_gen", "n_depth", "model_type", "backends", "build_commit", "build_number",
         "n_gpu_layers", "n_cpu_moe", "n_ubatch", "n_batch", "type_k", "type_v", "flash_attn")


@pytest.fixture(scope="module")
def truth() -> list[dict]:
    return json.loads(TRUTH.read_text())["rows"][:44]  # the first run's rows (dense, moe), which the fixtures reprint


def test_json_rows_are_llama_bench_fields(truth):
    every = read_bench(str(TRUTH))
    assert len(every) == len(json.loads(TRUTH.read_text())["rows"])
    rows = every[:44]
    assert len(rows) == len(truth) == 44
    for r, t in zip(rows, truth):
        assert r.format == "json"
        for f in BenchRow._names:
            if f in t:
                assert getattr(r, f) == t[f], f
        assert r.test == bench_label(t["n_prompt"], t["n_gen"], t["n_depth"])
        assert r.extra and r.extra["shape"] == t["shape"] and r.extra["flags"] == t["flags"]  # ggfit's keys kept
    assert [r.test for r in rows[:4]] == ["pp512", "tg128", "pp512 @ d4096", "tg128 @ d4096"]
    moe = rows[-2]  # gpt-oss-20b, 12 layers' experts on the CPU
    assert (moe.n_cpu_moe, moe.test, moe.avg_ts, moe.gpu_info) == (12, "pp512 @ d4096", 681.35192, "NVIDIA H200")


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_csv_and_jsonl_read_as_the_json(truth, fmt):
    want = read_bench(str(TRUTH))
    got = read_bench(str(DATA / f"h200.{fmt}"))
    assert len(got) == 44
    for g, w in zip(got, want):
        assert g.format == fmt
        assert g.model_copy(update={"format": "json", "extra": None}) == w.model_copy(update={"extra": None})


def test_sql_reads_as_the_json(truth):
    want = read_bench(str(TRUTH))[40:44]
    got = read_bench(str(DATA / "h200.sql"))
    assert [g.model_copy(update={"format": "json", "extra": None}) for g in got] == \
        [w.model_copy(update={"extra": None}) for w in want]


def test_markdown_reads_as_the_json_to_its_printed_precision(truth):
    rows = read_bench(str(DATA / "h200.md"))
    assert len(rows) == 44
    for r, t in zip(rows, truth):
        assert r.format == "md"
        for f in EXACT:
            assert getattr(r, f) == (t[f] if f != "test" else bench_label(t["n_prompt"], t["n_gen"], t["n_depth"])), f
        assert r.avg_ts == round(t["avg_ts"], 2) and r.stddev_ts == round(t["stddev_ts"], 2)
        assert abs(r.model_size - t["model_size"]) <= 0.005 * 2**30  # "4.58 GiB"
        assert abs(r.model_n_params - t["model_n_params"]) <= 0.005e9  # "8.03 B"
        assert r.gpu_info is None and r.n_threads is None  # not printed in the table
    # -ub 512 alone and no -ncmoe: the table leaves the column out, at llama-bench's default
    dense = rows[8]
    assert dense.n_gpu_layers == 16 and dense.extra and "n_ubatch" in dense.extra["assumed"]
    assert rows[0].extra and "n_ubatch" not in rows[0].extra["assumed"]


OLD_MD = """\
ggml_metal_init: found device: Apple M2 Ultra
| model                          |       size |     params | backend    | ngl | test       |              t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | ---------- | ---------------: |
| llama 7B mostly Q4_0           |   3.56 GiB |     6.74 B | Metal,BLAS |  99 | pp 512     |  1238.48 ± 1.62 |
| llama 7B mostly Q4_0           |   3.56 GiB |     6.74 B | Metal,BLAS |  99 | tg 128     |     94.27 ± 0.10 |
| gemma3 270M Q4_K - Medium      | 241.04 MiB |   268.10 M | CPU        |   0 | pp512+tg32 |       412.3 |

build: 8e672efe (3543)
"""


def test_markdown_of_older_builds_and_a_log_around_it(tmp_path):
    """Older llama-bench printed `pp 512` and a left-aligned test column; a pasted log before the table is skipped."""
    f = tmp_path / "old.md"
    f.write_text(OLD_MD)
    a, b, c = read_bench(str(f))
    assert (a.test, a.n_prompt, a.n_gen, a.n_depth, a.avg_ts, a.stddev_ts) == ("pp 512", 512, 0, 0, 1238.48, 1.62)
    assert (b.n_gen, b.avg_ts, b.backends, b.n_gpu_layers) == (128, 94.27, "Metal,BLAS", 99)
    assert a.model_size == round(3.56 * 2**30) and a.model_n_params == 6_740_000_000
    assert (c.n_prompt, c.n_gen, c.stddev_ts, c.model_size, c.model_n_params) == (512, 32, None, round(241.04 * 2**20),
                                                                                 268_100_000)
    assert all((r.build_commit, r.build_number) == ("8e672efe", 3543) for r in (a, b, c))


def test_probe_result_gives_a_prefill_and_a_decode_row():
    pp, tg = read_bench(str(DATA / "probe-gemma3-270m-cpu.json"))
    d = json.loads((DATA / "probe-gemma3-270m-cpu.json").read_text())
    runs = [r for r in d["runs"] if not r["warmup"]]
    assert (pp.test, pp.n_prompt, pp.n_depth, pp.format) == ("pp128", 128, 0, "probe")
    assert pp.avg_ts == pytest.approx(sum(r["prefill_tps"] for r in runs) / len(runs))
    assert (tg.test, tg.n_gen, tg.n_depth) == ("tg16 @ d128", 16, 128)  # decode follows the prompt
    assert tg.avg_ts == pytest.approx(sum(r["decode_tps"] for r in runs) / len(runs))
    assert (pp.n_ubatch, pp.n_batch, pp.n_threads, pp.flash_attn, pp.build_commit) == (512, 2048, 2, -1, "0c1e570")


def test_jsonl_of_a_single_object_and_json_of_one_object(tmp_path, truth):
    one = {k: v for k, v in truth[1].items() if k not in ("shape", "ftype", "flags")}
    f = tmp_path / "one.json"
    f.write_text(json.dumps(one))
    (r,) = read_bench(str(f))
    assert (r.test, r.avg_ts) == ("tg128", truth[1]["avg_ts"])
    log_then_json = tmp_path / "log.json"
    log_then_json.write_text("ggml_cuda_init: found 1 CUDA devices:\n[\n" + json.dumps(one) + "\n]\n")
    assert read_bench(str(log_then_json)) == [r]


@pytest.mark.parametrize("content, phrase", [
    (None, "no such file"), ("", "empty"), ("   \n", "empty"), ("hello\nworld\n", "no llama-bench results"),
    ("[1, 2]", "item 1 is not an object"), ('[{"n_prompt": 512}]', "item 1 is neither a llama-bench result"),
    ('{"avg_ts": 1.0, "n_prompt": "x"}', "item 1: a value llama-bench would not print"),
    ("| model | test | t/s |\n| --- | --: | --: |\n| x | pp512 | fast |\n", "t/s 'fast' is not llama-bench's"),
    ("| model | test | t/s |\n| --- | --: | --: |\n| x | warmup | 1.0 |\n", "test 'warmup' is not llama-bench's"),
    ("| model | test | t/s |\n| --- | --: | --: |\n| x | pp512 |\n", "2 cells under 3 columns"),
    ('build_commit,n_prompt,avg_ts\n"a","x","1.0"\n', "a value llama-bench would not print"),
])
def test_bad_files_are_one_line(tmp_path, content, phrase):
    f = tmp_path / "bench.txt"
    if content is not None:
        f.write_text(content)
    with pytest.raises(BenchFileError) as e:
        read_bench(str(f))
    assert isinstance(e.value, GGFitError) and phrase in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(str(f))


def test_a_directory_is_one_line(tmp_path):
    with pytest.raises(BenchFileError, match="a directory"):
        read_bench(str(tmp_path))
