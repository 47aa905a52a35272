"""The backends: each one's buffer types, alloc sizes and op support (ggml-cpu, ggml-cuda, ggml-metal)."""
