"""ggfit's fitter: GGUF header reader, model description, memory model, budget and solver.

Never imports `search` (search depends on fitter, not the reverse).
"""
