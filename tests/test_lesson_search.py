"""The lesson's search (`bench.lesson_search`): which setting it picks from scored answers."""

from __future__ import annotations

from bench.lesson_search import pick


def _row(question: str, temperature: float, seed: int, fluent: bool) -> dict:
    return {"question": question, "temperature": temperature, "seed": seed, "repetition_penalty": 1.2,
            "fluent": fluent}


def test_the_pick_is_fluent_for_every_seed_at_the_lowest_temperature():
    rows = [_row("a", 0.3, 1, True), _row("a", 0.3, 2, False),  # one seed is not fluent: not picked
            _row("a", 0.6, 1, True), _row("a", 0.6, 2, True),
            _row("b", 0.3, 1, True), _row("b", 0.3, 2, True),  # every seed, the lowest temperature
            _row("c", 0.3, 1, True), _row("c", 0.3, 2, True)]
    assert pick(rows) == rows[4]
    assert pick(rows[:4]) == rows[2]  # only a hotter setting holds: that one
    assert pick(rows[:2]) is None
    marked = [_row("What does __init__ do?", 0.3, 1, True), _row("What does __init__ do?", 0.3, 2, True)]
    assert pick(marked + rows) == rows[4]  # the page's Markdown would turn its answer's __init__ bold
