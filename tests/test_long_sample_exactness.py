"""Long sampled answers follow the target's exact law, in every mode, through every path.

`test_sampling_exactness.py` compares the joint law of the first *two* tokens with the exact
one; two tokens never reach the paths that only long answers take: lookup runs of several
tokens (the loop caps a run at max_new_tokens - 1), a proposal cut or dropped by the price of
its rows, a run doubling after a run taken whole, the rival cut, the small draft's confidence gate over several tokens, retrieval refreshes,
and the small draft's StreamingLLM cache compacting (it has room for 16 tokens past its window
after the prefill, whatever the window). Here every sample is 12 or 20 tokens long, in every
mode, and each test counts the paths it went through and asserts each was taken.

Method: the randomized probability integral transform (Rosenblatt). For each sampled token x at
position t, with p the target's exact warped law given the prompt and the sampled x_<t, and F
its distribution function over an order of the vocabulary fixed by p alone,

    u = F(x - 1) + v * p(x),   v ~ U[0, 1) drawn by a separate seeded generator.

If x ~ p, u is uniform on [0, 1) whatever p is; and since u_t is uniform given x_<t, the u's of
one sample are independent, so all n * T of them are i.i.d. U[0, 1). p comes from Hugging
Face's model in float64 (one forward of the prompt, then one teacher-forced forward of every
sample over its cache, all samples in one batch) and Hugging Face's own temperature and top-k
warpers: nothing of ours.
A Kolmogorov-Smirnov test checks the u's pooled and at each position (Bonferroni over the
positions), for two orders of the vocabulary: token ids, and likeliest first. Every p-value
must exceed 1e-3.

Why two orders: the typical fault puts too much mass on tokens the target finds unlikely (a
rejected token kept) or likely (a residual that forgets to remove the proposer's share), and
which ids those are changes from position to position, so in id order the excess lands at
scattered u's and mostly cancels; likeliest first puts it at the same end of [0, 1) every time.
Any order fixed by p is as exact as the ids.

Negative controls (each must give p < 1e-6 with the same settings): the reference code's residual
bug (after a rejection, resample from p instead of norm(max(0, p - q))) at both of TriForce's
verifying levels, and a rule that keeps the first rejected token (one accepted too many).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from tests.helpers.models import make_hf, to_ours
from scipy.stats import kstest
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import triforce_core.decoding.loop as loop_module
import triforce_core.decoding.lookup as lookup_module
import triforce_core.decoding.proposers as proposers
import triforce_core.decoding.schedule as schedule
from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.cli.harness import hf_cache_name
from triforce_core.config import PAPER_METHOD
from triforce_core.decoding.events import ChunksSelected, Committed, Drafted, Finished
from triforce_core.decoding.loop import make_generator
from triforce_core.decoding.sampling import VerifyResult, sample, verify_stochastic
from triforce_core.models.transformer import Transformer

V = 24
# Random words, then the target's own greedy continuation: it repeats itself in places (an
# untrained model's greedy text falls into loops), so the answer's last two tokens often recur
# in the prompt, lookup proposes, and the target takes some runs whole and cuts others.
RANDOM_WORDS, GREEDY_WORDS = 16, 48
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.5, bos_token_id=None, eos_token_id=None)
# Budget 16 of a 63-token cache: the retrieval level sees a quarter of the context, re-selected
# every 2 committed tokens. The small draft keeps 2 sinks + 8 recent tokens (+ a slack of 16).
CACHE = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=2)
# Lookup proposals of at most 8 tokens; the rival cut and the backoff are on (defaults). Rows
# free (lookup_row_cost 0): every token lookup finds is proposed, so long proposals are taken
# whole, cut and partly taken. Mode `lookup priced` pays a fixed price for a row (not this
# machine's), which cuts proposals short or drops them as this generation's misses count.
LOOKUP = dict(lookup_min_match=2, lookup_max=8, lookup_row_cost=0.0)
LOOKUP_PRICED = dict(lookup_min_match=2, lookup_max=8, lookup_row_cost=0.15)

# name: (temperature, top_k, speculation). 20 tokens where the small draft runs: after the
# prefill its cache holds 2 sinks + the prompt's last 8 tokens, and it compacts (between rounds,
# before the answer ends) once 17 new tokens are committed (slack 16).
MODES = {
    "lookup": (1.0, 0, SpeculationConfig(mode="lookup", max_new_tokens=12, **LOOKUP)),
    "lookup priced": (1.0, 0, SpeculationConfig(mode="lookup", max_new_tokens=12, **LOOKUP_PRICED)),
    "draft": (1.0, 0, SpeculationConfig(mode="draft", max_new_tokens=20, gamma2=3, draft_confidence=0.6,
                                        adaptive_gamma=False, **LOOKUP)),
    "retrieval": (0.7, 12, SpeculationConfig(mode="retrieval", max_new_tokens=12, gamma2=3, **LOOKUP)),
    "triforce": (0.7, 0, SpeculationConfig(mode="triforce", max_new_tokens=20, gamma1=2, gamma2=4,
                                           draft_confidence=0.6, **LOOKUP)),
    "paper": (1.0, 0, SpeculationConfig(mode="triforce", max_new_tokens=20, gamma1=1, gamma2=3, **PAPER_METHOD)),
}

# The paths each mode must go through (each counted below, each at least MIN_COUNT times).
LOOKUP_PATHS = ("lookup run taken whole", "lookup run cut by the target", "lookup run partly taken",
                "rival cut", "lookup backoff")
GATE_PATHS = ("draft gate kept a token", "draft gate stopped a proposal")
PATHS = {
    "lookup": LOOKUP_PATHS,
    "lookup priced": ("lookup run cut by the target", "rival cut", "lookup backoff",
                      "lookup proposal cut by its price", "lookup proposal dropped by its price"),
    "draft": LOOKUP_PATHS + GATE_PATHS + ("draft cache compacted",
                                                                    "draft token accepted by target",
                                                                    "draft token rejected by target"),
    "retrieval": LOOKUP_PATHS + ("sparse refresh", "retrieval token accepted by target",
                                 "retrieval token rejected by target"),
    "triforce": LOOKUP_PATHS + GATE_PATHS + ("sparse refresh", "draft cache compacted",
                                             "lookup token accepted by retrieval", "draft token accepted by retrieval",
                                             "draft token rejected by retrieval", "retrieval token accepted by target",
                                             "retrieval token rejected by target"),
    "paper": ("sparse refresh", "draft cache compacted", "draft token accepted by retrieval",
              "draft token rejected by retrieval", "retrieval token accepted by target",
              "retrieval token rejected by target"),
}
MIN_COUNT = 5
# Samples per mode: the paper's levels cost the most per token (a forward of the small draft and
# one of the retrieval level for most tokens, most of them rejected by the target).
SAMPLES = {"lookup": 400, "lookup priced": 400, "draft": 400, "retrieval": 400, "triforce": 400, "paper": 300}
CONTROL_SAMPLES = 150  # keeping a rejected token moves the law far: fewer samples suffice


@dataclass(frozen=True)
class Models:
    hf64: torch.nn.Module  # the target in float64: the oracle
    target: Transformer  # ours, float32
    draft: Transformer
    prompt: tuple[int, ...]


@functools.cache
def _models() -> Models:
    hf = make_hf("llama_gqa_llama3", seed=41, **SMALL)
    draft = make_hf("llama_gqa_llama3", seed=141, **{**SMALL, "num_hidden_layers": 1})
    ids = torch.randint(0, V, (RANDOM_WORDS,), generator=torch.Generator().manual_seed(41)).tolist()
    with torch.no_grad():
        for _ in range(GREEDY_WORDS):
            ids.append(int(hf(torch.tensor(ids)[None]).logits[0, -1].argmax()))
    return Models(copy.deepcopy(hf).double(), to_ours(hf), to_ours(draft), tuple(ids))


def _config(mode: str, seed: int = 0) -> GenerationConfig:
    temperature, top_k, spec = MODES[mode]
    return GenerationConfig(sampling=SamplingConfig(temperature=temperature, top_k=top_k, seed=seed),
                            speculation=replace(spec, ignore_eos=True), cache=CACHE)


# -- sampling, and counting the paths taken ---------------------------------------------------
class Spies:
    """Wrappers that record what a proposal was asked for and what it gave, changing nothing:
    no event says why a lookup run or a draft is shorter than asked (the rival cut, the gate)."""

    def __init__(self, monkeypatch):
        self.counts: Counter = Counter()
        propose_lookup, propose_sampled = lookup_module.ContextIndex.propose, proposers.ModelDraft.propose
        take_length = schedule.LookupLength.take

        def lookup(index, seq, k):
            out, length = propose_lookup(index, seq, k)
            if out and length < index.min_match:
                self.counts["lookup backoff"] += 1
            elif len(out) < k:  # a match always copies k tokens: only a rival cuts them
                self.counts["rival cut"] += 1
            return out, length

        def sampled(sampler, n, committed, spec, events):
            prop = propose_sampled(sampler, n, committed, spec, events)
            if sampler.min_confidence > 0:
                self.counts["draft gate kept a token"] += len(prop.tokens)
                self.counts["draft gate stopped a proposal"] += len(prop.tokens) < n  # stopped before an unsure law
            return prop

        def take(rule, match, offered):
            k = take_length(rule, match, offered)
            if 0 < k < offered:
                self.counts["lookup proposal cut by its price"] += 1
            elif k == 0 < offered:
                self.counts["lookup proposal dropped by its price"] += 1
            return k

        monkeypatch.setattr(lookup_module.ContextIndex, "propose", lookup)
        monkeypatch.setattr(proposers.ModelDraft, "propose", sampled)
        monkeypatch.setattr(schedule.LookupLength, "take", take)


def _count_events(events: list, spec: SpeculationConfig, counts: Counter) -> None:
    """Count one sample's paths from its events (rounds end at `Committed`)."""
    round_: list = []
    for ev in events:
        if isinstance(ev, Committed):
            if len(round_) >= 2 and isinstance(round_[0], Drafted) and round_[0].level == "lookup":
                k, verdict = len(round_[0].token_ids), round_[1]
                if verdict.level == "target" and k >= 2:  # a lookup run straight to the target
                    counts["lookup run taken whole" if verdict.accepted == k else "lookup run cut by the target"] += 1
                    counts["lookup run partly taken"] += 0 < verdict.accepted < k
            round_ = []
        else:
            round_.append(ev)
        if isinstance(ev, ChunksSelected):
            counts["sparse refresh"] += not ev.dense
        if isinstance(ev, Finished):
            s = ev.stats
            for pair, n in s.proposed_by_proposer.items():
                who, verifier = pair.split(":")
                accepted = round(s.acceptance_by_proposer.get(pair, 0.0) * n)
                counts[f"{who} token accepted by {verifier}"] += accepted
                counts[f"{who} token rejected by {verifier}"] += n - accepted


@dataclass
class Draws:
    prompt: list[int]
    tokens: np.ndarray  # [n, T]
    counts: Counter


def draw(mode: str, samples: int, monkeypatch=None, seed: int = 0) -> Draws:
    """`samples` answers of `mode` after one prefill (as `TriForceEngine.run_samples`), counting
    the paths taken: from the events, the small draft's cache and, with `monkeypatch`, spies."""
    m = _models()
    prompt = list(m.prompt)
    cfg = _config(mode, seed)
    engine = TriForceEngine(m.target, m.draft)
    spies = Spies(monkeypatch) if monkeypatch is not None else None
    loop = engine.make_loop(cfg, engine.capacity_for(len(prompt), cfg), make_generator(seed, m.target.device))
    prefilled = loop.prefill(prompt)
    loop.mark()
    evicted = loop.small.cache.evicted if loop.small is not None else 0  # by the prefill
    counts: Counter = Counter()
    rows = []
    for i in range(samples):
        if i:
            loop.restore()
        events = list(loop.run(prefilled))
        rows.append([t for ev in events if isinstance(ev, Committed) for t in ev.token_ids])
        _count_events(events, cfg.speculation, counts)
        if loop.small is not None:  # a compaction is followed by at least one more token (see loop.run)
            counts["draft cache compacted"] += loop.small.cache.evicted > evicted
    if spies is not None:
        counts += spies.counts
    return Draws(prompt, np.array(rows), counts)


# -- the probability integral transform -------------------------------------------------------
def target_laws(prompt: list[int], tokens: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """[n, T, V]: the target's warped law of each sampled token given the prompt and the sample's
    earlier tokens, from Hugging Face's model in float64 and its own warpers: one forward of the
    prompt, whose cache every sample's teacher-forced forward then extends (all in one batch;
    the same laws as a forward over prompt + sample, bit for bit, several times faster)."""
    hf, n = _models().hf64, len(tokens)
    with torch.no_grad():
        first = hf(torch.tensor([prompt]), use_cache=True)
        cache = getattr(first, hf_cache_name())
        cache.batch_repeat_interleave(n)
        rest = hf(torch.from_numpy(tokens[:, :-1]), **{hf_cache_name(): cache}).logits  # row t predicts token t + 1
        logits = torch.cat([first.logits[:, -1:].expand(n, 1, V), rest], dim=1)  # [n, T, V]
    flat = TemperatureLogitsWarper(temperature)(None, logits.reshape(-1, V))
    if top_k:
        flat = TopKLogitsWarper(top_k)(None, flat)
    return flat.softmax(-1).reshape(logits.shape).numpy()


def pit(law: np.ndarray, tokens: np.ndarray, v: np.ndarray, likeliest_first: bool) -> np.ndarray:
    """u = F(x - 1) + v p(x) for each token x [n, T], F over token ids or likeliest first."""
    if likeliest_first:
        order = np.argsort(-law, axis=-1, kind="stable")  # fixed by p alone
        law = np.take_along_axis(law, order, -1)
        tokens = np.argmax(order == tokens[..., None], axis=-1)  # x's place in that order
    p_x = np.take_along_axis(law, tokens[..., None], -1)[..., 0]
    below = np.take_along_axis(np.cumsum(law, -1), tokens[..., None], -1)[..., 0] - p_x
    return np.clip(below + v * p_x, 0.0, 1.0)


def pit_pvalues(mode: str, d: Draws, seed: int = 0) -> dict[str, float]:
    """Kolmogorov-Smirnov p-values of the u's against U[0, 1): pooled, and the smallest over the
    positions times their number (Bonferroni), for each order of the vocabulary."""
    temperature, top_k, _ = MODES[mode]
    law = target_laws(d.prompt, d.tokens, temperature, top_k)
    v = np.random.default_rng(seed).random(d.tokens.shape)
    out = {}
    for name, first in (("ids", False), ("likeliest first", True)):
        u = pit(law, d.tokens, v, first)
        out[f"{name}, pooled"] = float(kstest(u.ravel(), "uniform").pvalue)
        by_position = min(kstest(u[:, t], "uniform").pvalue for t in range(u.shape[1]))
        out[f"{name}, by position"] = float(min(1.0, by_position * u.shape[1]))
    return out


def _show(p: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2e}" for k, v in p.items())


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_long_samples_follow_the_target_law(mode, monkeypatch, one_thread):
    """Every position of 12- or 20-token answers follows the target's law (all p > 1e-3).

    Holds because each level's verification is exact given the prefix: the u's are then i.i.d.
    uniform, and a Kolmogorov-Smirnov p-value under 1e-3 would happen by chance once in a
    thousand seeds (once in 250 for the four checked here). The counts show that the answers
    really went through the paths listed in PATHS: a path never taken would prove nothing."""
    d = draw(mode, SAMPLES[mode], monkeypatch)
    assert d.tokens.shape == (SAMPLES[mode], MODES[mode][2].max_new_tokens)
    missing = {path: d.counts[path] for path in PATHS[mode] if d.counts[path] < MIN_COUNT}
    assert not missing, f"{mode}: paths taken too rarely {missing}; all counts {dict(d.counts)}"
    p = pit_pvalues(mode, d)
    assert min(p.values()) > 1e-3, f"{mode}: {_show(p)}; paths {dict(d.counts)}"


def resample_from_p(draft_tokens, q, p, generator):
    """The reference implementation's bug: after a rejection, resample from p, not the residual
    norm(max(0, p - q)) (for a lookup's point mass: p without the rejected token removed)."""
    gamma = len(draft_tokens)
    u = torch.rand(gamma, generator=generator, device=generator.device)
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if q is None else q[i, x]
        if u[i] * q_x >= p[i, x]:
            return VerifyResult(accepted=i, token=sample(p[i], generator), bonus=False)
    return VerifyResult(accepted=gamma, token=sample(p[gamma], generator), bonus=True)


def one_too_many(draft_tokens, q, p, generator):
    """The exact rule, except that the first rejected token is kept (the next token is then
    drawn from p at the following row, or is the bonus when that was the last)."""
    r = verify_stochastic(draft_tokens, q, p, generator)
    if r.bonus:
        return r
    n = r.accepted + 1
    return VerifyResult(accepted=n, token=sample(p[n], generator), bonus=n == len(draft_tokens))


def _break_verification(monkeypatch, rule) -> None:
    """Both verifying levels use `rule`: the target's (looked up in the loop's module) and
    TriForce's middle level (`MiddleLevel.verify`)."""
    monkeypatch.setattr(loop_module, "verify_stochastic", rule)
    monkeypatch.setattr(proposers.MiddleLevel, "verify", staticmethod(rule))


# The reference code's residual: on the paper's levels it moves the law of every position where
# the retrieval level or the target rejected a model's token toward the proposer's law. On a
# lookup's point mass x it gives x the extra p(x) (1 - p(x)) at each rejection, which is small
# where lookup proposes unlikely tokens, as here mostly: more samples (of the cheapest mode).
RESIDUAL_CONTROLS = {"paper": SAMPLES["paper"], "lookup": 2000}


@pytest.mark.parametrize("mode", list(RESIDUAL_CONTROLS))
def test_negative_control_residual_from_p_fails(mode, monkeypatch, one_thread):
    """The reference code's residual (resample from p after a rejection) at both verifying
    levels, on the same workload as the test above: p < 1e-6."""
    _break_verification(monkeypatch, resample_from_p)
    p = pit_pvalues(mode, draw(mode, RESIDUAL_CONTROLS[mode]))
    assert min(p.values()) < 1e-6, f"{mode}: the broken residual passed: {_show(p)}"


@pytest.mark.parametrize("mode", list(MODES))
def test_negative_control_one_token_too_many_fails(mode, monkeypatch, one_thread):
    """Keeping the first rejected token gives tokens the target finds unlikely (that is why
    they were rejected) far too often: p < 1e-6 in every mode, with fewer samples."""
    _break_verification(monkeypatch, one_too_many)
    p = pit_pvalues(mode, draw(mode, CONTROL_SAMPLES))
    assert min(p.values()) < 1e-6, f"{mode}: a verifier keeping a rejected token passed: {_show(p)}"
