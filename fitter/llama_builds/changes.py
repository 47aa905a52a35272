"""What llama.cpp reserves, build by build: the memory-relevant changes between the llama.cpp builds ggfit knows.

Data only. Each change was read in the llama.cpp sources that llama-cpp-python's releases vendor
(`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.N`, `vendor/llama.cpp`) and, where the
CPU shows it, in dry runs of those releases (benchmarks/results/eras-cpu-0.3.N.json); benchmarks/eras/ERAS.md
gives the source excerpts. The graph builders, caches and backends ask `LlamaBuild.has(<id>)` (fitter.llama_builds),
never a version number.

A change is in a build when the build's number is at least `first_build` (where known), else when the build's
date is at least `date` (the day the PR merged). Where the merge date is unknown, `date` is the date of the
first release found to have it and `window` the interval it lies in: a build inside that window is uncertain
for that change, and ggfit says so.
"""

from __future__ import annotations

import datetime as _dt
from typing import NamedTuple


class Release(NamedTuple):
    """A llama-cpp-python release and the llama.cpp it vendors (`git ls-tree v0.3.N vendor/llama.cpp`)."""

    version: str
    commit: str  # full hash
    date: _dt.date  # the vendored commit's day
    number: int | None  # llama.cpp's build number (bNNNN), where a public log printed it with the commit


class Anchor(NamedTuple):
    """A llama.cpp build seen in public material with its number and its date and/or commit (prefix). A date is the
    build's day or, where the source says so, an upper bound (the day a log or a package bump showed the build)."""

    number: int
    date: _dt.date | None  # None: only the commit is known (the date is interpolated from the dated builds around it)
    commit: str | None
    source: str


class Change(NamedTuple):
    id: str
    date: _dt.date  # merged into llama.cpp master (or, if unknown, the first release found with it)
    prs: tuple[int, ...]
    backend: str  # "all" (llama side), "CPU", "CUDA", "Metal"
    buffer: str  # which printed buffer moves: model, KV, RS, output, compute, none (a limit or refusal)
    before: str  # what a build without it does, in one line, in llama.cpp's words
    first_build: int | None = None
    window: tuple[_dt.date, _dt.date] | None = None  # (last release without, first release with) when date unknown
    until: _dt.date | None = None  # reverted or fixed on that day (then builds from it on are without it again)
    until_prs: tuple[int, ...] = ()
    after: str = ""  # what a build with it does, where that is not the pinned build's rule (a reverted change)


def _d(s: str) -> _dt.date:
    return _dt.date.fromisoformat(s)


RELEASES: tuple[Release, ...] = (
    Release("0.3.15", "9a96389544a08fd829fccda28142ce2066017fde", _d("2025-08-07"), 6110),
    Release("0.3.16", "4227c9be4268ac844921b90f31595f81236bd317", _d("2025-08-14"), None),
    Release("0.3.17", "49bfddeca18e62fa3d39114a23e9fcbdf8a22388", _d("2026-03-22"), None),
    Release("0.3.20", "f49e9178767d557a522618b16ce8694f9ddac628", _d("2026-04-02"), None),
    Release("0.3.23", "7d442abf5c6244117fd5a1dc51a5d19f00792491", _d("2026-05-10"), 9102),
    Release("0.3.25", "210a6570ceda20c5d6439172c09ada08c3754cc9", _d("2026-06-01"), None),
    Release("0.3.29", "f05cf4676af46c2f017c0e6ba25b6e20204f700e", _d("2026-06-13"), 9625),
    Release("0.3.34", "e3546c7948e3af463d0b401e6421d5a4c2faf565", _d("2026-07-11"), 9976),
    Release("0.3.35", "4df29be4f4c3673f428170fda944a5b19f743bb8", _d("2026-08-16"), 10454),
    Release("0.3.36", "0c1e57098bba43ac29e6e3b677cdceebdd22334f", _d("2026-10-01"), 11312),
)

_BREW = ("Homebrew/homebrew-core Formula/l/llama.cpp.rb at its bump to this build (`tag:` and `revision:`), "
         "as stored in a fork of homebrew-core")
_GRAVITEE = ("github.com/gravitee-io/llamaj.cpp/pull/{}, a weekly bot's 'update llama.cpp from bM to bN' of {} (the "
             "latest release then: an upper bound)")
_SHAMITV = ("github.com/shamitv/llama_cpp CHANGELOG.md (its list of upstream releases with their tag dates, "
            "'bN (bN) - YYYY-MM-DD - .../releases/tag/bN')")

# Builds whose number and date (or commit) public material prints together: what maps a build number to a date and a
# commit to a build. llama.cpp numbers a build by its commit count on master (`git rev-list --count HEAD`, tag bN).
# The mid-2025 ones (b5857 .. b7376) date and name the builds back to OLDEST_BUILD (fitter.llama_builds), b6000.
ANCHORS: tuple[Anchor, ...] = (
    # before OLDEST_BUILD: only to date the builds after it
    Anchor(5857, _d("2025-07-10"), None, "github.com/janhq/jan/issues/5703 ('bump version: b5857', 2025-07-10: the "
           "date is an upper bound)"),
    Anchor(5904, None, "79e0b68c", "a public llama-bench log ('build: 79e0b68c (5904)'); llama-cpp-python 0.3.14 vendors "
           "it (79e0b68c1786): before OLDEST_BUILD, refused"),
    Anchor(5989, _d("2025-07-25"), None, _GRAVITEE.format(47, "2025-07-25")),
    Anchor(6000, None, "4762ad7316dcdec20016ab5985fb46a27902204d", _BREW + "; the same pair pinned by several public "
           "projects ('llama.cpp b6000, commit 4762ad7316dc...')"),
    Anchor(6020, None, "0a5036bee9cfb946870689db4400e9e0d17844c9", _BREW),
    Anchor(6030, None, "1e15bfd42c3938506e0da5939bf7f42780965f01", _BREW),
    Anchor(6040, None, "66625a59a54d0a7504eda4c4e83abfcd83ba1cf8", _BREW),
    Anchor(6050, None, "784524053d986255e383dae45235e4f76c6792a7", _BREW),
    Anchor(6057, _d("2025-08-01"), None, _GRAVITEE.format(48, "2025-08-01")),
    Anchor(6060, None, "9c35706b98ea271858acef4194f526a71b24cdc9", _BREW),
    Anchor(6070, None, "15e92fd33791e60a4ddb5970b47242a855c27117", _BREW),
    Anchor(6080, None, "0a2f5496bef9e54e5f42d6c2c3ad9eb7b379aed0", _BREW),
    Anchor(6082, _d("2025-08-04"), None, "github.com/termux/termux-packages/pull/25586 ('bump(main/llama-cpp): "
           "0.0.0-b6082', 2025-08-04: upper bound)"),
    Anchor(6085, _d("2025-08-05"), "ef0144c087b33e5b8da42d529ac71aaf05cb49df", "github.com/oobabooga/textgen/issues/"
           "7177 ('Support for GLM 4.5 has been added to llama.cpp in b6085 - commit ef0144c0...', 2025-08-05: upper "
           "bound)"),
    Anchor(6089, _d("2025-08-05"), None, "github.com/termux/termux-packages/pull/25599 ('bump(main/llama-cpp): "
           "0.0.0-b6089', 2025-08-05: upper bound)"),
    Anchor(6090, None, "ee3a9fcf88fe5b5e1213711e05861b83cd4fdfe6", _BREW),
    Anchor(6097, None, "9515c613", "a public llama-bench log running gpt-oss ('build: 9515c613 (6097)')"),
    Anchor(6100, None, "65c797c4fad4d9966695ac4b4a1560be44109267", _BREW),
    Anchor(6110, _d("2025-08-07"), "9a963895", "a public llama-bench log ('build: 9a963895 (6110)'); llama-cpp-python "
           "0.3.15 vendors it (9a96389544a0, its wheels of 2025-08-07: upper bound)"),
    Anchor(6140, None, "b0493156fa8622694f21f42460a84da3eded0bc0", _BREW),
    Anchor(6150, None, "b3e16665e14032d1276f9d0263acef8321b6f518", _BREW),
    Anchor(6180, None, "2e2b22ba6607414a5d619ac6d2f034b5b02214e5", _BREW),
    Anchor(6190, None, "ae532eac2c1df1d8edc3d2719145895b966de1bf", _BREW),
    Anchor(6280, None, "0fd90db5858e325358a5fbdaa4e327ee2a79d0d4", _BREW),
    Anchor(6300, None, "47373271f971aa5a0a6462b286f4a7b5bd4ba644", _BREW),
    Anchor(6316, _d("2025-08-29"), None, _GRAVITEE.format(54, "2025-08-29")),
    Anchor(6327, _d("2025-08-31"), None, "github.com/mybigday/llama.node/pull/102 ('sync llama.cpp to b6327', "
           "'introduce flash_attn_type (auto|on|off)', 2025-08-31: upper bound)"),
    Anchor(6370, None, "661ae31c9c68201577e70278285b349a5a662caf", _BREW),
    Anchor(6390, _d("2025-09-05"), "a81283820a466f2ace06ce4d4bc9512761f9365f", _BREW + "; " +
           _GRAVITEE.format(55, "2025-09-05")),
    Anchor(6440, None, "33daece86b65607451d0d4378d2d04ba6a20ad55", _BREW),
    Anchor(6457, _d("2025-09-12"), "08a216474", "github.com/ggml-org/llama.cpp/pull/15952 (a llama-bench run of "
           "'build_2025.09.12', 'build: 08a216474 (6457)', described 2025-09-12: upper bound)"),
    Anchor(6469, _d("2025-09-14"), None, _SHAMITV),
    Anchor(6500, _d("2025-09-17"), None, _SHAMITV),
    Anchor(6519, _d("2025-09-19"), None, _GRAVITEE.format(62, "2025-09-19")),
    Anchor(6594, _d("2025-09-26"), None, _GRAVITEE.format(65, "2025-09-26")),
    Anchor(6666, _d("2025-10-02"), None, _SHAMITV),
    Anchor(6700, None, "3df2244df40c67dfd6ad548b40ccc507a066af2b", _BREW),
    Anchor(6792, _d("2025-10-18"), None, _SHAMITV),
    Anchor(6895, _d("2025-10-31"), "4341dc8bc", "tools/fit-params/README.md of llama.cpp (a run printing 'build: 6895 "
           "(4341dc8bc)'; tests/data/llama_logs/23-cuda-b6895-fit-params.log); the tag date from " + _SHAMITV),
    Anchor(6940, _d("2025-11-03"), "c5023daf607c578d6344c628eb7da18ac3d92d32", _BREW + "; the tag date from " + _SHAMITV),
    Anchor(6957, _d("2025-11-05"), None, _SHAMITV),
    Anchor(7058, _d("2025-11-14"), None, _SHAMITV),
    Anchor(7090, _d("2025-11-18"), None, _SHAMITV),
    Anchor(7218, _d("2025-12-01"), None, _SHAMITV),
    Anchor(7376, _d("2025-12-13"), None, _SHAMITV),
    Anchor(7380, _d("2025-12-13"), None, "github.com/ggml-org/llama.cpp/issues/18004 (filed 2025-12-13, bisecting b7296..b7380, "
           "the newest build then: the date is an upper bound)"),
    Anchor(8284, _d("2026-03-11"), "00de61534", "github.com/ggml-org/llama.cpp/issues/20431"),
    Anchor(8639, _d("2026-04-02"), None, "github.com/fragcolor-xyz/shards/pull/1261 ('Bump llama.cpp from b8575 to b8639 "
           "(April 2, 2026)', Gemma 4 support)"),
    Anchor(9102, _d("2026-05-10"), "7d442abf5", "llama-cpp-python 0.3.23's vendored llama.cpp, printed as 'llama-server v9102 (7d442abf5)' in a public issue"),
    Anchor(9525, _d("2026-06-05"), "ad1b88ca0", "github.com/ggml-org/llama.cpp/issues/24175"),
    Anchor(9459, _d("2026-06-01"), "95b8b8ec1", "github.com/ggml-org/llama.cpp/issues/23978 ('version: 9459 (95b8b8ec1)', "
           "filed 2026-06-01)"),
    Anchor(9625, _d("2026-06-13"), "f05cf4676", "llama-cpp-python 0.3.29's vendored llama.cpp, printed in a public log"),
    Anchor(9976, _d("2026-07-11"), "e3546c794", "llama-cpp-python 0.3.34's vendored llama.cpp, printed in public code"),
    Anchor(10454, _d("2026-08-16"), "4df29be4f", "llama-cpp-python 0.3.35's vendored llama.cpp, printed in a public benchmark"),
    Anchor(10615, _d("2026-08-25"), None, "github.com/ggml-org/llama.cpp/issues/27680 (release b10615)"),
    Anchor(11026, _d("2026-09-19"), None, "a public evaluation report (runtime b11026, 2026-09-19)"),
    Anchor(11312, _d("2026-10-01"), "0c1e57098", "llama-cpp-python 0.3.36's vendored llama.cpp (ggfit's pin)"),
)

_R = {r.version: r.date for r in RELEASES}


def _between(old: str, new: str) -> tuple[_dt.date, _dt.date]:
    return (_R[old], _R[new])


# In order of date. `before` says what a build without the change does.
CHANGES: tuple[Change, ...] = (
    # "llama : add --n-cpu-moe option" (#15077, 2025-08-04), in b6089 (oobabooga/textgen#7178)
    Change("n_cpu_moe_flag", _d("2025-08-05"), (15077,), "all", "none",
           "--cpu-moe / --n-cpu-moe do not exist: the expert weights are kept on the CPU with -ot regexes",
           first_build=6089),
    # "llama : enable LLAMA_SET_ROWS=1 by default" (#14959, opened 2025-07-30, "planning to merge this after #15006 is
    # fixed" on 2025-08-01): 0.3.14 (before b6000) reads LLAMA_SET_ROWS with a default of 0, 0.3.15 (b6110) of 1, and
    # keeps the old path behind LLAMA_SET_ROWS=0 (recorded: eras-cpu-0.3.15-setrows0.json)
    Change("kv_set_rows_default", _d("2025-08-07"), (14959,), "all", "compute",
           "the KV cache is written with a view + ggml_cpy at the slot's head (no k_idxs / v_idxs inputs), and a "
           "non-unified cache is forced unified (\"non-unified KV cache requires ggml_set_rows()\")",
           window=(_d("2025-08-01"), _d("2025-08-07"))),
    # "llama : allow other bufts when overriding to CPU, add --no-repack option" (#14990, opened 2025-07-31): in 0.3.15's
    # common/arg.cpp, not in 0.3.14's. Without mmap, a tensor overridden to the CPU then takes the GPU's host buffer type
    # (CUDA_Host) instead of the plain CPU one: a label, the same bytes (both align to 32)
    Change("no_repack_flag", _d("2025-08-07"), (14990,), "all", "none",
           "--no-repack does not exist (the CPU's extra buffer types are used only without a GPU), and a tensor "
           "overridden to the CPU without mmap goes to the CPU buffer, not the GPU's host buffer type",
           window=(_d("2025-07-31"), _d("2025-08-07"))),
    Change("fa_default_auto", _d("2025-08-31"), (), "all", "compute",
           "flash attention defaults to off (-fa auto does not exist): the KQ-matrix graph"),
    Change("max_seq_256", _d("2025-09-10"), (15916,), "all", "none",
           "n_seq_max is at most 64"),
    # "metal : allow ops to run concurrently" (#15929, opened 2025-09-10; merged before #16216 of 2025-09-24, which
    # relaxed its conditions): ggml_graph_optimize reorders each Metal split before ggml-alloc sees it
    Change("metal_graph_optimize", _d("2025-09-10"), (15929,), "Metal", "compute",
           "Metal computes each split in graph order (no reorder for concurrency before the compute buffer is sized)",
           window=(_d("2025-09-10"), _d("2025-09-24"))),
    Change("kv_size_pad_backend", _d("2025-11-06"), (16812, 17046), "all", "KV",
           "the KV cache size is padded to 256 cells with flash attention, 32 without; n_ctx is not padded"),
    # "server : support unified cache across slots" (#16736, opened 2025-10-23: "By default, start the server using 4
    # slots and unified KV cache"); b7079 of 2025-11-16 has it (issue #17300), its merge build was not found
    Change("server_np_auto", _d("2025-11-16"), (16736,), "all", "KV",
           "llama-server defaults to one slot (-np 1) without a unified cache (0.3.16 common_params: n_parallel 1, "
           "kv_unified false); -np auto (4 slots, unified) does not exist",
           window=(_d("2025-10-23"), _d("2025-11-16"))),
    # "llama : update worst-case graph for unified cache" (#17379, 2025-11-19) was folded into #17276 ("think we can
    # merge this into #17276", 2025-11-20); #17276's merge date was not found, hence the window up to 0.3.17
    Change("reserve_n_seqs_unified", _d("2025-11-20"), (17379, 17276), "all", "compute",
           "a unified KV cache reserves the worst-case graph for 1 sequence",
           window=(_d("2025-11-19"), _R["0.3.17"])),
    Change("kq_mask_batch_pad_64", _d("2025-12-12"), (16148, 16309), "all", "compute",
           "the KQ mask has GGML_PAD(n_tokens, 64) rows"),
    Change("embd_input_always", _d("2026-01-18"), (18550, 18898), "all", "compute",
           "the token-embedding input is the only graph input of a token batch (no n_embd x n_ubatch f32 input)"),
    Change("mla_v_less_cache", _d("2026-01-24"), (19067,), "all", "KV",
           "MLA models cache V (kv_lora_rank per cell) besides the latent K"),
    Change("gallocr_chunked_vbuffer", _d("2026-03-22"), (), "all", "compute",
           "a compute buffer is one chunk (no split above the device's max buffer size)",
           window=_between("0.3.16", "0.3.17")),
    Change("metal_alloc_size_extras", _d("2026-03-22"), (), "Metal", "compute",
           "Metal reserves no per-op scratch (flash attention pad/blk/tmp, MUL_MAT_ID ids) in the compute buffer",
           window=_between("0.3.16", "0.3.17")),
    Change("attn_rot_quantized_kv", _d("2026-04-01"), (21038,), "all", "compute",
           "quantized K/V are not rotated (no Hadamard rotation inputs or rotated copies)"),
    # #21332 was opened on 2026-04-02 and merged after f49e917 of that day (0.3.20's llama.cpp, which has #21277
    # without the revert): builds of 2026-04-02 are taken to have the f16-only SWA cache
    Change("swa_cache_f16_only", _d("2026-04-01"), (21277,), "all", "KV",
           "the SWA cache takes -ctk/-ctv like the full cache",
           until=_d("2026-04-03"), until_prs=(21332,),
           after="the SWA cache is f16 whatever -ctk/-ctv say (#21277, reverted by #21332)"),
    Change("quant_kv_block_check_fa_on", _d("2026-05-10"), (), "all", "none",
           "a quantized K/V whose block does not divide the head size is accepted with -fa on",
           window=_between("0.3.20", "0.3.23")),
    # first build: b9410 ("llama.cpp b9410 uses f16 mask for Flash Attention", theneuralfeed.com/article/b9410)
    Change("kq_mask_f16_fa", _d("2026-05-27"), (23764,), "all", "compute",
           "with flash attention the KQ mask is built f32 and cast to f16 (both in the compute buffers)",
           first_build=9410),
    # merged 2026-06-01 as de6f727aa (opened 2026-05-29 as "continue #23764"; public changelogs of forks list the
    # commit with that date); its build number was not found: b9459 was out on 2026-06-01 (issue #23978) and 0.3.25's
    # 210a6570c of that day has it. A build is placed by its date. The June seed (b9430) is older: it reserves the
    # whole ubatch's logits, and so does the August draft seed, whose figures grow by them (tests/fit/test_seed_figures.py).
    Change("logits_whole_ubatch", _d("2026-06-01"), (23861,), "all", "compute",
           "the worst-case graph computes logits for every token of the ubatch (n_outputs_max does not exist)"),
    Change("embd_pre_norm_output", _d("2026-06-01"), (), "all", "output",
           "the output buffer holds no pre-norm embeddings for MTP",
           window=_between("0.3.23", "0.3.25")),
    # with MTP support (#22673, "llama + spec: MTP Support": reviewed up to 2026-05-16, merged after): the rows are
    # picked after the output norm unless the pre-norm embeddings are masked. The August draft seed's steps (b9440
    # stands for it, tests/fit/test_seed_figures.py) come out to the MiB only with the rows picked after the norm
    Change("qwen35_out_ids_after_norm", _d("2026-05-16"), (22673,), "all", "compute",
           "qwen35 and qwen35moe pick the output rows in their last layer, before the residual add (not after the "
           "output norm)",
           window=(_d("2026-05-16"), _R["0.3.25"])),
    Change("mtp_context", _d("2026-06-01"), (), "all", "none",
           "no MTP draft context (LLAMA_CONTEXT_TYPE_MTP): --spec-type draft-mtp does not exist",
           window=_between("0.3.23", "0.3.25")),
    Change("rs_snapshots_n_rs_seq", _d("2026-06-01"), (), "all", "RS",
           "the recurrent state keeps no snapshots for speculative rollback (n_rs_seq)",
           window=_between("0.3.23", "0.3.25")),
    # #23907 (f8f0a47a5) was opened 2026-05-30 and merged after 210a6570c of 2026-06-01 (0.3.25's llama.cpp, which
    # lacks it) and before issue #24166 of 2026-06-05 bisected to it
    Change("cuda_fa_f16_kv_reserve", _d("2026-06-02"), (23907,), "CUDA", "compute",
           "CUDA reserves no f16 copy of a quantized K/V for flash attention",
           window=(_d("2026-06-01"), _d("2026-06-05"))),
    Change("gemma4_out_ids_after_norm", _d("2026-06-13"), (), "all", "compute",
           "gemma4 picks the output rows in its last layer, after attention and in its per-layer input (not after "
           "the output norm)",
           window=_between("0.3.25", "0.3.29")),
    Change("kv_nextn_layers_main_ctx", _d("2026-06-13"), (), "all", "KV",
           "the main context's KV cache has no cells for the NextN (MTP) layers",
           window=_between("0.3.25", "0.3.29"), until=_d("2026-09-09"), until_prs=(28630,),
           after="the main context's KV cache holds cells for the NextN (MTP) layers too (fixed by #28630)"),
    Change("out_ids_after_norm", _d("2026-08-16"), (), "all", "compute",
           "gpt-oss and qwen3next pick the output rows in their last layer, before the residual add (not after it)",
           window=_between("0.3.34", "0.3.35")),
    Change("qwen3next_gate_no_reshape", _d("2026-08-16"), (), "all", "none",
           "qwen3next reshapes its attention gate after the sigmoid (one more graph node, the same bytes)",
           window=_between("0.3.34", "0.3.35")),
    Change("n_outputs_max_per_seq", _d("2026-08-16"), (), "all", "compute",
           "speculative drafts reserve logits for n_parallel outputs (one per sequence)",
           window=_between("0.3.34", "0.3.35")),
    # "ggml: allow passing alloc dependencies in graph_optimize" (#27301, opened 2026-08-18, merge date not found)
    # and CUDA's use of it for its MoE fusions; 0.3.35 (2026-08-16) has neither, 0.3.36 both
    Change("cuda_fusion_alloc_deps", _d("2026-08-18"), (27301,), "CUDA", "compute",
           "CUDA keeps no tensor alive longer for its fusions (graph_optimize adds no alloc deps: MoE weighted "
           "reduction, top-k MoE routing)",
           window=(_R["0.3.35"], _R["0.3.36"])),
    Change("metal_fa_kv_f16_extra", _d("2026-08-20"), (27390,), "Metal", "compute",
           "Metal's flash attention reserves no f16 copy of K and V"),
    Change("deepseek2_q_reshape", _d("2026-10-01"), (), "all", "none",
           "deepseek2 takes its q views from the 2-d q projection (no reshape node first; the same bytes)",
           window=_between("0.3.35", "0.3.36")),
    Change("metal_fusion_table", _d("2026-10-01"), (), "Metal", "compute",
           "Metal's reorder packs only ADD / MUL / NORM / RMS_NORM runs, and a pack's sources include what it computes "
           "itself (no fusion table, no alloc deps for its MoE fusions)",
           window=_between("0.3.35", "0.3.36")),
    Change("metal_mul_mat_id_amax", _d("2026-10-01"), (), "Metal", "compute",
           "Metal's MUL_MAT_ID reserves no amax scales (8 + N_MM_NPART_AMAX x 4 B) after its output",
           window=_between("0.3.35", "0.3.36")),
    Change("metal_fa_sparse_idx", _d("2026-10-01"), (), "Metal", "compute",
           "Metal's flash attention reserves no sparse KV index lists (n_kv_max hint)",
           window=_between("0.3.35", "0.3.36")),
    Change("cuda_fa_vec_f16_fallback", _d("2026-10-01"), (), "CUDA", "compute",
           "CUDA's vec flash-attention kernel reserves f16 K/V copies only for f32 K/V (none for a type pair "
           "without a compiled vec kernel)",
           window=_between("0.3.35", "0.3.36")),
    Change("sched_copies_every_input", _d("2026-10-01"), (), "all", "compute",
           "pipeline parallelism (several GPUs) copies only the graph inputs a split reads, not an unused one such as "
           "the embeddings input of a token batch",
           window=_between("0.3.35", "0.3.36")),
    Change("gallocr_clamp_inplace", _d("2026-10-01"), (), "all", "compute",
           "CLAMP is not computed in place",
           window=_between("0.3.35", "0.3.36")),
    # "ref: #28068" in 0.3.36's models.h build_gdn_l2_norm; 0.3.35's qwen35 / qwen3next call ggml_l2_norm. The same bytes
    # (L2_NORM's output, or RMS_NORM's with the SCALE in place): two graph nodes instead of one, which Metal's reorder sees
    Change("gdn_l2_norm_rms_scale", _d("2026-10-01"), (28068,), "all", "none",
           "the gated delta net's q/k L2 norm is one GGML_OP_L2_NORM node (not RMS_NORM then SCALE)",
           window=_between("0.3.35", "0.3.36")),
    Change("rs_ple_conv_state", _d("2026-10-01"), (), "all", "RS",
           "no PLE conv state",
           window=_between("0.3.35", "0.3.36")),
)


class ArchAdded(NamedTuple):
    """The first llama.cpp with an architecture ggfit models (older builds fail to load it: "unknown model
    architecture"). Only the architectures added after the oldest build ggfit models (b6000, July 2025)."""

    arch: str
    date: _dt.date  # merged (or, if unknown, the first date seen with it)
    prs: tuple[int, ...]
    source: str
    first_build: int | None = None
    window: tuple[_dt.date, _dt.date] | None = None  # the merge lies in it when the date is not known


ARCHS_ADDED: tuple[ArchAdded, ...] = (
    ArchAdded("glm4moe", _d("2025-08-05"), (14939,),
              "PR #14939 'model: Add support for GLM 4.5 family of models', in b6085 (ef0144c0; oobabooga/textgen#7177 "
              "of 2025-08-05); 0.3.14 refuses it, 0.3.15 (b6110) knows it", first_build=6085),
    # the launch day of gpt-oss; a public llama-bench log runs it on b6097 (9515c613)
    ArchAdded("gpt-oss", _d("2025-08-05"), (15091,),
              "PR #15091 'llama : add gpt-oss', 2025-08-05, run on b6097 in a public log; 0.3.14 refuses it, 0.3.15 "
              "(b6110) knows it"),
    ArchAdded("qwen3next", _d("2025-11-28"), (16095,),
              "PR #16095 merged 2025-11-28 (ollama/ollama#12349, abetlen/llama-cpp-python#2097); "
              "0.3.16 refuses it, 0.3.17 loads it"),
    ArchAdded("mistral3", _d("2025-12-01"), (17644,),
              "PR #17644 'model: support Ministral3', 2025-12-01; 0.3.16 refuses it, 0.3.17 loads it"),
    ArchAdded("qwen35", _d("2026-02-10"), (19468,),
              "PR #19468 (after #19435 was reverted by #19453 on 2026-02-09), merged by 2026-02-24 "
              "(SciSharp/LLamaSharp#1340); 0.3.16 refuses it, 0.3.17 loads it",
              window=(_d("2026-02-09"), _d("2026-02-24"))),
    ArchAdded("qwen35moe", _d("2026-02-10"), (19468,), "as qwen35 (the same PR)",
              window=(_d("2026-02-09"), _d("2026-02-24"))),
    ArchAdded("gemma4", _d("2026-04-02"), (21309,),
              "PR #21309, in b8639 of 2026-04-02 (fragcolor-xyz/shards#1261); 0.3.17 (2026-03-22) refuses it, "
              "0.3.20 (f49e917, 2026-04-02) knows it"),
)
