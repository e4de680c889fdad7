"""Benchmarks: our decoding modes against Hugging Face's, next to the memory-bandwidth limit.

`bench.harness` runs every mode in one process on one prompt (the engine of
`python -m triforce_core bench`); `bench.roofline` measures the bandwidth and the bytes per
token; `python bench/sweep.py` sweeps context length and retrieval settings and writes plots.
"""
