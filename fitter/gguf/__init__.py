"""GGUF files: the header reader, byte sources (local files, shards, HTTP ranges) and the format's constants.

Mirrors gguf-py (gguf/gguf_reader.py, gguf/constants.py) and the header part of ggml/src/gguf.cpp.
"""
