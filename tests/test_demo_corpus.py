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


def test_growing_the_target_in_depth_keeps_its_function_and_the_new_layers_learn(tmp_path):
    """--init-layers: copied layers keep their weights, new layers start as the identity (the
    grown model's logits equal the checkpoint's), and a training step changes the new layers."""
    import torch
    from safetensors.torch import save_file

    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    torch.manual_seed(0)
    small = train_demo_models.make_model(tok, 32, 2, 2, 64, 500_000, 16384)
    save_file({k: v.contiguous() for k, v in small.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    grown = train_demo_models.make_model(tok, 32, 4, 2, 64, 500_000, 16384)
    result = grown.load_state_dict(train_demo_models.grow_layers(grown, state, [0, None, 1, None]), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    grown.tie_weights()
    assert torch.equal(grown.model.layers[2].mlp.up_proj.weight, small.model.layers[1].mlp.up_proj.weight)
    assert not grown.model.layers[1].self_attn.o_proj.weight.any()
    ids = torch.randint(5, len(tok), (1, 48))
    with torch.no_grad():
        assert torch.allclose(grown(ids).logits, small(ids).logits, atol=1e-5)
    opt = torch.optim.SGD(grown.parameters(), lr=0.1)
    grown(ids, labels=ids).loss.backward()
    opt.step()
    assert grown.model.layers[1].self_attn.o_proj.weight.any() and grown.model.layers[3].mlp.down_proj.weight.any()
    with pytest.raises(ValueError, match="names layers \\[2\\]"):
        train_demo_models.grow_layers(grown, state, [0, 1, 2, None])


@pytest.mark.parametrize("argv, message", [
    (["--init-layers", "0,new"], "needs --init"),
    (["--init", "x", "--target-shape", "3x32x2x64", "--init-layers", "0,new"], "expected 3 comma-separated"),
    (["--init", "x", "--target-shape", "2x32x2x64", "--init-layers", "0,fresh"], "a layer number or 'new'"),
    (["--new-layer-lr-scale", "10"], "needs --init-layers"),
    (["--ambiguous-weight", "0"], "expected a positive weight"),
    (["--attend-heads", "1.9", "--target-shape", "2x32x2x64"], "outside the target's 2 layers x 2 heads"),
    (["--attend-heads", "one"], "expected comma-separated layer.head entries"),
    (["--attend-heads", "1.0", "--attend-weight", "-1"], "expected a weight of 0 or more"),
])
def test_bad_init_layers_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_demo_models.main(argv)
    assert message in capsys.readouterr().err


def test_ambiguous_positions_are_where_the_last_tokens_have_another_continuation_earlier():
    #        document ........................ | answer
    ids = [9, 1, 2, 3, 4, 8, 1, 2, 3, 5, 8, 6, 7, 1, 2, 3, 4, 6, 7, 3]
    start = 13
    # 16: after 1 2 3 the document goes on with 4 and with 5 (ambiguous although 4 is right);
    # 17: after 2 3 4 the document has 8, the answer 6; 8 6 7, 6 7 1, 7 1 2, 3 4 6 and 4 6 7 do
    # not occur before the answer
    assert train_demo_models.ambiguous_positions(ids, start) == [16, 17]
    # with two tokens of context the same; 6 7 -> 3 at 19 is not flagged: 6 7 occurs only as
    # the document's last tokens, with no continuation before the answer
    assert train_demo_models.ambiguous_positions(ids, start, context=2) == [16, 17]
    assert train_demo_models.ambiguous_positions(ids[:13] + [8, 1, 2, 4], start, context=2) == [16]
    assert train_demo_models.ambiguous_positions(ids, len(ids)) == []


def test_ambiguous_answer_tokens_get_the_extra_weight_and_nothing_else_does():
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    texts = [_text(s) for s in range(6)]
    stream = np.asarray(tok("\n".join(texts))["input_ids"], dtype=np.int32)
    plain = train_demo_models.Batcher(tok, texts, stream, 5, copy_share=1.0, pose_share=0.0)
    heavy = train_demo_models.Batcher(tok, texts, stream, 5, copy_share=1.0, pose_share=0.0)
    heavy.ambiguous_weight = 6.0
    ids, _, base = plain.copy_example(1024)
    ids2, _, weighted = heavy.copy_example(1024)
    assert ids == ids2
    changed = [i for i, (a, b) in enumerate(zip(base, weighted)) if a != b]
    assert changed and all(base[i] == 1.0 and weighted[i] == 6.0 for i in changed)
    first = base.index(1.0)
    assert changed == [i for i in train_demo_models.ambiguous_positions(ids, first) if base[i] == 1.0]


def test_weighted_answer_tokens_stay_out_of_the_language_model_loss():
    """An answer token weighted above 1 counts only in the answer loss, with its weight; the
    language-model loss is the plain mean over the other tokens."""
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


def test_small_vocabulary_passages_recur_verbatim_and_only_long_suffixes_place_the_copy():
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    texts = [_text(s) for s in range(6)]
    stream = np.asarray(tok("\n".join(texts))["input_ids"], dtype=np.int32)
    b = train_demo_models.Batcher(tok, texts, stream, 3, copy_share=0.0, pose_share=0.0)
    for n in (64, 1024, 4096):
        ids, lm_w, ans = b.alphabet_example(n)
        assert len(ids) == len(lm_w) == len(ans) == n and ids[0] == tok.bos_token_id
        answered = [i for i, a in enumerate(ans) if a > 0]
        assert answered and set(ans) == {0.0, 1.0}
        # runs of answer tokens: one per 1,024-token segment
        runs = [[answered[0]]]
        for i in answered[1:]:
            (runs[-1].append(i) if i == runs[-1][-1] + 1 else runs.append([i]))
        assert len(runs) == max(1, n // 1024)
        for run in runs:
            start, end = run[0] - 6, run[-1] + 1
            piece = ids[start:end]
            # the run copies a passage that occurs earlier, verbatim
            earlier = [j for j in range(start - len(piece) + 1) if ids[j:j + len(piece)] == piece]
            assert earlier, "the recurring run must occur earlier in the window"
            # from at most 12 words of at most 3 tokens
            assert len(set(piece)) <= 36
    # in the first segment's run, the last token written often has another continuation
    # earlier (at word boundaries): copying on the last token alone goes astray there
    flagged = total = 0
    for _ in range(8):
        ids, _, ans = b.alphabet_example(1024)
        run = [i for i, a in enumerate(ans) if a > 0]
        total += len(run)
        flagged += len(set(run) & set(train_demo_models.ambiguous_positions(ids, run[0], context=1)))
    assert flagged >= total / 4


def test_alphabet_share_goes_into_the_mixture_and_bad_shares_are_refused(capsys):
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    texts = [_text(s) for s in range(6)]
    stream = np.asarray(tok("\n".join(texts))["input_ids"], dtype=np.int32)
    b = train_demo_models.Batcher(tok, texts, stream, 4, copy_share=0.0, pose_share=0.0)
    b.alphabet_share = 1.0
    _, _, _, ans = b.batch(2, 1024)
    assert (ans.sum(1) > 0).all()
    with pytest.raises(SystemExit):
        train_demo_models.main(["--copy-share", "0.8", "--alphabet-share", "0.3"])
    assert "--alphabet-share: expected a share between 0 and 1 - --copy-share" in capsys.readouterr().err


def test_an_alphabet_phase_trains_on_the_copies_only_and_ends_at_its_loss_threshold(tmp_path):
    """A copy-only phase on small-vocabulary passages: its steps count apart from the cosine
    schedule of the language phases, it moves the weights, and it ends early once its copy
    loss is below the threshold (here one no model misses, so after the 51 steps it needs to
    average)."""
    import torch

    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    texts = [_text(s) for s in range(6)]
    stream = np.asarray(tok("\n".join(texts))["input_ids"], dtype=np.int32)
    b = train_demo_models.Batcher(tok, texts, stream, 6, copy_share=0.0, pose_share=0.0)
    ids, pos, lm_w, ans = b.alphabet_batch(3, 128)
    assert ids.shape == pos.shape == lm_w.shape == ans.shape == (3, 128)
    assert (pos == torch.arange(128)).all() and (ans.sum(1) > 0).all()
    torch.manual_seed(0)
    model = train_demo_models.make_model(tok, 32, 1, 2, 64, 500_000, 16384)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    phases = [dict(name="alphabet", kind="alphabet", steps=80, batch=2, length=96, lr=1e-3, stop_below=1e9),
              dict(name="language", steps=2, batch=1, length=128, mixture=dict(copy_share=0.0))]
    report = train_demo_models.train_target(model, b, phases, peak_lr=1e-3, log_every=100, ckpt=tmp_path)
    assert [r["name"] for r in report] == ["alphabet", "language"]
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


def test_copy_sources_point_at_the_document_token_each_answer_token_copies():
    """Batcher.batch(sources=True): for every query t with a source s, the document token at
    s is the answer's next token, and the few tokens before it match what the answer wrote."""
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    docs = [_text(s, paragraphs=60) for s in range(4)]
    batcher = train_demo_models.Batcher(tok, docs, np.zeros(4096, dtype=np.int32), 11, copy_share=1.0,
                                        pose_share=0.0)
    batcher.hard_candidates, batcher.distractor_share = 4, 0.5
    ids, pos, lm_w, ans_w, src = batcher.batch(2, 2048, sources=True)
    assert src.shape == ids.shape
    for r in range(2):
        rows = (src[r] >= 0).nonzero().squeeze(-1).tolist()
        answer_tokens = int((ans_w[r] > 0).sum())
        assert 0.5 * answer_tokens < len(rows) < answer_tokens  # the repeated phrases are left out
        first_answer = int((ans_w[r] > 0).nonzero()[0])
        for t in rows:
            s = int(src[r, t])
            assert t + 1 >= first_answer and s < first_answer  # an answer token, a document token
            assert ids[r, s] == ids[r, t + 1]
            assert ids[r, s - 3:s].tolist() == ids[r, t - 2:t + 1].tolist()
    # windows that are not copy questions have no sources
    batcher.copy_share = 0.0
    *_, none = batcher.batch(2, 512, sources=True)
    assert (none == -1).all()


def test_attention_supervision_loss_is_one_minus_the_attention_on_the_source():
    torch = pytest.importorskip("torch")
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "models" / "target"))
    model = train_demo_models.make_model(tok, 32, 2, 2, 64, 500_000, 16384).eval()
    train_demo_models.capture_attention(model, {1})
    torch.manual_seed(0)
    ids = torch.randint(5, len(tok), (1, 40))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    src = torch.full((1, 40), -1)
    src[0, 30], src[0, 35] = 7, 20
    loss, mass = train_demo_models.attention_supervision_loss([(1, 0), (1, 1)], src)
    # the same numbers from the layer's own attention weights (eager attention)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    assert torch.allclose(out.logits, plain, atol=1e-5)  # capturing changes nothing computed
    att = out.attentions[1][0]
    expected = torch.stack([att[h, t, s] for h in (0, 1) for t, s in ((30, 7), (35, 20))]).mean()
    assert torch.allclose(mass, expected, atol=1e-5)
    assert torch.allclose(loss, 1 - expected, atol=1e-5)
    # nothing to supervise: zero, not an error
    zero, _ = train_demo_models.attention_supervision_loss([(1, 0)], torch.full((1, 40), -1))
    assert zero.item() == 0.0
