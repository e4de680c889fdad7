"""The embedded demo pair under assets/models: loads offline, shares one tokenizer, generates exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from triforce_core.config import PAPER_METHOD, CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import DEMO_DRAFT, DEMO_TARGET, check_pair, load_model
from triforce_core.serving.session import ChatSession

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE = REPO_ROOT / "assets" / "sample" / "python-tutorial-classes.txt"


@pytest.fixture(scope="module")
def engine():
    return TriForceEngine.from_pretrained(str(DEMO_TARGET), str(DEMO_DRAFT), device="cpu", dtype="float32")


def test_shipped_files_are_small_half_precision_safetensors():
    total = 0
    for folder in (DEMO_TARGET, DEMO_DRAFT):
        weights = folder / "model.safetensors"
        assert weights.is_file(), f"{weights} is missing"
        total += weights.stat().st_size
        with safe_open(str(weights), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"BF16"}, dtypes
        assert (folder / "tokenizer.json").is_file()
    assert total < 40 * 2**20, f"{total / 2**20:.1f} MiB of weights"
    assert (DEMO_TARGET.parent / "README.md").is_file(), "the model card is missing"


def test_pair_shares_one_tokenizer_with_a_chat_template():
    tt = AutoTokenizer.from_pretrained(DEMO_TARGET)
    dt = AutoTokenizer.from_pretrained(DEMO_DRAFT)
    assert tt.get_vocab() == dt.get_vocab()
    assert (DEMO_TARGET / "tokenizer.json").read_bytes() == (DEMO_DRAFT / "tokenizer.json").read_bytes()
    assert len(tt) == 4096
    text = tt.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|endoftext|><|user|>\nHi<|end|>\n<|assistant|>\n"
    assert tt.eos_token == "<|end|>"
    sample = "Classes provide a means of bundling data «and» functionality together."
    assert tt.decode(tt(sample, add_special_tokens=False)["input_ids"]) == sample


def test_target_is_long_context_and_kv_bound_and_draft_is_much_smaller():
    target = load_model(str(DEMO_TARGET), torch.device("cpu"), torch.float32)
    draft = load_model(str(DEMO_DRAFT), torch.device("cpu"), torch.float32)
    check_pair(target, draft)
    cfg = json.loads((DEMO_TARGET / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["max_position_embeddings"] >= 16384
    n_target = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(DEMO_TARGET).parameters())
    n_draft = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(DEMO_DRAFT).parameters())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes_16k = 16384 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert kv_bytes_16k >= 3 * 4 * n_target, "at 16K tokens the KV cache must be at least 3x the weights"
    assert n_draft * 5 <= n_target
    assert target.eos_token_ids == draft.eos_token_ids == frozenset({0, 4})


def _chat_prompt(engine, question: str, document: str = "") -> list[int]:
    return ChatSession(engine, document).prompt_ids(question)


@pytest.mark.parametrize("lookup", [True, False], ids=["default", "paper"])
def test_triforce_on_the_shipped_pair_equals_hf_greedy(engine, lookup):
    """A quote question: the default (lookup on) copies the passage in long lookup runs."""
    document = SAMPLE.read_text(encoding="utf-8")[:6000]
    prompt = _chat_prompt(engine, "What follows «Classes provide a means of bundling»?", document)
    new = 48
    config = GenerationConfig(
        cache=CacheConfig(budget=512, chunk_size=16, draft_window=128, draft_sinks=16),
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=new, ignore_eos=True,
                                      **({} if lookup else PAPER_METHOD)),
    )
    result = engine.run(prompt, config)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    x = torch.tensor([prompt])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert result.token_ids == ref
    s = result.stats
    if lookup:
        assert set(result.levels) <= {"lookup", "draft", "retrieval", "target"}
        # The target quotes the document: lookup runs carry most tokens and grow past gamma2.
        assert s.committed_by_level["lookup"] > new // 2, s.committed_by_level
        assert s.acceptance_by_proposer["lookup:target"] > 0.5, s.acceptance_by_proposer
        assert s.rounds < new / 6, s.rounds
    else:
        assert set(result.levels) <= {"draft", "retrieval", "target"}
        assert "lookup" not in s.level_seconds


def test_cli_defaults_to_the_embedded_pair():
    out = subprocess.run(
        [sys.executable, "-m", "triforce_core", "generate", "--prompt", "The for statement", "--max-new-tokens", "6",
         "--ignore-eos", "--json"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert len(payload["samples"][0]["token_ids"]) == 6


@pytest.mark.parametrize("phrase", [
    "(You could conceivably place a class",
    "It is not necessary that the function definition",
    "Dynamic ordering is necessary because all cases",
])
def test_shipped_target_quotes_the_passage_after_a_phrase_of_the_sample_document(engine, phrase):
    """The copy skill the retrieval level relies on, on the whole sample document (~9.6K
    tokens): asked what follows a phrase, the target repeats it and goes on with the next 20
    tokens of the document, exactly (greedy, through a chat session as in the app).

    A regression guard, not an accuracy figure: the target copies about 80 % of passages
    (scripts/eval_demo_models.py); it misses where the few tokens it has just written also
    occur elsewhere with another continuation. "You can call the __next__ method" is such a
    place ("...the next built-in function" becomes "...built-in functions that work with
    inheritance"), so it is not among these phrases."""
    document = SAMPLE.read_text(encoding="utf-8")
    assert document.count(phrase) == 1
    tok = engine.tokenizer
    passage = document[document.index(phrase):]
    echo = len(tok(phrase, add_special_tokens=False)["input_ids"])
    want = tok(passage[:len(phrase) + 400], add_special_tokens=False)["input_ids"][:echo + 20]
    config = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=echo + 20,
                                                            ignore_eos=True))
    session = ChatSession(engine, document, config=config)
    for _ in session.ask(f"What follows «{phrase}»?"):
        pass
    got = session.turns[-1].token_ids
    assert tok.decode(got) == tok.decode(want), (tok.decode(got), tok.decode(want))
