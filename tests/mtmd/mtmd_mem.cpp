/* ggfit test oracle: load an mmproj with the pinned libmtmd (mtmd_init_from_file, no text model, warmup on) and
   print every backend buffer it allocates ("ggfit-alloc: BUFT BYTES"): the weight buffer of
   clip_model_loader::load_tensors, then the compute buffers of its warmup reserve; with a 4th argument N, then
   encode one N x N image (mtmd_debug_encode_image -> clip_image_encode), which grows them when N is larger than the
   warmup image. Built by tests/mtmd/oracle.py and benchmarks/gpu/mmproj.sh. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include "ggml-backend.h"
#include "mtmd.h"

void mtmd_debug_encode_image(mtmd_context * ctx, const std::vector<std::vector<float>> & image);  // mtmd.cpp

ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    static ggml_backend_buffer_t (*real)(ggml_backend_buffer_type_t, size_t) = NULL;
    if (!real) real = (ggml_backend_buffer_t (*)(ggml_backend_buffer_type_t, size_t))dlsym(RTLD_NEXT, "ggml_backend_buft_alloc_buffer");
    fprintf(stderr, "ggfit-alloc: %s %zu\n", ggml_backend_buft_name(buft), size);
    return real(buft, size);
}

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MMPROJ FA(-1|0|1) USE_GPU(0|1) [ENCODE_SIZE]\n", argv[0]); return 2; }
    struct mtmd_context_params p = mtmd_context_params_default();
    p.flash_attn_type = (enum llama_flash_attn_type)atoi(argv[2]);
    p.use_gpu = atoi(argv[3]) != 0;
    p.n_threads = 2;
    p.warmup = true;
    p.print_timings = false;
    mtmd_context * ctx = mtmd_init_from_file(argv[1], NULL, p);
    if (!ctx) { fprintf(stderr, "ggfit-failed\n"); return 1; }
    if (argc > 4 && atoi(argv[4]) > 0) {
        const int n = atoi(argv[4]);
        std::vector<std::vector<float>> image(n, std::vector<float>((size_t) n * 3, 0.0f));  // n rows of RGB
        fprintf(stderr, "ggfit-encode: %d\n", n);
        mtmd_debug_encode_image(ctx, image);
    }
    fprintf(stderr, "ggfit-done\n");
    mtmd_free(ctx);
    return 0;
}
