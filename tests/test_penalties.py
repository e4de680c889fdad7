"""Repetition control keeps decoding exact (greedy side; the sampled side is in
test_sampling_exactness.py).

The processor (`triforce_core.decoding.penalties`) is Hugging Face's RepetitionPenaltyLogitsProcessor and
OpenAI's frequency/presence penalties over the answer's tokens. Greedy output of every mode with
the penalties on equals Hugging Face's greedy search with the same processor (applied to the
generated tokens only) token for token, and the target as its own draft is accepted every time.
Negative control: the penalty of every row of a round computed from the round's start (ignoring
the tokens drafted before the row inside it) makes speculative output leave Hugging Face's, so
the equality tests have power.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tests.helpers.models import DRAFT_OVERRIDES, make_hf, to_ours
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import PAPER_METHOD, ConfigError
from triforce_core.decoding.penalties import Penalties, penalize

PROMPT_LEN = 120
NEW = 40
TIE_GAP = 1e-4
CACHE = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_sinks=4, draft_window=32, refresh_every=16)
PENALTY = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.3)


class AnswerPenalties(LogitsProcessor):
    """The oracle: HF's repetition penalty, then OpenAI's frequency and presence penalties, over
    the tokens generated after `start` (HF's own processor would count the prompt too)."""

    def __init__(self, start: int, repetition_penalty: float, frequency_penalty: float, presence_penalty: float):
        self.start, self.f, self.a = start, frequency_penalty, presence_penalty
        self.rep = RepetitionPenaltyLogitsProcessor(repetition_penalty)

    def __call__(self, input_ids, scores):
        answer = input_ids[:, self.start :]
        if answer.shape[1] == 0:
            return scores
        scores = self.rep(answer, scores)
        counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
        return scores - self.f * counts - self.a * (counts > 0).to(scores.dtype)


def _hf_greedy(hf, ids: list[int], **penalty) -> tuple[list[int], list[float]]:
    x = torch.tensor([ids])
    procs = LogitsProcessorList([AnswerPenalties(len(ids), **penalty)]) if penalty else None
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                          pad_token_id=0, logits_processor=procs, output_scores=True, return_dict_in_generate=True)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]  # processed scores
    return out.sequences[0, len(ids):].tolist(), gaps


@functools.lru_cache(maxsize=None)
def _setup():
    target = make_hf("llama_gqa_llama3", seed=0)
    draft = make_hf("llama_gqa_llama3", seed=11, **DRAFT_OVERRIDES)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, target.config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    base = ids[:40]
    looping = base + base[:30] + base + base[:20]  # lookup finds matches everywhere
    refs = {name: _hf_greedy(target, p, **PENALTY) for name, p in (("random", ids), ("looping", looping))}
    plain = _hf_greedy(target, ids)[0]
    return to_ours(target), to_ours(draft), {"random": ids, "looping": looping}, refs, plain


def _config(mode: str, lookup: bool, cache: CacheConfig = CACHE, **spec_kw) -> GenerationConfig:
    kw = {"lookup": True, "lookup_min_match": 2} if lookup else dict(PAPER_METHOD)
    return GenerationConfig(
        sampling=SamplingConfig(**PENALTY),
        speculation=SpeculationConfig(mode=mode, **{"gamma1": 2, "gamma2": 6, **kw, **spec_kw}, max_new_tokens=NEW,
                                      ignore_eos=True),
        cache=cache,
    )


def _assert_same(got: list[int], ref: list[int], gaps: list[float]) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < TIE_GAP, f"diverged from HF at token {i} ({a} != {b}) with top-2 gap {gaps[i]:.3g}"
            return


# -- the processor itself -------------------------------------------------------------------
def test_rows_follow_their_own_prefix_and_match_hf():
    """Row r of one call equals HF's processor applied to answer + extra[:r] alone."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) * 3
    answer, extra = [5, 7, 5, 9], [7, 11, 5]
    got = penalize(logits, answer, extra, **{k.split("_")[0]: v for k, v in PENALTY.items()})
    oracle = AnswerPenalties(0, **PENALTY)
    for r in range(4):
        want = oracle(torch.tensor([answer + extra[:r]]), logits[r : r + 1].clone())[0]
        assert torch.allclose(got[r], want, atol=1e-6), r
    untouched = [c for c in range(30) if c not in answer + extra]
    assert torch.equal(got[:, untouched], logits[:, untouched])


def test_the_prompt_is_not_penalised():
    """`start` marks the answer: the document's tokens are free to be quoted."""
    pen = Penalties(SamplingConfig(repetition_penalty=2.0))
    logits = torch.ones(1, 10)
    pen.start = 3
    out = pen(logits, [1, 2, 3, 4])  # the answer is [4]
    assert out[0, 4] == 0.5 and torch.equal(out[0, :4], logits[0, :4])


def test_off_is_the_identity_and_bad_values_are_refused():
    logits = torch.randn(2, 10)
    assert Penalties(SamplingConfig())(logits, [1, 2, 3], (), [4]) is logits
    for bad in (dict(repetition_penalty=0.0), dict(frequency_penalty=2.5), dict(presence_penalty=-3.0)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingConfig(**bad)


# -- greedy decoding with the penalties ----------------------------------------------------
def test_the_penalty_changes_the_output():
    """Power check: without the penalty HF's greedy output is another one."""
    *_, refs, plain = _setup()
    assert refs["random"][0] != plain


def test_autoregressive_matches_hf_with_penalties():
    t, _, prompts, refs, _ = _setup()
    res = TriForceEngine(t).run(prompts["random"], _config("autoregressive", False))
    _assert_same(res.token_ids, *refs["random"])


CASES = [("triforce", False, {}), ("retrieval", False, {}), ("draft", False, {}), ("triforce", True, {}),
         ("retrieval", True, {}), ("lookup", True, {}),
         ("draft", True, {"adaptive_gamma": True})]


@pytest.mark.parametrize("mode,lookup,extra", CASES, ids=[f"{m}-{'lookup' if l else 'paper'}{'-' + '-'.join(e) if e else ''}"
                                                        for m, l, e in CASES])
def test_speculative_modes_match_hf_with_penalties(mode, lookup, extra):
    t, d, prompts, refs, _ = _setup()
    engine = TriForceEngine(t, d)
    for name in ("random", "looping"):
        res = engine.run(prompts[name], _config(mode, lookup, **extra))
        _assert_same(res.token_ids, *refs[name])
        if lookup and name == "looping":
            assert res.stats.proposed_by_proposer.get("lookup:target", 0) > 0  # lookup really proposed


# The target as its own draft, over caches that hold everything: every level computes the same
# law, so with the penalty applied per row at every level every proposal is accepted.
SAME = CacheConfig(budget=512, chunk_size=4, draft_sinks=4, draft_window=512)
SAME_GAMMAS = (2, 3, 4, 5)  # rounds of 3-6 tokens: a repeat the penalty forbids falls inside one


def _same_draft_runs(mode: str) -> list[tuple[list[int], float]]:
    t, _, prompts, refs, _ = _setup()
    engine = TriForceEngine(t, t)
    out = []
    for g2 in SAME_GAMMAS:
        res = engine.run(prompts["random"], _config(mode, False, gamma2=g2, cache=SAME))
        out.append((res.token_ids, res.stats.acceptance["target"]))
    return out


@pytest.mark.parametrize("mode", ["draft", "triforce"])
def test_same_draft_is_always_accepted_with_penalties(mode):
    """The levels below apply the penalty exactly as the target does: a draft that is the target
    itself is accepted every time (a level without it, or with another prefix, would not be)."""
    *_, refs, _ = _setup()
    for tokens, acceptance in _same_draft_runs(mode):
        _assert_same(tokens, *refs["random"])
        assert acceptance == 1.0


@pytest.mark.parametrize("mode", ["draft", "triforce"])
def test_negative_control_round_start_prefix_diverges(mode, monkeypatch):
    """Each row penalised from the round's start instead of its own prefix (the tokens drafted
    before it in the round ignored), at every level: the target then accepts a repeat the
    penalty forbids (HF's greedy answer holds 52, 52 without the penalty) and the output leaves
    Hugging Face's."""
    exact = Penalties.__call__

    def round_start(self, logits, committed, spec=(), extra=()):
        return exact(self, logits, committed, (), ())

    monkeypatch.setattr(Penalties, "__call__", round_start)
    *_, refs, _ = _setup()
    diverged = [tokens != refs["random"][0] for tokens, _ in _same_draft_runs(mode)]
    assert all(diverged), diverged


# -- where the penalties are set -------------------------------------------------------------
def test_command_line_flags_and_model_defaults():
    """Flags given win; flags not given take the model's defaults (an instruct model's penalty)."""
    from triforce_core.cli.flags import UsageError, check_flags, configs
    from triforce_core.cli.main import build_parser
    from triforce_core.config import INSTRUCT_SAMPLING, default_sampling

    parse = build_parser().parse_args
    plain = parse(["generate", "--prompt", "x"])
    assert configs(plain, True).sampling == SamplingConfig()  # the demo pair: greedy, no penalty
    instruct = configs(plain, True, defaults=default_sampling(True)).sampling
    assert instruct == SamplingConfig(**INSTRUCT_SAMPLING) and instruct.repetition_penalty != 1.0
    given = parse(["chat", "--question", "q", "--repetition-penalty", "1", "--presence-penalty", "0.5",
                   "--frequency-penalty", "0.25", "--temperature", "0.7", "--seed", "3"])
    s = configs(given, True, defaults=default_sampling(True)).sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.temperature, s.seed) == (1.0, 0.5, 0.25, 0.7, 3)
    with pytest.raises(UsageError, match="frequency_penalty"):
        check_flags(parse(["generate", "--prompt", "x", "--frequency-penalty", "3"]))


def test_which_models_are_instruct_models():
    """SmolLM2 and every GGUF file get the chat defaults; the demo pair, which has a chat
    template too, keeps greedy decoding."""
    from transformers import AutoTokenizer

    from triforce_core.models.loading import DEMO_TARGET, is_instruct

    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    assert tok.chat_template  # so the rule really rests on the name
    assert not is_instruct(str(DEMO_TARGET), tok)
    assert is_instruct("smollm2", tok) and is_instruct("Qwen/Qwen2.5-0.5B-Instruct", tok)
    assert is_instruct("/models/tiny-chat.Q8_0.gguf", tok)
    tok.chat_template = None
    # a base model's GGUF file too (its greedy answers loop); a folder without a template keeps greedy decoding
    assert is_instruct("smollm2", tok) and is_instruct("gemma3-270m", tok)
    assert not is_instruct("/models/Qwen2.5-0.5B-Instruct", tok)


def test_http_request_penalties():
    """OpenAI's frequency/presence penalties and the repetition_penalty extension are parsed and
    checked; an absent repetition_penalty means the model's default (None here)."""
    from triforce_core.serving.openai import ApiError, parse_request

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = parse_request({**base, "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.3})
    assert (r.frequency_penalty, r.presence_penalty, r.repetition_penalty) == (0.5, -1.0, 1.3)
    r = parse_request(base)
    assert (r.frequency_penalty, r.presence_penalty, r.repetition_penalty) == (0.0, 0.0, None)
    for name, bad in (("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0)):
        with pytest.raises(ApiError) as e:
            parse_request({**base, name: bad})
        assert e.value.status == 400 and e.value.param == name
