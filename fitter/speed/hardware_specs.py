"""Hardware profiles of the speed model: published figures, each with the URL it was read from.

Pure data. One dict per profile, named as issue 46 says: ``apple-m<gen>[-pro|-max|-ultra]-<gpu cores>``,
``nvidia-<model>``, and ``cpu``. Keys:

- ``name``, ``chip`` (marketing name), ``backend`` ("metal" | "cuda" | "cpu"), ``unified`` (one memory pool
  shared by CPU and GPU).
- ``memory_bandwidth_gbs``: peak memory bandwidth in GB/s (10^9 bytes/s) as the vendor or the cited table
  gives it; ``None`` for ``cpu`` (measured at run time).
- ``fp16_tflops``: dense FP16 throughput, no sparsity. NVIDIA: tensor cores, FP16 inputs with FP32
  accumulate (GeForce parts run that at half their FP16-accumulate rate). Apple: the GPU's FP16 rate,
  which equals its FP32 ALU rate (128 ALUs per core, one FMA = 2 FLOPs per clock); computed here as
  cores x 128 x 2 x the clock philipturner/metal-benchmarks lists for the chip (M2 Pro/Max/Ultra: its
  lower bound, 1398 MHz). Left out where no clock or figure was found (M3 and later).
- ``int8_tops``: NVIDIA dense tensor-core INT8 TOPS, no sparsity. Not given for Apple.
- ``gpu_cores``: Apple GPU cores; NVIDIA streaming multiprocessors (SMs).
- ``mma_sync_share``: Hopper (H100, H200) only: the share of its tensor figures that the warp-level ``mma.sync``
  instructions reach (0.5), the ones llama.cpp's MMQ and flash-attention kernels issue (ggml-cuda/mma.cuh); the
  datasheet figures need the warpgroup ``wgmma`` instructions, which only cuBLAS issues. Default 1.
- ``memory_gib``: the memory sizes the cited source names (often only the largest one offered).
- ``pcie_gbs``: discrete NVIDIA cards: theoretical one-direction host-link bandwidth in GB/s of the bus
  the cited table names (PCIe 4.0 x16 = 32, PCIe 5.0 x16 = 64). Absent for unified parts.
- ``nvml_names``: the device name NVML / nvidia-smi / llama.cpp's CUDA backend report, where a log of it
  was read.
- ``sources``: field -> URL of the page or file the figure was read from. Every figure given has one;
  a figure that could not be sourced is left out rather than guessed.

Doubts (see also the note of benchmarks/results/speed-published.json):

- Apple does not publish the M1's bandwidth: 68.25 GB/s is LPDDR4X-4266 on 128 bits; one cited page
  lists "68.2GB/s?", another 66.6 GB/s.
- M3 Max: Apple's 400 GB/s (40-core GPU) vs 409.6 GB/s (LPDDR5-6400 on 512 bits) in another table.
  M3 Ultra: 819 GB/s (cited) vs the "800 GB/s" some pages round to.
- The binned Max chips have less bandwidth than the full ones (M3 Max 30-core, M4 Max 32-core, M5 Max
  32-core): no page read here gives their figure, so those three profiles carry no bandwidth.
- Several NVIDIA figures come from community spec tables on GitHub (secondary sources that copy NVIDIA's
  datasheets and TechPowerUp); they agree with NVIDIA's whitepapers where checked (RTX 4090 165 TFLOPS /
  661 TOPS, H100 SXM 989 / 1979). RTX 3060 compute is left out: that table's figures assume a wrong
  clock.
"""

from __future__ import annotations

# --- Apple sources ---------------------------------------------------------------------------------
_METAL_BENCH = "https://github.com/philipturner/metal-benchmarks#readme"
_NBC_M1 = ("https://notebookcheck.com/M1-Pro-16-Core-GPU-vs-M1-8-Core-GPU-vs-M1-Max-24-Core-GPU_10963_10552_10967"
           ".247532.0.html")
_M1_BW = ("https://digitalnotebook.online/en/notebook/how-fast-is-a-16-inch-macbook-pro-with-m1-max-demonstrate-high"
          "-performance-that-not-only-intel-cpu-but-also-geforce")
_M1_MEM = "https://hmong.ovh/ru/Apple_M1_Max"
_M1_PRO_MAX = ("https://www.gizbot.com/computer/features/apple-m1-pro-apple-m1-max-explained-most-powerful-apple-silicon"
               "-077376.html")
_ULTRA_12 = "https://myapplechat.com/apples-m2-ultra-chip-is-the-most-powerful-yet/"
_ULTRA_BW = "https://gamebastion.com/n/apple-s-m4-max-is-the-first-non-ultra/474547"
_M2_BINS = "https://clickthis.blog/apple-m2-budet-dostupen-v-dvuh-variantah-graficheskogo-proczessora-a-bazovaya-versiya-teper-imeet-8-yader"
_M2_AIR = "https://downtownnews.co.uk/apple-unveils-new-macbooks-with-first-m2-chip/"
_M2_PRO_MAX = "https://www.androidauthority.com/apple-m2-ultra-launched-3331718/"
_M2_MAX_STUDIO = "https://www.theverge.com/2023/6/5/23745477/apple-mac-studio-m2-max-ultra-chip-update-features-specs-wwdc-2023?showComments=1"
_M123_TABLE = "https://abachy.com/news/apples-m3-series-chips-enhanced-performance-and-advanced-gpus"
_M3_PRO = "https://gigazine.net/gsc_news/en/20231101-apple-m3-pro-memory-bandwidth"
_M3_AIR = "https://hothardware.com/news/apples-m3-macbook-air-smokes-m2-model-in-early-benchmarks"
_M3_MAX = "https://wikizero.net/wiki/de/Apple_M3_Max"
_M3_MAX_BW = "https://macmegasite.com/2024/10/30/m4-max-chip-has-16-core-cpu-40-core-gpu-and-35-increase-in-memory-bandwidth"
_M3_FAMILY = "https://www.clubic.com/actualite-507205-avec-ses-puces-m3-m3-pro-et-m3-max-apple-essaye-encore-de-vous-faire-jouer-sur-mac.html"
_M3_ULTRA = "https://www.lilaclabs.ai/blog/2026/05/13/qwen-3-6-gemma-4-on-m3-ultra-mac-studio"
_M3_ULTRA_80 = "https://gigazine.net/gsc_news/en/20230814-apple-m3-ultra-mac-studio"
_M4 = "https://allyoucantech.com/?p=164071"
_M4_AIR = "https://web-production-4e80b.up.railway.app/page/MacBook_Air"
_M4_LINE = "https://nutechbrt.com/apple-announces-m4-max-chip-debuting-on-the-macbook-pro"
_M4_MAX = "https://www.notebookcheck.net/Apple-M4-Max-official-with-incremental-upgrades-over-the-M3-Max.911098.0.html"
_M5 = "https://mikeshouts.com/apple-m5-chip/"
_M5_MEM = "https://dig.watch/updates/apple-launches-m5-with-bigger-ai-gains"
_M5_PRO_MAX = "https://www.lowyat.net/2026/385170/apple-m5-pro-m5-max"
# llama.cpp discussion #4167 lists these chip / GPU-core variants in its table (read through a copy)
_D4167 = "https://github.com/ggml-org/llama.cpp/discussions/4167"

# --- NVIDIA sources --------------------------------------------------------------------------------
_GPUMAP = "https://github.com/lamonoai/gpumap/blob/8d5e174f6f25a520db1ada126d4c1fa5c5eb6df9/nvidia/GPU.md"
_CYBIRD = ("https://github.com/CYBIRD-D/How-to-Choose-your-LLM-Model-for-translation/blob/"
           "52379077acab0e1d450adb86345f9e705bb6cade/Nvidia_GPU_Specification.md")
_D15013 = "https://github.com/ggml-org/llama.cpp/discussions/15013"
_PR4766 = "https://github.com/ggml-org/llama.cpp/pull/4766"
_RTX3060 = "https://www.rtechsl.com/shop/rtx3060-12g-994"
# Hopper's mma.sync at half its wgmma rate: "Dissecting the NVIDIA Hopper Architecture through Microbenchmarking"
_HOPPER_MMA = "https://arxiv.org/html/2501.12084v2"
_PRO6000 = "https://hardware-corner.net/rtx-5090-vs-rtx-pro-6000-spec-comparison-20250321"
_PRO6000_SM = "https://www.topcpu.net/es/news/nvidia-launches-96gb-rtx-5090-model-with-a-whopping-price-tag-of-10000"
# NVIDIA's announcement: 101 tensor TFLOPS, GeForce Ampere's headline figure (sparse FP16 = dense INT8, as gpumap's
# RTX 3070 row, 163, shows)
_RTX3060_TENSOR = "https://mmntech.ca/2021/01/12/nvidia-announces-rtx-3060-as-successor-to-legendary-gtx-1060"
_SPARK = "https://ai-infrastructure.net/dgx-spark/"
# GB10's GPU: "1 petaFLOP of FP4 with sparsity, on par with an RTX 5070" (Hot Chips 2025); the RTX 5070's row in
# gpumap (988 FP4 sparse) gives 247 INT8 / 62 FP16 dense, so GB10 is taken at 250 / 62
_SPARK_TENSOR = "https://meterpreter.org/a-supercomputer-on-your-desk-nvidia-unveils-the-dgx-spark-ai-superchip"
_SPARK_BENCH = ("https://github.com/ggml-org/llama.cpp/blob/4c7e9893c4ca8eec35d032726d14b74fae76cff8/benches/"
                "dgx-spark.md")
_XD_NB = ("https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference/blob/7d5af5243b33c4fbea06cfaa962aa7fdee031af6/"
          "LLaMA%203/Professional%20GPUs/")  # llama.cpp's device line in each notebook's llama-bench output
_H200_SMI = "benchmarks/results/gpu-memory-h200.json"  # nvidia-smi on the device this project measures on


def _apple(name: str, chip: str, cores: int, bw: float | None, fp16: float | None, mem: tuple[int, ...] | None,
           src: dict[str, str]) -> dict[str, object]:
    spec: dict[str, object] = {"name": name, "chip": chip, "backend": "metal", "unified": True,
                               "memory_bandwidth_gbs": bw, "gpu_cores": cores}
    if fp16 is not None:
        spec["fp16_tflops"] = fp16
    if mem is not None:
        spec["memory_gib"] = mem
    if bw is None:
        del spec["memory_bandwidth_gbs"]
    spec["sources"] = src
    return spec


def _s(bw: str | None, cores: str, fp16: str | None = None, mem: str | None = None) -> dict[str, str]:
    out = {"gpu_cores": cores}
    for key, url in (("memory_bandwidth_gbs", bw), ("fp16_tflops", fp16), ("memory_gib", mem)):
        if url is not None:
            out[key] = url
    return out


_APPLE: tuple[dict[str, object], ...] = (
    # M1 (clock 1278 MHz), M1 Pro / Max / Ultra (1296 MHz): metal-benchmarks
    _apple("apple-m1-7", "Apple M1 (7-core GPU)", 7, 68.25, 2.29, (8, 16), _s(_M1_BW, _NBC_M1, _METAL_BENCH, _M1_MEM)),
    _apple("apple-m1-8", "Apple M1 (8-core GPU)", 8, 68.25, 2.62, (8, 16), _s(_M1_BW, _NBC_M1, _METAL_BENCH, _M1_MEM)),
    _apple("apple-m1-pro-14", "Apple M1 Pro (14-core GPU)", 14, 200.0, 4.64, (32,),
           _s(_M1_PRO_MAX, _NBC_M1, _METAL_BENCH, _M1_PRO_MAX)),
    _apple("apple-m1-pro-16", "Apple M1 Pro (16-core GPU)", 16, 200.0, 5.31, (32,),
           _s(_M1_PRO_MAX, _M1_PRO_MAX, _METAL_BENCH, _M1_PRO_MAX)),
    _apple("apple-m1-max-24", "Apple M1 Max (24-core GPU)", 24, 400.0, 7.96, (64,),
           _s(_M1_PRO_MAX, _M1_PRO_MAX, _METAL_BENCH, _M1_PRO_MAX)),
    _apple("apple-m1-max-32", "Apple M1 Max (32-core GPU)", 32, 400.0, 10.62, (64,),
           _s(_M1_PRO_MAX, _M1_PRO_MAX, _METAL_BENCH, _M1_PRO_MAX)),
    _apple("apple-m1-ultra-48", "Apple M1 Ultra (48-core GPU)", 48, 800.0, 15.93, (128,),
           _s(_ULTRA_BW, _ULTRA_12, _METAL_BENCH, _ULTRA_12)),
    _apple("apple-m1-ultra-64", "Apple M1 Ultra (64-core GPU)", 64, 800.0, 21.23, (128,),
           _s(_ULTRA_BW, _ULTRA_12, _METAL_BENCH, _ULTRA_12)),
    # M2 (1398 MHz), M2 Pro / Max / Ultra (>= 1398 MHz): metal-benchmarks
    _apple("apple-m2-8", "Apple M2 (8-core GPU)", 8, 100.0, 2.86, (24,), _s(_M2_AIR, _M2_BINS, _METAL_BENCH, _M2_AIR)),
    _apple("apple-m2-10", "Apple M2 (10-core GPU)", 10, 100.0, 3.58, (24,), _s(_M2_AIR, _M2_BINS, _METAL_BENCH, _M2_AIR)),
    _apple("apple-m2-pro-16", "Apple M2 Pro (16-core GPU)", 16, 200.0, 5.73, (32,),
           _s(_M3_PRO, _D4167, _METAL_BENCH, _M2_PRO_MAX)),
    _apple("apple-m2-pro-19", "Apple M2 Pro (19-core GPU)", 19, 200.0, 6.80, (32,),
           _s(_M3_PRO, _M2_PRO_MAX, _METAL_BENCH, _M2_PRO_MAX)),
    _apple("apple-m2-max-30", "Apple M2 Max (30-core GPU)", 30, 400.0, 10.74, (96,),
           _s(_M2_MAX_STUDIO, _D4167, _METAL_BENCH, _M2_MAX_STUDIO)),
    _apple("apple-m2-max-38", "Apple M2 Max (38-core GPU)", 38, 400.0, 13.60, (96,),
           _s(_M2_MAX_STUDIO, _M2_MAX_STUDIO, _METAL_BENCH, _M2_MAX_STUDIO)),
    _apple("apple-m2-ultra-60", "Apple M2 Ultra (60-core GPU)", 60, 800.0, 21.47, (64, 128, 192),
           _s(_ULTRA_BW, _ULTRA_12, _METAL_BENCH, _M2_PRO_MAX)),
    _apple("apple-m2-ultra-76", "Apple M2 Ultra (76-core GPU)", 76, 800.0, 27.20, (64, 128, 192),
           _s(_ULTRA_BW, _ULTRA_12, _METAL_BENCH, _M2_PRO_MAX)),
    # M3 family
    _apple("apple-m3-8", "Apple M3 (8-core GPU)", 8, 100.0, None, (24,), _s(_M123_TABLE, _M3_AIR, None, _M3_AIR)),
    _apple("apple-m3-10", "Apple M3 (10-core GPU)", 10, 100.0, None, (24,), _s(_M123_TABLE, _M3_AIR, None, _M3_AIR)),
    _apple("apple-m3-pro-14", "Apple M3 Pro (14-core GPU)", 14, 150.0, None, (36,),
           _s(_M3_PRO, _M3_PRO, None, _M3_FAMILY)),
    _apple("apple-m3-pro-18", "Apple M3 Pro (18-core GPU)", 18, 150.0, None, (36,),
           _s(_M3_PRO, _M3_PRO, None, _M3_FAMILY)),
    _apple("apple-m3-max-30", "Apple M3 Max (30-core GPU)", 30, None, None, (128,), _s(None, _M3_MAX, None, _M3_FAMILY)),
    _apple("apple-m3-max-40", "Apple M3 Max (40-core GPU)", 40, 400.0, None, (128,),
           _s(_M3_MAX_BW, _M3_MAX, None, _M3_FAMILY)),
    _apple("apple-m3-ultra-60", "Apple M3 Ultra (60-core GPU)", 60, 819.0, None, (96,),
           _s(_M3_ULTRA, _M3_ULTRA, None, _M3_ULTRA)),
    _apple("apple-m3-ultra-80", "Apple M3 Ultra (80-core GPU)", 80, 819.0, None, None, _s(_M3_ULTRA, _M3_ULTRA_80)),
    # M4 family
    _apple("apple-m4-8", "Apple M4 (8-core GPU)", 8, 120.0, None, (32,), _s(_M4, _M4_AIR, None, _M4_AIR)),
    _apple("apple-m4-10", "Apple M4 (10-core GPU)", 10, 120.0, None, (32,), _s(_M4, _M4_AIR, None, _M4_AIR)),
    _apple("apple-m4-pro-16", "Apple M4 Pro (16-core GPU)", 16, 273.0, None, (64,),
           _s(_ULTRA_BW, _D4167, None, _ULTRA_BW)),
    _apple("apple-m4-pro-20", "Apple M4 Pro (20-core GPU)", 20, 273.0, None, (64,),
           _s(_M4_LINE, _M4_LINE, None, _ULTRA_BW)),
    _apple("apple-m4-max-32", "Apple M4 Max (32-core GPU)", 32, None, None, (128,), _s(None, _M4_MAX, None, _M4_MAX)),
    _apple("apple-m4-max-40", "Apple M4 Max (40-core GPU)", 40, 546.0, None, (128,), _s(_M4_MAX, _M4_MAX, None, _M4_MAX)),
    # M5 family
    _apple("apple-m5-10", "Apple M5 (10-core GPU)", 10, 153.0, None, (32,), _s(_M5, _M5, None, _M5_MEM)),
    _apple("apple-m5-pro-16", "Apple M5 Pro (16-core GPU)", 16, 307.0, None, (64,),
           _s(_M5_PRO_MAX, _D4167, None, _M5_PRO_MAX)),
    _apple("apple-m5-pro-20", "Apple M5 Pro (20-core GPU)", 20, 307.0, None, (64,),
           _s(_M5_PRO_MAX, _M5_PRO_MAX, None, _M5_PRO_MAX)),
    _apple("apple-m5-max-40", "Apple M5 Max (40-core GPU)", 40, 614.0, None, (128,),
           _s(_M5_PRO_MAX, _M5_PRO_MAX, None, _M5_PRO_MAX)),
)


def _nv(name: str, chip: str, *, bw: float, src: str, mem: tuple[int, ...], mem_src: str | None = None,
        sms: int | None = None, fp16: float | None = None, int8: float | None = None, pcie: float | None = None,
        nvml: tuple[str, ...] = (), nvml_src: str | None = None, sm_src: str | None = None,
        compute_src: str | None = None, unified: bool = False, hopper: bool = False) -> dict[str, object]:
    """One NVIDIA profile; every figure given is sourced from ``src`` unless a field's own source is named."""
    spec: dict[str, object] = {"name": name, "chip": chip, "backend": "cuda", "unified": unified,
                               "memory_bandwidth_gbs": bw, "memory_gib": mem}
    sources = {"memory_bandwidth_gbs": src, "memory_gib": mem_src or src}
    for key, value, key_src in (("gpu_cores", sms, sm_src or src), ("fp16_tflops", fp16, compute_src or src),
                                ("int8_tops", int8, compute_src or src), ("pcie_gbs", pcie, src)):
        if value is not None:
            spec[key] = value
            sources[key] = key_src
    if hopper:
        spec["mma_sync_share"] = 0.5
        sources["mma_sync_share"] = _HOPPER_MMA
    if nvml:
        spec["nvml_names"] = nvml
        sources["nvml_names"] = nvml_src or _D15013
    spec["sources"] = sources
    return spec


_NVIDIA: tuple[dict[str, object], ...] = (
    # GeForce RTX 30 (Ampere)
    _nv("nvidia-rtx-3060", "NVIDIA GeForce RTX 3060 12 GB", bw=360.0, src=_GPUMAP, mem=(12,), sms=28, pcie=32.0,
        int8=101.0, compute_src=_RTX3060_TENSOR),
    _nv("nvidia-rtx-3070", "NVIDIA GeForce RTX 3070", bw=448.0, src=_GPUMAP, mem=(8,), sms=46, fp16=40.6, int8=163.0,
        pcie=32.0),
    _nv("nvidia-rtx-3080", "NVIDIA GeForce RTX 3080 10 GB", bw=760.0, src=_GPUMAP, mem=(10,), sms=68, fp16=59.5,
        int8=238.0, pcie=32.0),
    _nv("nvidia-rtx-3090", "NVIDIA GeForce RTX 3090", bw=936.0, src=_CYBIRD, mem=(24,),
        nvml=("NVIDIA GeForce RTX 3090",)),
    _nv("nvidia-rtx-3090-ti", "NVIDIA GeForce RTX 3090 Ti", bw=1008.0, src=_GPUMAP, mem=(24,), sms=84, fp16=80.0,
        int8=320.0, pcie=32.0, nvml=("NVIDIA GeForce RTX 3090 Ti",)),
    # GeForce RTX 40 (Ada Lovelace)
    _nv("nvidia-rtx-4060", "NVIDIA GeForce RTX 4060", bw=272.0, src=_CYBIRD, mem=(8,)),
    _nv("nvidia-rtx-4060-ti", "NVIDIA GeForce RTX 4060 Ti", bw=288.0, src=_CYBIRD, mem=(8, 16)),
    _nv("nvidia-rtx-4070", "NVIDIA GeForce RTX 4070", bw=504.0, src=_GPUMAP, mem=(12,), fp16=58.0, int8=233.0,
        pcie=32.0),
    _nv("nvidia-rtx-4070-ti", "NVIDIA GeForce RTX 4070 Ti", bw=504.0, src=_GPUMAP, mem=(12,), sms=60, fp16=80.0,
        int8=321.0, pcie=32.0),
    _nv("nvidia-rtx-4080", "NVIDIA GeForce RTX 4080", bw=717.0, src=_GPUMAP, mem=(16,), sms=76, fp16=97.0, int8=390.0,
        pcie=32.0, nvml=("NVIDIA GeForce RTX 4080",)),
    _nv("nvidia-rtx-4090", "NVIDIA GeForce RTX 4090", bw=1008.0, src=_GPUMAP, mem=(24,), sms=128, fp16=165.0,
        int8=661.0, pcie=32.0, nvml=("NVIDIA GeForce RTX 4090",), nvml_src=_PR4766),
    # GeForce RTX 50 (Blackwell)
    _nv("nvidia-rtx-5060-ti", "NVIDIA GeForce RTX 5060 Ti", bw=448.0, src=_CYBIRD, mem=(8, 16)),
    _nv("nvidia-rtx-5070", "NVIDIA GeForce RTX 5070", bw=672.0, src=_GPUMAP, mem=(12,), sms=48, fp16=62.0, int8=247.0,
        pcie=64.0, nvml=("NVIDIA GeForce RTX 5070",)),
    _nv("nvidia-rtx-5070-ti", "NVIDIA GeForce RTX 5070 Ti", bw=896.0, src=_GPUMAP, mem=(16,), sms=70, fp16=88.0,
        int8=352.0, pcie=64.0, nvml=("NVIDIA GeForce RTX 5070 Ti",)),
    _nv("nvidia-rtx-5080", "NVIDIA GeForce RTX 5080", bw=960.0, src=_GPUMAP, mem=(16,), sms=84, fp16=113.0,
        int8=450.0, pcie=64.0, nvml=("NVIDIA GeForce RTX 5080",)),
    _nv("nvidia-rtx-5090", "NVIDIA GeForce RTX 5090", bw=1792.0, src=_GPUMAP, mem=(32,), sms=170, fp16=210.0,
        int8=838.0, pcie=64.0, nvml=("NVIDIA GeForce RTX 5090",)),
    # workstation
    _nv("nvidia-rtx-a6000", "NVIDIA RTX A6000", bw=768.0, src=_GPUMAP, mem=(48,), sms=84, fp16=155.0, int8=310.0,
        pcie=32.0, nvml=("NVIDIA RTX A6000",)),
    _nv("nvidia-rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", bw=960.0, src=_GPUMAP, mem=(48,), fp16=364.0,
        int8=728.0, pcie=32.0, nvml=("NVIDIA RTX 6000 Ada Generation",)),
    _nv("nvidia-rtx-pro-6000-blackwell", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", bw=1792.0, src=_PRO6000,
        mem=(96,), sms=188, sm_src=_PRO6000_SM),
    # data center
    _nv("nvidia-a100-40gb", "NVIDIA A100 40GB PCIe", bw=1555.0, src=_GPUMAP, mem=(40,), sms=108, fp16=312.0,
        int8=624.0, pcie=32.0),
    _nv("nvidia-a100-80gb", "NVIDIA A100 80GB PCIe", bw=1935.0, src=_GPUMAP, mem=(80,), sms=108, fp16=312.0,
        int8=624.0, pcie=32.0, nvml=("NVIDIA A100 80GB PCIe",), nvml_src=_XD_NB + "A100_PCIe_v3.ipynb"),
    _nv("nvidia-l40s", "NVIDIA L40S", bw=864.0, src=_GPUMAP, mem=(48,), fp16=366.0, int8=733.0, pcie=32.0,
        nvml=("NVIDIA L40S",), nvml_src=_XD_NB + "L40S_v3.ipynb"),
    _nv("nvidia-h100-sxm", "NVIDIA H100 SXM5 80GB", bw=3352.0, src=_GPUMAP, mem=(80,), sms=132, fp16=989.0,
        int8=1979.0, pcie=64.0, hopper=True),
    _nv("nvidia-h100-pcie", "NVIDIA H100 PCIe 80GB", bw=2048.0, src=_GPUMAP, mem=(80,), sms=114, fp16=756.0,
        int8=1513.0, pcie=64.0, nvml=("NVIDIA H100 PCIe",), nvml_src=_XD_NB + "H100_PCIe_v3.ipynb", hopper=True),
    _nv("nvidia-h200", "NVIDIA H200 SXM5 141GB", bw=4800.0, src=_GPUMAP, mem=(141,), sms=132, fp16=989.0,
        int8=1979.0, pcie=64.0, nvml=("NVIDIA H200",), nvml_src=_H200_SMI, hopper=True),
    # unified
    _nv("nvidia-dgx-spark", "NVIDIA DGX Spark (GB10 Grace Blackwell)", bw=273.0, src=_SPARK, mem=(128,),
        fp16=62.0, int8=250.0, compute_src=_SPARK_TENSOR, nvml=("NVIDIA GB10",), nvml_src=_SPARK_BENCH, unified=True),
)

_CPU: dict[str, object] = {
    "name": "cpu", "chip": "this machine's CPU (host memory bandwidth measured at run time)", "backend": "cpu",
    "unified": True, "memory_bandwidth_gbs": None, "sources": {},
}

SPECS: tuple[dict[str, object], ...] = (*_APPLE, *_NVIDIA, _CPU)
