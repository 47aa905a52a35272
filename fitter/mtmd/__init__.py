"""llama.cpp's multimodal projector (tools/mtmd): what an mmproj GGUF (`--mmproj FILE`) allocates.

hparams.py mirrors clip_model_loader::load_hparams (the projector type, the vision tower's sizes, the warmup
image), graph.py clip_graph's shared builders (build_vit, build_attn, build_ffn, ...), models/ one module per
graph builder of tools/mtmd/models/*.cpp, memory.py the buffers: the weights (clip_model_loader::load_tensors,
one buffer on the CLIP backend) and the compute buffer of the warmup graph (clip_model_loader::warmup ->
reserve_compute_meta -> ggml_backend_sched_reserve).
"""
