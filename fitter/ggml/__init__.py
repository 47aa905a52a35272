"""A miniature ggml: what llama.cpp's compute-buffer sizes depend on, in Python.

types.py (ggml type traits), tensor.py (ggml_tensor, ggml_context and the op constructors of ggml.c),
graph.py (ggml_cgraph), alloc.py (ggml-alloc.c), sched.py (ggml-backend.cpp's scheduler) and
backends/ (each backend's buffer type and op support: ggml-cpu, ggml-cuda, ggml-metal).
"""
