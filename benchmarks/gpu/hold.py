"""Hold an NVIDIA GPU's memory so that exactly FREE_BYTES stay free (to cudaMalloc's 2 MiB), then wait.

    python benchmarks/gpu/hold.py FREE_BYTES READY_FILE

Writes the free bytes it reached to READY_FILE and sleeps until terminated (emulating a smaller card
for benchmarks/gpu/measure.py's budget and study phases). Plain cudaMalloc through PyTorch with its
caching allocator off, so each piece is one allocation of exactly the size asked.
"""

import os
import sys
import time

os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
import torch  # noqa: E402

target, ready = int(sys.argv[1]), sys.argv[2]
held = []


def free() -> int:
    return torch.cuda.mem_get_info()[0]


for piece in (1 << 30, 64 << 20, 2 << 20):
    while free() - target >= piece:
        held.append(torch.empty(piece, dtype=torch.uint8, device="cuda"))
with open(ready + ".tmp", "w") as f:
    f.write(str(free()))
os.replace(ready + ".tmp", ready)
while True:
    time.sleep(3600)
