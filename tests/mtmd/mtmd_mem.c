/* ggfit test oracle: load an mmproj with the pinned libmtmd (mtmd_init_from_file, no text model, warmup on) and
   print every backend buffer it allocates ("ggfit-alloc: BUFT BYTES"): the weight buffer of
   clip_model_loader::load_tensors, then the compute buffers of its warmup reserve. Built by tests/mtmd/oracle.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml-backend.h"
#include "mtmd.h"

ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    static ggml_backend_buffer_t (*real)(ggml_backend_buffer_type_t, size_t) = NULL;
    if (!real) real = (ggml_backend_buffer_t (*)(ggml_backend_buffer_type_t, size_t))dlsym(RTLD_NEXT, "ggml_backend_buft_alloc_buffer");
    fprintf(stderr, "ggfit-alloc: %s %zu\n", ggml_backend_buft_name(buft), size);
    return real(buft, size);
}

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MMPROJ FA(-1|0|1) USE_GPU(0|1)\n", argv[0]); return 2; }
    struct mtmd_context_params p = mtmd_context_params_default();
    p.flash_attn_type = (enum llama_flash_attn_type)atoi(argv[2]);
    p.use_gpu = atoi(argv[3]) != 0;
    p.n_threads = 1;
    p.warmup = true;
    p.print_timings = false;
    mtmd_context * ctx = mtmd_init_from_file(argv[1], NULL, p);
    if (!ctx) { fprintf(stderr, "ggfit-failed\n"); return 1; }
    fprintf(stderr, "ggfit-done\n");
    mtmd_free(ctx);
    return 0;
}
