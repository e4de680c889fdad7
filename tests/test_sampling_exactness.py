"""Sampled output follows the target's exact law, at every level.

With a 16-token vocabulary the joint law of the first two generated tokens (256 cells) is
computed exactly from Hugging Face's model and its own logits warpers; thousands of samples
from each mode are compared with it by a chi-square test (p > 1e-3 must hold).

Negative control: the same test on a deliberately broken verifier -- one that, after a
rejection, resamples from the verifier's own law instead of the residual norm(max(0, p - q))
(the public reference implementation's bug) -- must fail (p < 1e-3), proving the test has power.

The repetition penalties (`triforce_core.decoding.penalties`) are covered the same way: the exact law is
then Hugging Face's RepetitionPenaltyLogitsProcessor and the frequency/presence penalties over
the answer's tokens, before the warpers; penalties computed from the wrong prefix must fail.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import triforce_core.decoding.proposers as proposers
import triforce_core.decoding.loop as speculation
from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.decoding.penalties import Penalties
from triforce_core.decoding.sampling import verify_stochastic
from tests.helpers.sampling import (CACHE, FOLLOWING, LOOKUP, N_SAMPLES, PAPER, V, break_verifier, broken_verify,
                                    chi2_pvalue, exact_joint, first_two_law, hf_warp, law_models, sample_counts)


def broken_lookup_only(draft_tokens, q, p, generator):
    """Exact for model proposals; the broken residual only for lookups' point masses."""
    if q is None:
        return broken_verify(draft_tokens, q, p, generator)
    return verify_stochastic(draft_tokens, q, p, generator)


def test_levels_really_differ():
    """Power check of the setup itself: the laws the levels propose are far from the target's."""
    _, t, d, prompt = law_models()
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=2, ignore_eos=True, lookup=False, **PAPER),
        cache=CACHE,
    )
    stats = [r.stats for r in TriForceEngine(t, d).run_samples(prompt, cfg, 200)]
    acc_mid = sum(s.accepted["retrieval"] for s in stats) / sum(s.proposed["retrieval"] for s in stats)
    acc_top = sum(s.accepted["target"] for s in stats) / sum(s.proposed["target"] for s in stats)
    assert acc_mid < 0.8 and acc_top < 0.9, (acc_mid, acc_top)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("mode", ["triforce", "retrieval", "draft"])
def test_joint_law_of_two_tokens_is_exact(mode, temperature):
    p = chi2_pvalue(sample_counts(mode, temperature), exact_joint(temperature))
    assert p > 1e-3, f"{mode} at T={temperature}: chi-square p = {p:.2e}"


def test_autoregressive_sampling_is_exact():
    p = chi2_pvalue(sample_counts("autoregressive", 1.0), exact_joint(1.0))
    assert p > 1e-3


def test_top_k_top_p_warping_is_exact():
    """Top-k and top-p are applied identically to every level's law, as Hugging Face does."""
    p = chi2_pvalue(sample_counts("triforce", 0.8, top_k=10, top_p=0.9), exact_joint(0.8, 10, 0.9))
    assert p > 1e-3


@pytest.mark.parametrize("mode", ["triforce", "retrieval", "draft"])
def test_negative_control_broken_residual_fails(mode, monkeypatch):
    break_verifier(monkeypatch)
    p = chi2_pvalue(sample_counts(mode, 1.0), exact_joint(1.0))
    assert p < 1e-3, f"the broken sampler was not detected in {mode} mode (p = {p:.2e})"


def test_joint_law_with_attention_selection_is_exact():
    _, t, d, prompt = law_models()
    cfg = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=0),
                           speculation=SpeculationConfig(mode="retrieval", gamma2=1, max_new_tokens=2, ignore_eos=True,
                                                         lookup=False, **PAPER),
                           cache=FOLLOWING)
    assert sum(r.stats.refreshes for r in TriForceEngine(t, d).run_samples(prompt, cfg, 50)) > 10  # power
    p = chi2_pvalue(sample_counts("retrieval", 1.0, gammas=(1, 1), cache=FOLLOWING), exact_joint(1.0))
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_broken_residual_fails_with_attention_selection(monkeypatch):
    break_verifier(monkeypatch)
    p = chi2_pvalue(sample_counts("retrieval", 1.0, gammas=(1, 1), cache=FOLLOWING), exact_joint(1.0))
    assert p < 1e-3, f"the broken sampler was not detected with the attention selection (p = {p:.2e})"


# Adaptive draft length without lookup: with gamma2 = 2 and two tokens, a first draft rejected
# whole is followed by a plain target step, a half-accepted one by a one-token draft.
@pytest.mark.parametrize("mode", ["triforce", "retrieval", "draft"])
def test_joint_law_with_adaptive_gamma_is_exact(mode):
    p = chi2_pvalue(sample_counts(mode, 1.0, adaptive_gamma=True), exact_joint(1.0))
    assert p > 1e-3, f"{mode} with an adaptive draft length: chi-square p = {p:.2e}"


def test_adaptive_gamma_really_changes_the_second_round():
    """Power check: with the adaptive length, samples whose first draft was rejected whole take
    their second token from a plain target step; with a fixed gamma2 they draft two again."""
    _, t, d, prompt = law_models()

    def second_drafts(adaptive: bool) -> list[int]:
        cfg = GenerationConfig(
            sampling=SamplingConfig(temperature=1.0, seed=0),
            speculation=SpeculationConfig(mode="retrieval", gamma2=2, max_new_tokens=2, ignore_eos=True,
                                          **{**PAPER, "adaptive_gamma": adaptive}),
            cache=CACHE,
        )
        return [r.stats.proposed.get("target", 0) - 2 for r in TriForceEngine(t, d).run_samples(prompt, cfg, 200)
                if r.stats.rounds == 2]

    adaptive, fixed = second_drafts(True), second_drafts(False)
    assert adaptive.count(0) >= 20 and set(adaptive) == {0}, adaptive
    assert len(fixed) >= 20 and set(fixed) == {2}, fixed


def test_negative_control_broken_residual_fails_with_adaptive_gamma(monkeypatch):
    monkeypatch.setattr(speculation, "verify_stochastic", broken_verify)
    p = chi2_pvalue(sample_counts("retrieval", 1.0, adaptive_gamma=True), exact_joint(1.0))
    assert p < 1e-3, f"the broken sampler was not detected with an adaptive draft length (p = {p:.2e})"


def test_negative_control_broken_middle_level_fails(monkeypatch):
    """Only TriForce's middle level broken (exactly the reference code's bug): still detected."""
    monkeypatch.setattr(speculation.MiddleLevel, "verify", staticmethod(broken_verify))
    p = chi2_pvalue(sample_counts("triforce", 1.0), exact_joint(1.0))
    assert p < 1e-3, f"a broken middle level was not detected (p = {p:.2e})"


def test_negative_control_wrong_temperature_fails():
    """Sampling at T=1 must not pass as the T=0.6 law: the test distinguishes temperatures."""
    p = chi2_pvalue(sample_counts("triforce", 1.0), exact_joint(0.6))
    assert p < 1e-3


# -- context lookup: point-mass proposals ---------------------------------------------------
# With 16 tokens, matching one token (lookup_min_match=1) finds an earlier occurrence of every
# sequence end, so lookup proposes in the first round and, inside TriForce's middle level, in
# later steps too (two tokens would recur in a 48-token prompt only now and then).
LOOKUP_COMBOS = [("lookup", {}), ("triforce", {}), ("retrieval", {}), ("draft", {})]


@pytest.mark.parametrize("mode,extra", LOOKUP_COMBOS, ids=[f"{m}-{'-'.join(e) or 'default'}" for m, e in LOOKUP_COMBOS])
def test_joint_law_with_lookup_is_exact(mode, extra):
    p = chi2_pvalue(sample_counts(mode, 1.0, lookup=True, **extra), exact_joint(1.0))
    assert p > 1e-3, f"{mode} {extra} with lookup: chi-square p = {p:.2e}"


# -- the small draft's confidence gate --------------------------------------------------------
# This draft is sure of most of its tokens: a gate at 0.8 keeps about a third of its proposals
# (measured: 325 of 945 in triforce, 270 of 776 in mode draft, over 200 samples), so both the
# gated and the proposed tokens shape what is sampled.
DRAFT_GATE = 0.8


@pytest.mark.parametrize("mode", ["triforce", "draft"])
def test_joint_law_with_the_draft_gate_is_exact(mode):
    p = chi2_pvalue(sample_counts(mode, 1.0, draft_confidence=DRAFT_GATE), exact_joint(1.0))
    assert p > 1e-3, f"{mode} with draft_confidence {DRAFT_GATE}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("mode", ["triforce", "draft"])
def test_the_draft_gate_keeps_some_proposals_and_drops_others(mode):
    _, t, d, prompt = law_models()

    def draft_tokens(gate: float) -> int:
        cfg = GenerationConfig(
            sampling=SamplingConfig(temperature=1.0, seed=0),
            speculation=SpeculationConfig(mode=mode, gamma1=2, gamma2=2, max_new_tokens=2, ignore_eos=True, lookup=False,
                                          **{**PAPER, "draft_confidence": gate}),
            cache=CACHE,
        )
        stats = [r.stats for r in TriForceEngine(t, d).run_samples(prompt, cfg, 100)]
        return sum(n for s in stats for k, n in s.proposed_by_proposer.items() if k.startswith("draft:"))

    gated, ungated = draft_tokens(DRAFT_GATE), draft_tokens(0.0)
    assert 0.1 * ungated < gated < 0.7 * ungated, (gated, ungated)


def test_negative_control_broken_residual_fails_with_the_draft_gate(monkeypatch):
    break_verifier(monkeypatch)
    p = chi2_pvalue(sample_counts("draft", 1.0, draft_confidence=DRAFT_GATE), exact_joint(1.0))
    assert p < 1e-3, f"broken residual with the draft gate passed: p = {p:.2e}"


@functools.lru_cache(maxsize=None)
def _backoff_prompt() -> tuple[list[int], np.ndarray]:
    """The prompt with every earlier follower of its last token set to the target's likeliest
    first token (a few rounds, as the change moves that token), and the exact joint law after it.
    With two tokens to match the last pair never recurs, so the backoff proposes that likely
    token: a point mass accepted often and rejected often, which gives the test power."""
    target, _, _, prompt = law_models()
    prompt = list(prompt)
    last = prompt[-1]
    for _ in range(4):
        with torch.no_grad():
            y = int(target(torch.tensor(prompt)[None]).logits[0, -1].argmax())
        for i in range(len(prompt) - 2):
            if prompt[i] == last:
                prompt[i + 1] = y
    return prompt, first_two_law(target, prompt)


def _backoff_counts(samples: int = N_SAMPLES, backoff: bool = True) -> tuple[np.ndarray, int]:
    _, t, d, _ = law_models()
    prompt, _ = _backoff_prompt()
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode="lookup", max_new_tokens=2, ignore_eos=True, lookup_min_match=2,
                                      lookup_backoff=backoff, lookup_row_cost=0.0),
        cache=CACHE,
    )
    engine = TriForceEngine(t, d)
    counts = np.zeros((V, V))
    proposed = 0
    for r in engine.run_samples(prompt, cfg, samples):
        counts[r.token_ids[0], r.token_ids[1]] += 1
        proposed += r.stats.proposed_by_proposer.get("lookup:target", 0)
    return counts, proposed


def test_joint_law_with_lookup_backoff_is_exact():
    prompt, law = _backoff_prompt()
    y = prompt[prompt.index(prompt[-1]) + 1]
    assert 0.1 < law.sum(1)[y] < 0.9  # the backoff's token: often accepted, often rejected
    counts, proposed = _backoff_counts()
    assert proposed == N_SAMPLES  # every sample's first token was proposed ...
    assert _backoff_counts(100, backoff=False)[1] == 0  # ... by the backoff
    p = chi2_pvalue(counts, law)
    assert p > 1e-3, f"lookup with backoff: chi-square p = {p:.2e}"


def test_negative_control_broken_residual_fails_with_lookup_backoff(monkeypatch):
    """The same workload with the point masses' residual broken: the test above must see it."""
    break_verifier(monkeypatch)
    counts, _ = _backoff_counts()
    p = chi2_pvalue(counts, _backoff_prompt()[1])
    assert p < 1e-3, f"broken residual with lookup backoff passed: p = {p:.2e}"


def test_lookup_really_proposes_and_is_sometimes_rejected():
    """Power check: lookup tokens are proposed in every sample and mostly rejected, so the
    residual rule (what the negative control breaks) decides most first tokens."""
    _, t, d, prompt = law_models()
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=2, ignore_eos=True, gamma2=2, **LOOKUP),
        cache=CACHE,
    )
    stats = [r.stats for r in TriForceEngine(t, d).run_samples(prompt, cfg, 200)]
    proposed = sum(s.proposed_by_proposer.get("lookup:target", 0) for s in stats)
    accepted = sum(s.acceptance_by_proposer.get("lookup:target", 0) * s.proposed_by_proposer.get("lookup:target", 0)
                   for s in stats)
    assert proposed >= 200  # at least one lookup token per sample on average
    assert accepted / proposed < 0.8, accepted / proposed


def _point_mass_counts(rule, n: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Tokens emitted at one position by verifying a lookup token x (point mass) against p."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(9)), -1)
    x = int(p.argmax())  # a likely token: many acceptances and many rejections
    law = torch.stack([p, p])
    counts = np.zeros(V)
    for _ in range(n):
        counts[_first_token(rule, x, law, g)] += 1
    law_np = p.double().numpy()
    return counts, law_np / law_np.sum()


def _first_token(rule, x, law, g) -> int:
    r = rule([x], None, law, g)
    return x if r.accepted == 1 else r.token


def test_point_mass_verification_follows_p():
    counts, p = _point_mass_counts(verify_stochastic)
    assert chi2_pvalue(counts, p) > 1e-3


def test_negative_control_broken_lookup_residual_fails():
    """A lookup rejection that resamples from p itself (not p without the rejected token)."""
    counts, p = _point_mass_counts(broken_lookup_only)
    assert chi2_pvalue(counts, p) < 1e-3


# -- repetition penalties --------------------------------------------------------------------
# Penalties below 1 / below 0 *encourage* repeats, and that is what gives these tests power: the
# random target rarely repeats a token on its own (P(x2 == x1) = 0.017 at T = 1), so a penalty
# that forbids repeats moves the joint law by little, while one that encourages them moves the
# diagonal by a lot. The processor is the same function of the prefix either way. (With two
# tokens, frequency and presence both count x1 once.) Fewer samples than above: the laws differ
# by far more than the broken residual's.
PENALTY = dict(repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=-1.0)
PENALTY_SAMPLES = 1000


@functools.lru_cache(maxsize=None)
def exact_joint_penalized(temperature: float, top_p: float = 1.0) -> np.ndarray:
    """P(x1, x2) under the target with PENALTY over the answer, from Hugging Face's forward, its
    RepetitionPenaltyLogitsProcessor (given the answer [x1] alone) and its warpers: [V, V]."""
    target, _, _, prompt = law_models()
    ids = torch.tensor(prompt)
    with torch.no_grad():
        p1 = hf_warp(target(ids[None]).logits[:, -1].double(), temperature, 0, top_p)[0]  # no answer yet
        both = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)  # [V, L+1]
        x1 = torch.arange(V)[:, None]  # [V, 1]: each row's answer
        rows = RepetitionPenaltyLogitsProcessor(PENALTY["repetition_penalty"])(x1, target(both).logits[:, -1].double())
        rows = rows - (PENALTY["frequency_penalty"] + PENALTY["presence_penalty"]) * torch.eye(V, dtype=rows.dtype)
        p2 = hf_warp(rows, temperature, 0, top_p)  # [V, V]
    joint = (p1[:, None] * p2).numpy()
    return joint / joint.sum()


def penalized_counts(mode: str, temperature: float = 1.0, top_p: float = 1.0, lookup: bool = False,
                     samples: int = PENALTY_SAMPLES) -> np.ndarray:
    return sample_counts(mode, temperature, top_p=top_p, lookup=lookup, penalty=PENALTY, samples=samples)


def test_penalties_really_move_the_law():
    """Power check of the setup: the penalised law is far from the plain one."""
    assert np.trace(exact_joint_penalized(1.0)) > 5 * np.trace(exact_joint(1.0))


# triforce (the paper's levels): the small draft's sampler, the retrieval level verifying it, the
# target verifying the retrieval level's tokens, at T = 0.8 and top-p 0.9 (the penalty comes
# first, as Hugging Face's processors before its warpers); retrieval with lookup: lookup runs
# and the retrieval level's tokens to the target.
# (The paper's levels cost most per sample: fewer, enough for a law this far from the plain one.)
@pytest.mark.parametrize("mode,lookup,temperature,top_p,samples",
                         [("triforce", False, 0.8, 0.9, 500), ("retrieval", True, 1.0, 1.0, PENALTY_SAMPLES)])
def test_joint_law_with_penalties_is_exact(mode, lookup, temperature, top_p, samples):
    counts = penalized_counts(mode, temperature, top_p, lookup, samples)
    p = chi2_pvalue(counts, exact_joint_penalized(temperature, top_p))
    assert p > 1e-3, f"{mode} (lookup {lookup}) with penalties: chi-square p = {p:.2e}"


def test_negative_control_penalties_ignored_fail():
    """Samples without the penalty do not pass as the penalised law."""
    counts = sample_counts("retrieval", 1.0, samples=PENALTY_SAMPLES)
    p = chi2_pvalue(counts, exact_joint_penalized(1.0))
    assert p < 1e-3, f"the penalty's effect was not detected (p = {p:.2e})"


def test_negative_control_round_start_prefix_fails(monkeypatch):
    """Every row of a round penalised from the round's start (the tokens drafted before the row
    inside it ignored), at every level: a second token verified in the first token's round
    escapes its penalty."""
    exact = Penalties.__call__

    def round_start(self, logits, committed, spec=(), extra=()):
        return exact(self, logits, committed, (), ())

    monkeypatch.setattr(Penalties, "__call__", round_start)
    p = chi2_pvalue(penalized_counts("retrieval"), exact_joint_penalized(1.0))
    assert p < 1e-3, f"penalties from the wrong prefix were not detected (p = {p:.2e})"


def test_penalty_on_the_target_alone_is_still_exact(monkeypatch):
    """Why the levels below are penalised for speed, not for exactness: the rule is exact for any
    law the proposer really drew from, so a proposer without the penalty (its q unpenalised,
    and its tokens drawn from that q) still gives the penalised target law. The controls that
    must fail are the ones above: the target's rows from the wrong prefix, or no penalty."""

    class ModelDraft(proposers.ModelDraft):
        def __init__(self, *args):
            super().__init__(*args[:4])  # without the decoder's penalties

    monkeypatch.setattr(speculation, "ModelDraft", ModelDraft)
    p = chi2_pvalue(penalized_counts("draft"), exact_joint_penalized(1.0))
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_row_argmax_gives_torch_argmax_indices():
    """Greedy verification reads each row's argmax through NumPy on the CPU: the same index as
    torch.argmax, the first on a tie, a NaN counting as the largest, for one row or several,
    contiguous or not (a vocabulary cut to the tokenizer's size is a strided view)."""
    from triforce_core.decoding.sampling import row_argmax

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(7, 300, generator=g)
    rows[1, 5] = rows[1, 9] = 50.0  # a tie: the first
    rows[2, 17] = float("nan")
    rows[3] = 0.0
    for x in (rows, rows[:, :250], rows[4], rows.double(), rows.t().contiguous().t()):
        want = x.argmax(dim=-1)
        assert row_argmax(x) == (want.tolist() if x.dim() > 1 else [int(want)])
    assert row_argmax(rows)[1:4] == [5, 17, 0]
