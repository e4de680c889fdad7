"""The incremental detokenizer shared by the engine, the command line and the app."""

from __future__ import annotations

import contextlib
import io

from transformers import AutoTokenizer

from triforce_core.detokenize import IncrementalDetokenizer
from triforce_core.decoding.events import Committed
from triforce_core.models.loading import DEMO_TARGET

TEXT = ("Naïve café — «quoted» 東京 and 🙂 emoji.\n\tdef f(x):\n        return x ** 2  # ünïcödé\n" * 6)


def _tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


def test_pieces_add_up_to_the_whole_decode_whatever_the_chunking():
    tok = _tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    for step in (1, 2, 3, 7, 40):
        d = IncrementalDetokenizer(tok.decode, window=16)
        pieces = []
        for i in range(0, len(ids), step):
            pieces += d.push(ids[i : i + step])
        assert len(pieces) == len(ids)
        assert "".join(pieces) == full, step
        assert "\ufffd" not in "".join(pieces)


def _counting(tok) -> tuple:
    """The tokenizer's decode, and the list of the lengths it is called with."""
    lengths: list[int] = []

    def decode(seq):
        lengths.append(len(seq))
        return tok.decode(seq)

    return decode, lengths


def test_cost_per_token_does_not_grow_with_the_answer():
    tok = _tokenizer()
    ids = tok.encode(TEXT * 4, add_special_tokens=False)
    decode, lengths = _counting(tok)
    d = IncrementalDetokenizer(decode, window=32)
    d.push(ids)
    assert len(ids) > 500 and max(lengths) == 33  # the window and the new token, never the whole answer


def test_terminal_output_colours_each_token_by_its_level():
    from triforce_core.cli.output import LEVEL_COLOURS, write_tokens

    tok = _tokenizer()
    ids = tok.encode("Hello there, general", add_special_tokens=False)
    levels = (["lookup", "retrieval", "target"] * len(ids))[: len(ids)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        write_tokens(Committed(tuple(ids), tuple(levels), tok.decode(ids)), IncrementalDetokenizer(tok.decode))
    text = out.getvalue()
    for level in set(levels):
        assert LEVEL_COLOURS[level] in text
    plain = text
    for code in (*LEVEL_COLOURS.values(), "\x1b[0m"):
        plain = plain.replace(code, "")
    assert plain == tok.decode(ids)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        write_tokens(Committed(tuple(ids), tuple(levels), tok.decode(ids)), None)
    assert out.getvalue() == tok.decode(ids)  # no terminal: plain text


def test_a_rounds_text_at_once_equals_its_tokens_texts():
    """push_text (the engine's Committed.text: two decodes a round) gives what push gives."""
    tok = _tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    for step in (1, 3, 8, 33):
        whole, per_token = IncrementalDetokenizer(tok.decode, window=16), IncrementalDetokenizer(tok.decode, window=16)
        texts = []
        for i in range(0, len(ids), step):
            part = ids[i : i + step]
            texts.append(whole.push_text(part))
            assert texts[-1] == "".join(per_token.push(part)), (step, i)
        assert "".join(texts) == tok.decode(ids)
    assert IncrementalDetokenizer(tok.decode).push_text([]) == ""


def test_a_round_decodes_once_over_a_bounded_context():
    """push_text keeps the text of the context it decoded last: a round decodes once (twice when
    its anchor moves, every half window), over at least one window and under one and a half."""
    tok = _tokenizer()
    ids = tok.encode(TEXT * 2, add_special_tokens=False)
    decode, lengths = _counting(tok)
    d, rounds = IncrementalDetokenizer(decode, window=32), 0
    for i in range(0, len(ids), 3):
        d.push_text(ids[i : i + 3])
        rounds += 1
    assert len(ids) > 200 and len(lengths) <= rounds + len(ids) // 16 + 1
    assert max(lengths) < 48 + 3
