"""An answer ends where its text reaches a stop text (`decoding.stop_text`): a model without a
chat template answers in the plain layout and is cut before the next "\\nQuestion:" it writes
itself (`prompting.answer_stops`), with the tokens kept exactly those the same generation gives
without the stop.

- `StopText` on token streams (a decode of our own): the stop inside a round, across rounds,
  inside one token, at the very start; `cut_text`.
- A tiny Llama saved without a chat template whose greedy answer is " Yes\\nQuestion: Why...":
  a chat session's answer is " Yes", in every mode, its tokens a prefix of the answer without
  the stop (which does hold "\\nQuestion:": the negative control); the next turn goes on.
- Any stop text, every mode, a random model: the tokens are a prefix of those without the stop.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import CHAT_TEMPLATE, make_hf, make_tokenizer, perturbed, plain_layout_checkpoint, to_ours, words
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.decoding.events import Committed, Finished
from triforce_core.decoding.stop_text import StopText, cut_text
from triforce_core.engine import TriForceEngine
from triforce_core.prompting import PLAIN_STOPS, answer_stops, render_prompt
from triforce_core.serving.session import ChatSession
from triforce_core.serving.slots import Slot

PIECES = [" Yes", ".", "\n", "Question", ":", " Why", ".\n", "\nQuestion:", "\nQues", "tion:", " a"]
STOP = "\nQuestion:"


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def ids_of(*pieces):
    return [PIECES.index(p) for p in pieces]


def test_a_stop_inside_a_round_keeps_the_tokens_before_it():
    stop = StopText([STOP], decode)
    assert stop.push(ids_of(" Yes", ".")) is None and stop.cut is None  # no stop yet: all kept
    assert stop.push(ids_of(" a", "\n", "Question", ":", " Why")) == 1  # " a" kept, "\n" on dropped
    assert stop.cut == len(" Yes. a") and stop.ids == ids_of(" Yes", ".", " a")
    assert stop.push(ids_of(" a")) == 0  # once stopped, nothing more


def test_a_stop_across_rounds_and_inside_one_token():
    stop = StopText([STOP], decode)
    assert stop.push(ids_of(" Yes", "\n")) is None  # "\n" alone may begin anything
    assert stop.push(ids_of("Question", ":", " a")) == 0  # the stop began in the last round
    assert stop.cut == len(" Yes")
    # a token holding the answer's last characters and the stop's first is kept (its text is cut)
    stop = StopText([STOP], decode)
    assert stop.push(ids_of(" Yes", ".\n", "Question", ":")) == 2 and stop.cut == len(" Yes.")
    # the whole stop in one token, split across two tokens, or the answer's very start
    assert StopText([STOP], decode).push(ids_of(" Yes", "\nQuestion:", " Why")) == 1
    assert StopText([STOP], decode).push(ids_of(" Yes", "\nQues", "tion:")) == 1
    assert StopText([STOP], decode).push(ids_of("\nQuestion:", " Why")) == 0
    # a continued answer: the stop may begin in its first part
    stop = StopText([STOP], decode, ids_of(" Yes", "\n"))
    assert stop.push(ids_of("Question", ":")) == 0 and stop.cut == len(" Yes")
    # negative control: text that only looks like it does not stop
    assert StopText([STOP], decode).push(ids_of(" Yes", "\n", "Question", " Why", "\n", ":")) is None


def test_cut_text():
    assert cut_text(" Yes.\n\nQuestion: why", PLAIN_STOPS, stopped=True) == " Yes."
    assert cut_text(" Yes\n", PLAIN_STOPS, stopped=True) == " Yes"  # the stop's first character, then the end
    assert cut_text(" Yes\nQues", PLAIN_STOPS, stopped=True) == " Yes"
    assert cut_text(" Yes\n", PLAIN_STOPS, stopped=False) == " Yes\n"  # not stopped there: as it is
    assert cut_text(" Yes. Question: no", PLAIN_STOPS, stopped=True) == " Yes. Question: no"
    with pytest.raises(ValueError):
        StopText([""], decode)


def test_only_the_plain_layout_has_a_stop():
    tok = make_tokenizer()
    assert answer_stops(tok) == PLAIN_STOPS == ("\nQuestion:",)
    assert render_prompt(tok, [{"role": "user", "content": "w7"}])[0] == "Question: w7\nAnswer:"
    tok.chat_template = CHAT_TEMPLATE
    assert answer_stops(tok) == ()


@pytest.fixture(scope="module")
def plain_engine(tmp_path_factory):
    """The tiny base model (no chat template) whose greedy answer writes the next question; its
    own folder as the draft, so that the draft's modes commit several tokens a round."""
    torch.set_num_threads(1)
    path = plain_layout_checkpoint(tmp_path_factory.mktemp("plain") / "model")
    return TriForceEngine.from_pretrained(path, path, device="cpu")


def plain_config(mode: str, max_new: int = 16) -> GenerationConfig:
    return GenerationConfig(
        speculation=SpeculationConfig(mode=mode, max_new_tokens=max_new, gamma1=2, gamma2=4),
        cache=CacheConfig(budget=16, chunk_size=4, draft_window=16, draft_sinks=4, refresh_every=16))


DOC, QUESTION = "The cat sat on a mat.", "What did the cat do?"


@pytest.mark.parametrize("mode", ["autoregressive", "lookup", "draft", "triforce"])
def test_a_base_model_answers_up_to_its_next_question(plain_engine, mode):
    engine, config = plain_engine, plain_config(mode)
    assert not engine.tokenizer.chat_template
    session = ChatSession(engine, DOC, config=config)
    prompt = session.prompt_ids(QUESTION)
    free = engine.run(prompt, config)  # the same generation without the stop
    assert STOP in free.text and free.text.startswith(" Yes\nQuestion: Why")  # the negative control
    events = list(session.ask(QUESTION))
    turn = session.turns[-1]
    assert turn.answer == " Yes" and turn.stats.stop_reason == "stop_text"
    assert list(free.token_ids[: len(turn.token_ids)]) == list(turn.token_ids)  # exact: a prefix
    assert len(turn.token_ids) < len(free.token_ids)
    said = "".join(e.text for e in events if isinstance(e, Committed))
    assert "Question" not in said and said.rstrip() == " Yes"
    finished = [e for e in events if isinstance(e, Finished)]
    assert len(finished) == 1 and finished[0].stats.new_tokens == len(turn.token_ids)
    # the next turn: the conversation in the plain layout, the earlier answer as cut
    list(session.ask(QUESTION))
    assert session.turns[-1].answer == " Yes" and "Answer: Yes\n\nQuestion: " + QUESTION in session.prompt_text(QUESTION)
    # the earlier answer is laid out as the model wrote it: the conversation's tokens begin with
    # the first prompt and the tokens the model committed, which the caches hold
    first = list(session.turns[0].token_ids)
    assert session.prompt_ids(QUESTION)[: len(prompt) + len(first)] == prompt + first
    assert session.turns[-1].stats.reused_tokens >= len(prompt) + len(first) - 1  # the last one is pending


@pytest.fixture(scope="module")
def random_engine():
    """A random target and a perturbed draft, the word-level tokenizer without a chat template."""
    torch.set_num_threads(1)
    hf = make_hf("llama_gqa_llama3", seed=0)
    return TriForceEngine(to_ours(hf), to_ours(perturbed(hf, 0.02)), make_tokenizer(), eos_token_ids=[2])


@pytest.mark.parametrize("mode", ["autoregressive", "lookup", "draft", "retrieval", "triforce"])
def test_any_stop_text_keeps_the_tokens_of_the_answer_without_it(random_engine, mode):
    engine = random_engine
    config = GenerationConfig(
        speculation=SpeculationConfig(mode=mode, max_new_tokens=24, ignore_eos=True, gamma1=2, gamma2=4),
        cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, refresh_every=16))
    prompt = engine.tokenizer(words(200, 5))["input_ids"]
    free = engine.run(prompt, config)
    stop = " " + engine.detokenize(free.token_ids[12:14])  # two words from the answer's middle
    cut = free.text.find(stop)
    assert 0 < cut < len(free.text) - len(stop)
    ids, text, stats = [], "", None
    for ev in Slot(engine).generate(prompt, config, stops=(stop,)):
        if isinstance(ev, Committed):
            ids += ev.token_ids
            text += ev.text
        elif isinstance(ev, Finished):
            stats = ev.stats
    assert stats.stop_reason == "stop_text" and stats.new_tokens == len(ids)
    assert ids == list(free.token_ids[: len(ids)]) and len(ids) < len(free.token_ids)
    # the text is the answer's up to the stop, then at most the stop's first words (committed in
    # rounds before the rest of it was seen), which `cut_text` takes off
    said = engine.detokenize(ids)
    assert text == said and said.startswith(free.text[:cut]) and stop.startswith(said[cut:])
    assert cut_text(said, (stop,), stopped=True) == free.text[:cut].rstrip()


def test_the_app_and_the_chat_command_say_a_base_model_has_no_chat_template(plain_engine, tmp_path):
    import json

    from tests.helpers.cli import SMALL_CACHE_FLAGS, run_main
    from triforce_core.prompting import PLAIN_LAYOUT_NOTE
    from ui.handlers.models import model_info

    line = model_info("gemma3-270m", "Gemma 3 270M, base model, no chat template", plain_engine)
    assert "base model: no chat template — the document, your question and the answer are laid out as plain text" in line
    templated = make_tokenizer()
    templated.chat_template = CHAT_TEMPLATE
    with_template = TriForceEngine(plain_engine.target, None, templated, eos_token_ids=[2])
    assert "no chat template" not in model_info("x", None, with_template)  # negative control
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    folder = str(tmp_path / "model")
    plain_layout_checkpoint(folder)
    code, out, err = run_main(["chat", "--target", folder, "--document", str(doc), "--question", QUESTION,
                               "--question", QUESTION, "--mode", "autoregressive", "--max-new-tokens", "16",
                               *SMALL_CACHE_FLAGS, "--json"])
    assert code == 0, err
    assert err.count(PLAIN_LAYOUT_NOTE) == 1  # once, not per question
    turns = json.loads(out)["turns"]
    assert [t["answer"] for t in turns] == [" Yes", " Yes"] and turns[0]["stats"]["stop_reason"] == "stop_text"


def test_the_http_api_ends_a_base_models_answer_as_the_app_does(plain_engine):
    """A chat-completions request to the base model (its prompt the plain layout): the answer is
    cut before the next "Question:", `finish_reason` stop, the tokens as many as kept."""
    from starlette.testclient import TestClient

    from triforce_core.serving.guard import AccessPolicy
    from triforce_core.serving.openai import ChatCompletionsAPI, create_app
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker

    worker = EngineWorker()
    api = ChatCompletionsAPI(plain_engine, worker, SlotPool(plain_engine), model_name="plain",
                             base_config=plain_config("lookup"))
    body = {"model": "plain", "messages": [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}],
            "temperature": 0, "max_tokens": 16}
    try:
        with TestClient(create_app(api, AccessPolicy()), base_url="http://127.0.0.1:8000") as client:
            done = client.post("/v1/chat/completions", json=body).json()
    finally:
        worker.close()
    choice = done["choices"][0]
    assert choice["message"]["content"].rstrip() == " Yes" and choice["finish_reason"] == "stop"
    assert done["usage"]["completion_tokens"] < 16  # ended by the stop, not the limit
