"""The command line: `python -m triforce_core` / `triforce`, one module per subcommand.

May import every wing below it (serving, documents, engine, decoding, kv, models); nothing
imports it but `triforce_core.__main__`.
"""
