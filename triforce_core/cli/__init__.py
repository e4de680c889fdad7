"""The command line: `python -m triforce_core` / `triforce`, one module per subcommand (generate,
chat, ingest, serve, bench), each registering its own flags; `main` builds the parser and
dispatches. `flags` holds the flags they share, `output` what generate and chat stream, and
`harness` / `bench_report` the benchmark behind `bench` (also used by the scripts of bench/),
`startup` the garbage collector's pause over the entry points' imports and loads.

May import every wing below it (serving, documents, engine, decoding, kv, models); nothing in
the package imports it but `triforce_core.__main__`.
"""
