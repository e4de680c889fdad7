"""The content key the cluster routes by: one key for a document's questions and for a
conversation's turns, another for another document (no Ray needed)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.helpers.models import CHAT_TEMPLATE, make_tokenizer, words
from triforce_core.kv.disk import chain_keys
from triforce_core.serving.routing import route_key, route_tokens

BLOCK = 64


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def key(tok, messages, model="m"):
    return route_key(model, tok, messages, BLOCK)


def test_chain_keys_hash_the_head_and_every_token_before_the_blocks_end():
    tokens = [5, 6, 7, 8, 9]
    keys = chain_keys("m", tokens, 2)
    h = hashlib.sha256(b"m")
    expected = []
    for j in range(2):
        h.update(torch.tensor(tokens[2 * j: 2 * j + 2], dtype=torch.int32).numpy().tobytes())
        expected.append(h.hexdigest())
    assert keys == expected  # the 5th token is in no whole block
    assert chain_keys("m", [5, 6, 7, 0], 2)[0] == keys[0] != chain_keys("n", tokens, 2)[0]
    assert chain_keys("m", [5, 6, 7, 0], 2)[1] != keys[1]


def test_every_question_about_a_long_document_has_the_documents_key(tok):
    doc = words(200, 1)  # longer than a block: the key is its first block
    a = [{"role": "user", "content": doc + "\n\n" + words(5, 2)}]
    b = [{"role": "user", "content": doc + "\n\n" + words(7, 3)}]
    assert key(tok, a) == key(tok, b)
    assert len(route_tokens(tok, a, BLOCK)) == BLOCK
    other = [{"role": "user", "content": words(200, 4) + "\n\n" + words(5, 2)}]
    assert key(tok, other) != key(tok, a)
    assert key(tok, a, model="another") != key(tok, a)  # a model's caches are its own


def test_every_turn_of_a_conversation_has_one_key(tok):
    short = [{"role": "system", "content": words(4, 5)}, {"role": "user", "content": words(10, 6)}]
    turn2 = short + [{"role": "assistant", "content": words(8, 7)}, {"role": "user", "content": words(5, 8)}]
    turn3 = turn2 + [{"role": "assistant", "content": words(8, 9)}, {"role": "user", "content": words(5, 10)}]
    assert key(tok, short) == key(tok, turn2) == key(tok, turn3)
    # a short first message is a conversation of its own: another question, another key
    assert key(tok, [short[0], {"role": "user", "content": words(10, 11)}]) != key(tok, short)
    # the route tokens are the beginning of every turn's prompt, as the replica's cache holds it
    from triforce_core.prompting import render_prompt

    head = route_tokens(tok, turn3, BLOCK)
    assert render_prompt(tok, turn3)[1][: len(head)] == head
