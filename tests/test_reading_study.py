"""bench.reading_study: whether the part holding a question's passage is read under each rule,
and the answers from a rule's reading, on a tiny model and a book of its vocabulary."""

from __future__ import annotations

import json
import random

import pytest

from bench import reading_study

CHAPTERS = [("Alpha", 7, 30), ("Beta", 30, 55), ("Gamma", 55, 80), ("Delta", 80, 97)]


def words(n: int, lo: int, hi: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(lo, hi)}" for _ in range(n))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    # each chapter's words from its own range of the word-level vocabulary, so a question's words
    # say where its passage is; the holding phrase is the chapter's title line
    (root / "book.md").write_text("".join(f"# {t}\n\n{words(300, lo, hi, lo)}\n\n" for t, lo, hi in CHAPTERS))
    questions = [{"question": words(4, lo, hi, 100 + lo), "holding": f"# {t}\n"} for t, lo, hi in CHAPTERS[1:]]
    spec = {"documents": [{"name": "tiny book", "path": "book.md", "questions": questions}]}
    (root / "q.json").write_text(json.dumps(spec))
    return root


def run(study, tiny_pair_dir, *extra):
    out = study / "report.json"
    code = reading_study.main(["--root", str(study), "--questions", str(study / "q.json"),
                               "--target", tiny_pair_dir["target"], "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_the_holding_part_is_read_and_each_rule_keeps_its_cap(study, tiny_pair_dir):
    report = run(study, tiny_pair_dir)
    assert report["summary"]["default"] == {"read": 3, "first": 3, "questions": 3,
                                            "tokens_median": report["summary"]["default"]["tokens_median"]}
    for q in report["documents"][0]["questions"]:
        rules = q["rules"]
        assert rules["best part only"]["parts"] == 1 and rules["best part only"]["read"]
        assert rules["best 2 parts"]["parts"] <= 2
        assert rules["default"]["parts"] >= rules["best 2 parts"]["parts"]
        assert rules["default"]["rank"] == 1 and q["holding"] in "".join(f"# {t}\n" for t, _lo, _hi in CHAPTERS)
        assert "answer" not in rules["default"]


def test_answers_come_from_the_rules_reading(study, tiny_pair_dir):
    report = run(study, tiny_pair_dir, "--answer", "best part only", "--max-new-tokens", "3")
    for q in report["documents"][0]["questions"]:
        a = q["rules"]["best part only"]["answer"]
        assert a["passage_read"] and len(a["sections_read"]) == 1 and isinstance(a["text"], str)
        assert 0 < a["prompt_tokens"] < 1024
        assert "answer" not in q["rules"]["default"]


def test_a_phrase_that_is_not_unique_or_an_unknown_rule_is_refused(study, tiny_pair_dir, tmp_path):
    spec = json.loads((study / "q.json").read_text())
    spec["documents"][0]["questions"][0]["holding"] = "\n\n"  # everywhere
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match="occurs .* times, not once"):
        reading_study.main(["--root", str(study), "--questions", str(bad), "--target", tiny_pair_dir["target"]])
    with pytest.raises(SystemExit) as e:
        reading_study.main(["--root", str(study), "--target", tiny_pair_dir["target"], "--answer", "no such rule"])
    assert e.value.code == 2
