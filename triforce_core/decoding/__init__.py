"""The decoding wing: the speculation loop and everything it calls each round.

Lanes (a model over a cache), proposers (lookup, the small draft, the retrieval level),
exact verification and sampling, the draft schedule, penalties, inspection, and the events
the loop yields. May import `kv`, `models` and the base modules (config, detokenize); never
the engine, documents, serving or the command line.
"""
