"""llama.cpp's side of the prediction: a model's hparams, its memory (KV cache, recurrent state), its
weights' placement, the graph builders (src/llama-graph.cpp, src/models/*.cpp) and the context that
reserves the compute buffers (src/llama-context.cpp)."""
