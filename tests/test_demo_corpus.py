"""The synthetic copy tasks the demo target trains on (scripts/demo_corpus.py, scripts/train_demo_models.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from scripts import demo_corpus, train_demo_models

ROOT = Path(__file__).resolve().parents[1]

# Prose in which short word sequences recur with different continuations, as in real
# documentation ("the value of", "is returned"), and unique longer phrases.
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau upsilon "
         "phi chi psi omega value returned object method class module").split()


def _text(seed: int, paragraphs: int = 40) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        lines = []
        for _ in range(rng.randint(2, 4)):
            body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
            lines.append(body + (" is returned." if rng.random() < 0.4 else "."))
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def test_ambiguity_counts_places_whose_last_characters_recur():
    text = "one two three four five six seven\nand then two three eight\n"
    quote, cont = "one two three", " four five six seven"
    # right after the quote ("wo three") and before "four" ("o three "), the last 8 characters
    # recur in "two three eight"; before "five", "six" and "seven" they do not
    assert demo_corpus.ambiguity(text, quote, cont) == 2
    unique = "aaaa bbbb cccc dddd eeee ffff\nggg hhh\n"
    assert demo_corpus.ambiguity(unique, "aaaa bbbb", " cccc dddd eeee ffff") == 0


def test_hard_pick_with_one_candidate_is_the_plain_pick_and_more_candidates_pick_harder():
    text = _text(0)
    assert demo_corpus.pick_hard_passage(text, random.Random(3), 1) == demo_corpus.pick_passage(text, random.Random(3))
    plain, hard = [], []
    rng_plain, rng_hard = random.Random(1), random.Random(1)
    for _ in range(60):
        plain.append(demo_corpus.ambiguity(text, *demo_corpus.pick_passage(text, rng_plain)))
        hard.append(demo_corpus.ambiguity(text, *demo_corpus.pick_hard_passage(text, rng_hard, 6)))
    assert np.mean(hard) > np.mean(plain) + 1


def test_distractors_plant_the_phrase_tail_elsewhere_and_keep_every_passage_exact():
    text = _text(2)
    rng = random.Random(5)
    picks = [demo_corpus.pick_passage(text, rng) for _ in range(6)]
    decoyed = demo_corpus.insert_distractors(text, picks, random.Random(6), share=1.0)
    assert len(decoyed) > len(text)
    planted = 0
    for quote, cont in picks:
        assert decoyed.count(quote) == 1
        assert decoyed.count(quote + cont) == 1  # the passage asked for is untouched
        tails = [quote[s:] for s in demo_corpus.word_spans(quote)[-4:]]
        planted += any(decoyed.count(t) > text.count(t) for t in tails)
    assert planted >= 4
    # share 0 leaves the document as it was
    assert demo_corpus.insert_distractors(text, picks, random.Random(6), share=0.0) == text


def test_copy_conversations_with_hard_passages_and_decoys_quote_the_document_exactly():
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    docs = [_text(s, paragraphs=60) for s in range(4)]
    batcher = train_demo_models.Batcher(tok, docs, np.zeros(64, dtype=np.int32), 9, copy_share=1.0, pose_share=0.0)
    batcher.hard_candidates, batcher.distractor_share = 4, 0.5
    for _ in range(3):
        ids, lm_w, ans_w = batcher.copy_example(2048)
        assert len(ids) == len(lm_w) == len(ans_w) == 2048
        text = tok.decode([t for t, w in zip(ids, lm_w) if w])
        first_turn = text.split("<|user|>\n", 1)[1].split("<|end|>", 1)[0]
        document = first_turn.rsplit("\n\n", 1)[0]  # then the question (a quote never spans a blank line)
        answers = [part.split("<|end|>", 1)[0] for part in text.split("<|assistant|>\n")[1:]]
        assert answers
        for answer in answers:
            assert answer in document  # phrase + continuation, verbatim from the document
        # the answer tokens carry the copy loss
        assert sum(ans_w) >= sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers)


def test_training_with_yarn_uses_the_rope_scaling_the_target_is_saved_with(tmp_path):
    """--train-with-yarn: the model trained is scaled exactly as set_yarn writes the shipped config."""
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    plain = train_demo_models.make_model(tok, 32, 1, 2, 64, 500_000, 16384)
    scaled = train_demo_models.make_model(tok, 32, 1, 2, 64, 500_000, 16384, yarn=2.0)
    assert plain.config.rope_parameters["rope_type"] == "default"
    plain.save_pretrained(tmp_path)
    train_demo_models.set_yarn(tmp_path, 2.0)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert {k: scaled.config.rope_parameters[k] for k in written} == written
    assert written["original_max_position_embeddings"] == 8192
    # the scaling reaches the rotary embedding: stretched slow frequencies, sharpened logits
    rot_plain, rot_scaled = plain.model.rotary_emb, scaled.model.rotary_emb
    assert rot_scaled.attention_scaling > 1.0
    assert rot_plain.attention_scaling == 1.0
    assert (rot_scaled.inv_freq[-1] < rot_plain.inv_freq[-1]) and (rot_scaled.inv_freq[0] == rot_plain.inv_freq[0])


def test_answer_tokens_stay_out_of_the_language_model_loss():
    """An answer token counts only in the answer loss, with its weight; the language-model
    loss is the plain mean over the other tokens."""
    import torch

    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    ids = torch.randint(0, 11, (1, 6))
    nll = -torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    lm_w = torch.ones(1, 6)
    ans_w = torch.tensor([[0.0, 0.0, 0.0, 1.0, 5.0, 1.0]])
    lm, ans, n = train_demo_models.lm_losses(logits, ids, lm_w, ans_w)
    assert torch.allclose(lm, nll[:2].mean())
    assert torch.allclose(ans, (nll[2] + 5 * nll[3] + nll[4]) / 7)
    assert n == 7


@pytest.mark.parametrize("argv, message", [
    (["--target-shape", "4x256"], "--target-shape: expected LAYERSxHIDDENxHEADSxMLP"),
    (["--long-shape", "1x32768"], "window lengths are at most --max-position (16384)"),
    (["--max-position", "512"], "--max-position: expected 1024"),
    (["--train-with-yarn"], "needs --yarn-factor above 1"),
    (["--yarn-factor", "2", "--train-with-yarn", "--draft-only", "x"], "not with --draft-only"),
    (["--hard-candidates", "0"], "expected at least 1"),
    (["--copy-share", "1.5"], "--copy-share: expected a share between 0 and 1"),
    (["--distractor-share", "-0.1"], "--distractor-share: expected a share between 0 and 1"),
    (["--peak-lr", "0"], "expected a positive learning rate"),
])
def test_bad_flags_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_demo_models.main(argv)
    assert message in capsys.readouterr().err


def test_the_phases_follow_the_flags():
    """A fine-tuning invocation (as in the model card): no induction phase, the copy share and
    the hard questions in both mixtures, the recurring windows filling what copying leaves."""
    a = train_demo_models.parse_args(["--induction-steps", "0", "--language-shape", "1x4096", "--copy-share", "0.7",
                                      "--hard-candidates", "6", "--distractor-share", "0.3",
                                      "--long-shape", "1x8192", "--long-steps", "80"])
    phases = train_demo_models.target_phases(a)
    assert [(ph["name"], ph["batch"], ph["length"], ph["steps"]) for ph in phases] == [
        ("language", 1, 4096, 500), ("long", 1, 8192, 80)]
    language, long = phases[0]["mixture"], phases[1]["mixture"]
    assert language["copy_share"] == 0.7 and language["repeat_share"] + language["random_share"] == pytest.approx(0.3)
    assert long["copy_share"] == 0.5
    assert all(m["hard_candidates"] == 6 and m["distractor_share"] == 0.3 for m in (language, long))
    # the defaults: induction first, then language and long windows
    assert [ph["name"] for ph in train_demo_models.target_phases(train_demo_models.parse_args([]))] == [
        "induction", "language", "long"]


def test_the_induction_phase_ends_at_its_loss_threshold_and_the_language_phase_follows(tmp_path):
    """The induction phase counts apart from the cosine schedule of the language phases, moves
    the weights, and ends early once its copy loss is below the threshold (here one no model
    misses, so after the 51 steps it needs to average)."""
    import torch

    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    texts = [_text(s) for s in range(6)]
    stream = np.asarray(tok("\n".join(texts))["input_ids"], dtype=np.int32)
    batcher = train_demo_models.Batcher(tok, texts, stream, 6, copy_share=0.0, pose_share=0.0)
    torch.manual_seed(0)
    model = train_demo_models.make_model(tok, 32, 1, 2, 64, 500_000, 16384)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    phases = [dict(name="induction", kind="induction", steps=80, batch=2, length=48, lr=1e-3, stop_below=1e9),
              dict(name="language", steps=2, batch=1, length=128, mixture=dict(copy_share=0.0))]
    report = train_demo_models.train_target(model, batcher, phases, peak_lr=1e-3, log_every=100, ckpt=tmp_path)
    assert [r["name"] for r in report] == ["induction", "language"]
    assert report[0]["steps"] == 51 and report[0]["final_lm_loss"] is None
    assert report[1]["steps"] == 2 and report[1]["final_lm_loss"] is not None
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_a_saved_corpus_loads_back_exactly_and_a_bad_file_is_refused_clearly(tmp_path):
    train = [demo_corpus.Document("library/a", "Ünïcode «text»\nwith lines\n"), demo_corpus.Document("stdlib/b", "x")]
    held = [demo_corpus.Document("tutorial/c", "held out\n")]
    path = tmp_path / "corpus.jsonl.gz"
    demo_corpus.save_corpus(path, train, held)
    assert demo_corpus.load_corpus(path) == (train, held)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_text("not gzip")
    with pytest.raises(SystemExit, match="not a corpus file written by --export-corpus"):
        demo_corpus.load_corpus(bad)
    demo_corpus.save_corpus(bad, [], held)
    with pytest.raises(SystemExit, match="holds no training documents"):
        demo_corpus.load_corpus(bad)
