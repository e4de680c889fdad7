"""The content key a request is routed by, so that a document's requests reach the replica
holding its cache.

    key = route_key("triforce-demo", tokenizer, messages, block_tokens=1024)

A replica keeps a conversation's caches in memory (`SlotPool`, matched by token prefix) and
writes its document's prefill to the disk cache in blocks keyed by a chain hash of their tokens
(`triforce_core.kv.disk`). The route key is that same chain hash over the conversation's
beginning: the first block of its prompt, or, when the prompt's first exchange (the system
prompt and the first user message, where a document travels) is shorter than a block, that
exchange. So

- every question about one long document, in any conversation, has one key: the document's
  first block (what the disk cache keys that block by, but for the model's id standing in for
  its weights' fingerprint, which only a replica that loaded the weights knows);
- every turn of one conversation has one key, since a client resends the conversation whole
  and its beginning does not change;
- two different documents almost never share one, and consistent hashing spreads the keys
  over the replicas.

Only the tokenizer is needed, not the model: the ingress computes the key before any replica
is chosen.
"""

from __future__ import annotations

from ..kv.disk import chain_keys
from ..prompting import render_prompt


def route_tokens(tokenizer, messages: list[dict], block_tokens: int) -> list[int]:
    """The tokens a conversation is routed by: its rendered first exchange, at most one block."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    _, ids = render_prompt(tokenizer, messages[: first_user + 1])
    return list(ids[:block_tokens])


def route_key(model_id: str, tokenizer, messages: list[dict], block_tokens: int) -> str:
    """The content key of a conversation on a model (see the module docstring); hex SHA-256."""
    tokens = route_tokens(tokenizer, messages, block_tokens)
    if not tokens:  # a template that renders nothing: one key for the model
        return chain_keys(f"route/{model_id}", [0], 1)[0]
    return chain_keys(f"route/{model_id}", tokens, len(tokens))[0]
