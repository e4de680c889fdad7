"""A served model's tokenizer as JSON (`GET /v1/tokenizer/{model}`), and back.

    payload = tokenizer_payload(engine)          # the server's side
    tokenizer, eos_ids = tokenizer_from_payload(payload)   # a client's: no hub, no files

A client of a served engine (`python app.py --engine URL`) needs the model's tokenizer for more
than the answer's text: to count a document's tokens against the window, to map the retrieval
level's chunks (token positions) back to the document's characters, to read a book by its
sections, to name the tokens the inspector shows. Every tokenizer the engine loads, from a
Hugging Face folder or a GGUF file, is a `tokenizers` tokenizer underneath; its serialized form
(what `tokenizer.json` holds) with the chat template and the special tokens rebuilds the same
tokenizer anywhere, offline, whatever the model's files are.

What a server sends is untrusted: the payload's size is the reader's to bound; here its fields
are checked for type and size (a template of at most `MAX_TEMPLATE` characters, special tokens of
at most `MAX_SPECIAL`, at most 64 end-of-sequence ids, each an id of the vocabulary) and the
tokenizer is built only by the `tokenizers` library (no code named by the payload is imported);
a chat template is rendered by transformers' sandboxed Jinja (which bounds ranges, not time: a
server may send a template that renders slowly, as a model's files may hold one).
"""

from __future__ import annotations

import json
from typing import Any

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
MAX_TEMPLATE = 1 << 20  # characters of a chat template (the largest known are ~20K)
MAX_SPECIAL = 1000  # characters of a special token
MAX_EOS = 64


def tokenizer_payload(engine) -> dict:
    """`engine`'s tokenizer as a JSON-ready dict (ValueError when it has no serialized form)."""
    tok = engine.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("it is not a fast (tokenizers) tokenizer")
    template = tok.chat_template if isinstance(getattr(tok, "chat_template", None), str) else None
    return {
        "tokenizer": json.loads(backend.to_str()),
        "chat_template": template,
        "special_tokens": {name: str(getattr(tok, name)) for name in SPECIAL if getattr(tok, name, None) is not None},
        "clean_up_tokenization_spaces": bool(getattr(tok, "clean_up_tokenization_spaces", False)),
        "eos_token_ids": sorted(int(i) for i in engine.eos_token_ids),
    }


def tokenizer_from_payload(data: Any) -> tuple[Any, frozenset[int]]:
    """(tokenizer, end-of-sequence ids) from `tokenizer_payload`'s dict; ValueError (one line) for
    a payload that is not one."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(data, dict) or not isinstance(data.get("tokenizer"), dict):
        raise ValueError("the tokenizer payload has no tokenizer object")
    template = data.get("chat_template")
    special = data.get("special_tokens", {})
    eos = data.get("eos_token_ids")
    if template is not None and (not isinstance(template, str) or len(template) > MAX_TEMPLATE):
        raise ValueError(f"the tokenizer's chat_template is not a string of at most {MAX_TEMPLATE:,} characters")
    if (not isinstance(special, dict) or set(special) - set(SPECIAL)
            or not all(isinstance(v, str) and 0 < len(v) <= MAX_SPECIAL for v in special.values())):
        raise ValueError(f"the tokenizer's special_tokens must map {', '.join(SPECIAL)} to strings "
                         f"of at most {MAX_SPECIAL} characters")
    if (not isinstance(eos, list) or len(eos) > MAX_EOS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in eos)):
        raise ValueError(f"the tokenizer's eos_token_ids must be a list of at most {MAX_EOS} token ids")
    if not isinstance(data.get("clean_up_tokenization_spaces", False), bool):
        raise ValueError("the tokenizer's clean_up_tokenization_spaces must be true or false")
    try:
        backend = Tokenizer.from_str(json.dumps(data["tokenizer"]))
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                      clean_up_tokenization_spaces=bool(data.get("clean_up_tokenization_spaces")),
                                      **special)
    except Exception as e:  # noqa: BLE001 - the libraries' own parse errors, of any type
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"the tokenizer cannot be read: {reason}") from None
    if max(eos, default=-1) >= backend.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"the tokenizer's eos_token_ids hold {max(eos)}, beyond its vocabulary")
    return tok, frozenset(eos)
