"""The context lookup's matching rule (`triforce_core.decoding.lookup`), as pure list operations."""

from __future__ import annotations

import pytest

from triforce_core.decoding.lookup import ContextIndex


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
    with pytest.raises(ValueError, match="rival_slack"):
        ContextIndex(rival_slack=-1)


def test_a_rival_occurrence_cuts_the_proposal_where_it_parts():
    # The docstring's picture: "p q r s" -> t . . ., and the rival "q r s" -> u (match 3 of 4).
    p, q, r, s, t, u, dot = range(7)
    seq = [p, q, r, s, t, dot, dot, dot, q, r, s, u, dot, dot, dot, p, q, r, s]
    assert _index(seq, min_match=3, rival_slack=None).propose(seq, 4) == ([t, dot, dot, dot], 4)
    assert _index(seq, min_match=3).propose(seq, 4) == ([t], 4)  # at least one token is kept
    # A rival that agrees for two tokens cuts after them.
    seq2 = [p, q, r, s, t, u, dot, 9, q, r, s, t, u, 8, 9, p, q, r, s]
    assert _index(seq2, min_match=3).propose(seq2, 5) == ([t, u], 4)


def test_a_rival_past_the_slack_does_not_cut():
    # The winner matches 6 tokens back, the rival only the 3 of min_match: 3 < 6 - 2.
    a, b, c, x, y, z = range(6)
    seq = [x, y, z, a, b, c, 10, 11, 12, 20, a, b, c, 13, 14, 21, x, y, z, a, b, c]
    index = _index(seq, min_match=3)
    assert index.propose(seq, 3) == ([10, 11, 12], 6)
    assert _index(seq, min_match=3, rival_slack=3).propose(seq, 3) == ([10], 6)


def test_rivals_compare_into_the_proposal_itself():
    # A loop "1 2 3 1 2 3": the rival continuation that runs past the sequence's end reads the
    # proposal, as the winner's own continuation does, so a repeating loop is not cut.
    seq = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert _index(seq, min_match=2).propose(seq, 7) == _index(seq, min_match=2, rival_slack=None).propose(seq, 7)
    assert _index(seq, min_match=2).propose(seq, 7)[0] == [1, 2, 3, 1, 2, 3, 1]


# -- the adaptive draft length ----------------------------------------------------------------
def test_draft_schedule_follows_acceptance():
    from triforce_core.decoding.schedule import DraftSchedule

    s = DraftSchedule(longest=6, adaptive=True)
    assert s.take() == 6
    s.update(6, 6)
    assert s.take() == 6  # taken whole, already at the longest
    s.update(6, 3)
    assert s.take() == 3  # shrinks to the accepted part
    s.update(3, 3)
    assert s.take() == 4  # grows by one after a draft taken whole
    s.update(4, 0)  # a miss: one plain step, then a one-token draft
    assert [s.take() for _ in range(2)] == [0, 1]
    s.update(1, 0)  # a second miss in a row: the pause doubles
    assert [s.take() for _ in range(3)] == [0, 0, 1]
    s.update(1, 0)
    assert [s.take() for _ in range(5)] == [0, 0, 0, 0, 1]
    s.update(1, 1)  # a hit resets the pause
    assert s.take() == 2
    s.update(2, 0)
    assert [s.take() for _ in range(2)] == [0, 1]
    s.update(0, 0)  # a plain step changes nothing
    assert s.take() == 1


def test_draft_schedule_pause_is_bounded_and_fixed_schedule_never_changes():
    from triforce_core.decoding.schedule import DraftSchedule

    s = DraftSchedule(longest=4, adaptive=True)
    for _ in range(10):
        s.take()
        s.update(1, 0)
        assert s.pause <= DraftSchedule.MAX_PAUSE
        while s.take() == 0:
            pass
    assert s.next_pause == DraftSchedule.MAX_PAUSE
    fixed = DraftSchedule(longest=4, adaptive=False)
    for proposed, accepted in [(4, 0), (4, 2), (4, 4)]:
        fixed.update(proposed, accepted)
        assert fixed.take() == 4


def test_backoff_proposes_one_token_where_every_shorter_occurrence_agrees():
    # No earlier "4 7" (min_match 2); "7" occurred twice, followed by 8 both times.
    seq = [1, 7, 8, 2, 7, 8, 3, 4, 7]
    assert _index(seq, min_match=2).propose(seq, 4) == ([], 0)  # off by default
    index = _index(seq, min_match=2, backoff=True)
    assert index.propose(seq, 4) == ([8], 1)  # one token; the match length says it is a backoff
    assert index.propose(seq, 0) == ([], 0)
    # The followers disagree: nothing.
    seq2 = [1, 7, 8, 2, 7, 9, 3, 4, 7]
    assert _index(seq2, min_match=2, backoff=True).propose(seq2, 4) == ([], 0)
    # A full match is preferred to the backoff, and grown indexes back off like fresh ones.
    seq3 = [4, 7, 5, 7, 8, 4, 7]
    assert _index(seq3, min_match=2, backoff=True).propose(seq3, 1) == ([5], 2)
    grown = ContextIndex(min_match=2, backoff=True)
    for i in range(0, len(seq), 2):
        grown.extend(seq[i : i + 2])
    assert grown.propose(seq, 4) == ([8], 1)
    assert ContextIndex(min_match=1, backoff=True).backoff is False  # nothing shorter to back off to
