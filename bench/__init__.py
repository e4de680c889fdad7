"""Benchmarks: our decoding modes against Hugging Face's, next to the memory-bandwidth limit.

Run from the repository root. The harness is part of the package: `triforce_core.cli.harness`
runs every mode in one process on one prompt (the engine of `python -m triforce_core bench`),
`triforce_core.cli.bench_report` sums the runs up and states the machine, and
`triforce_core.models.roofline` measures the bandwidth and the bytes per token. Here:
`bench.loading` loads the harness on the pair a script names,
`python -m bench.sweep` sweeps context length and retrieval settings and writes plots,
`python -m bench.profile_decode` profiles one mode's decoding, `python -m bench.chat` is the
document-chat workload.
"""
