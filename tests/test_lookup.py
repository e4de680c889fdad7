"""The context lookup's matching rule (`triforce_core.lookup`), as pure list operations."""

from __future__ import annotations

import pytest

from triforce_core.lookup import ContextIndex


def _index(tokens, **kw) -> ContextIndex:
    index = ContextIndex(**kw)
    index.reset(tokens)
    return index


def test_docstring_example():
    a, b, c, d, x, y, z = range(7)
    seq = [a, b, c, d, x, y, z, a, b, c]
    index = _index(seq, min_match=2)
    assert index.match(seq) == (3, 3)  # continuation starts at d; "a b c" matches, 3 tokens
    assert index.propose(seq, 9)[0] == [d, x, y, z, a, b, c, d, x]  # runs on into its own proposal


def test_no_match_no_proposal():
    index = _index([1, 2, 3, 4], min_match=2)
    assert index.propose([1, 2, 3, 4], 5) == ([], 0)
    assert index.propose([9], 5) == ([], 0)  # shorter than min_match


def test_longest_backward_match_wins_and_ties_go_to_the_most_recent():
    # "7 1 2" then 8; "1 2" then 9; query ends "7 1 2": the longer match (-> 8) wins although older.
    seq = [7, 1, 2, 8, 0, 1, 2, 9, 0, 7, 1, 2]
    index = _index(seq, min_match=2)
    assert index.propose(seq, 1)[0] == [8]
    # Two equally long matches: the most recent one.
    seq2 = [5, 1, 2, 8, 5, 1, 2, 9, 6, 1, 2]
    assert _index(seq2, min_match=2).propose(seq2, 1)[0] == [9]


def test_speculative_suffix_is_matched_against_committed_tokens_only():
    committed = [1, 2, 3, 4, 5]
    index = _index(committed, min_match=2)
    # The query ends with speculative tokens 1 2 (not indexed): lookup continues from "1 2" -> 3.
    assert index.propose(committed + [1, 2], 3)[0] == [3, 4, 5]


def test_extend_indexes_new_tokens_incrementally_like_a_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7]
    grown = ContextIndex(min_match=2)
    for i in range(0, len(seq), 4):
        grown.extend(seq[i : i + 4])
    fresh = _index(seq, min_match=2)
    for end in range(2, len(seq) + 1):
        q = seq[:end]
        assert grown.match(q) == fresh.match(q)  # same index whatever the growth steps
    assert grown.tokens == seq


def test_min_match_must_be_positive():
    with pytest.raises(ValueError, match="min_match"):
        ContextIndex(min_match=0)
