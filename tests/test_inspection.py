"""`inspect=True`: the numbers the verification rule used, checked against Hugging Face.

For every `TokenCheck` the target made, p(x) and the top of p are recomputed with Hugging
Face's model at the same prefix (within 1e-4); every decision is checked against the rule:
u * q < p when sampling, x == argmax p when greedy; after a rejection the replacement comes
from the residual (sampling) or is the argmax (greedy). A deliberately broken report (p read
one row off) must fail the same checks.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from tests.helpers.models import DRAFT_OVERRIDES, make_hf, to_ours

import triforce_core.decoding.loop as speculation
from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TokenCheck, TriForceEngine
from triforce_core.config import PAPER_METHOD
from triforce_core.decoding.events import Committed, Finished, Prefilled, Verified
from triforce_core.decoding.inspection import token_checks

TOL = 1e-4
# float32 K/V, as Hugging Face's model keeps them: the reported p is compared with its law at 1e-4
# (float16 K/V move p by ~3e-4; that the rule used them is what tests/test_kv_dtype.py checks).
CACHE = CacheConfig(budget=32, chunk_size=4, recent_tokens=8, draft_sinks=4, draft_window=16, refresh_every=8,
                    kv_dtype="float32")
TEMPERATURE = 0.8


@functools.lru_cache(maxsize=None)
def _models():
    target = make_hf("llama_gqa_llama3", seed=0)
    draft = make_hf("llama_gqa_llama3", seed=11, **DRAFT_OVERRIDES)
    g = torch.Generator().manual_seed(5)
    head = torch.randint(3, target.config.vocab_size, (40,), generator=g).tolist()
    # a recurring stretch, so that the context lookup proposes too
    prompt = head + head[:24] + torch.randint(3, target.config.vocab_size, (20,), generator=g).tolist() + head[:6]
    return target, to_ours(target), to_ours(draft), prompt


def _config(mode: str, greedy: bool, lookup: bool, seed: int = 0) -> GenerationConfig:
    spec = dict(mode=mode, gamma1=2, gamma2=4, max_new_tokens=40, ignore_eos=True, lookup=lookup)
    if not lookup:
        spec.update(PAPER_METHOD)
    return GenerationConfig(
        sampling=SamplingConfig(temperature=0.0 if greedy else TEMPERATURE, seed=seed),
        speculation=SpeculationConfig(**spec), cache=CACHE)


def _generate(mode: str, greedy: bool, lookup: bool, inspect: bool = True, seed: int = 0):
    _, t, d, prompt = _models()
    events = list(TriForceEngine(t, d).generate(prompt, _config(mode, greedy, lookup, seed), inspect=inspect))
    return prompt, events


def _hf_laws(sequence: list[int], greedy: bool) -> torch.Tensor:
    """Hugging Face's law of the next token after each prefix of `sequence`: [len, V]."""
    target = _models()[0]
    with torch.no_grad():
        logits = target(torch.tensor(sequence)[None]).logits[0].double()
    return logits.softmax(-1) if greedy else (logits / TEMPERATURE).softmax(-1)


def problems(prompt: list[int], events: list, greedy: bool) -> list[str]:
    """Every way the reported checks disagree with Hugging Face or with the rule."""
    committed = list(prompt)
    out: list[str] = []
    target_checks: list[tuple[int, TokenCheck]] = []  # (prefix length, check)
    for ev in events:
        if isinstance(ev, Verified):
            if len(ev.checks) != ev.accepted + (ev.resampled_id is not None):
                out.append(f"{len(ev.checks)} checks for {ev.accepted} accepted, resampled {ev.resampled_id}")
            for i, c in enumerate(ev.checks):
                rejected = i == ev.accepted
                if c.accepted == rejected:
                    out.append(f"check {i}: accepted={c.accepted} but the event accepted {ev.accepted}")
                if greedy:
                    if c.u is not None:
                        out.append("greedy check with a u")
                    if c.accepted != (c.token_id == c.p_top[0][0]):
                        out.append(f"greedy decision {c.accepted} for {c.token_id}, argmax {c.p_top[0][0]}")
                    if rejected and ev.resampled_id != c.p_top[0][0]:
                        out.append(f"greedy replacement {ev.resampled_id} is not the argmax {c.p_top[0][0]}")
                else:
                    if c.accepted != (c.u * c.q < c.p):
                        out.append(f"decision {c.accepted} with u {c.u}, q {c.q}, p {c.p}")
                    if rejected and not c.residual_top:
                        out.append("a rejection without its residual")
                    if rejected and c.proposer == "lookup":  # residual = p without x, renormalised
                        for y, r in c.residual_top:
                            py = dict(c.p_top).get(y)
                            if py is not None and abs(r - py / (1 - c.p)) > TOL:
                                out.append(f"lookup residual {r} for {y}, expected {py / (1 - c.p)}")
                if c.proposer == "lookup" and (c.q != 1.0 or c.q_top != ((c.token_id, 1.0),)):
                    out.append(f"lookup q {c.q} {c.q_top}")
                if abs(c.p - dict(c.p_top).get(c.token_id, c.p)) > 1e-6:
                    out.append("p(x) disagrees with p_top")
                if ev.level == "target":
                    accepted_before = [x.token_id for x in ev.checks[:i]]
                    target_checks.append((len(committed) + len(accepted_before), c))
        elif isinstance(ev, Committed):
            committed += ev.token_ids
    # The prefix of every target check is a prefix of the final sequence (the accepted tokens
    # stay; after a rejection the replacement follows): one forward scores them all.
    laws = _hf_laws(committed, greedy)
    for n, c in target_checks:
        law = laws[n - 1]
        if abs(float(law[c.token_id]) - c.p) > TOL:
            out.append(f"p({c.token_id}) after {n} tokens: reported {c.p}, Hugging Face {float(law[c.token_id])}")
        for y, py in c.p_top:
            if abs(float(law[y]) - py) > TOL:
                out.append(f"p_top entry {y}: reported {py}, Hugging Face {float(law[y])}")
        kth = float(law.topk(len(c.p_top)).values[-1])
        if any(py < kth - TOL for _, py in c.p_top):
            out.append(f"p_top {c.p_top} is not the top of Hugging Face's law")
    if not target_checks:
        out.append("no target checks at all")
    return out


CASES = [("triforce", False), ("triforce", True), ("retrieval", False), ("draft", False), ("lookup", True)]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode,lookup", CASES, ids=[f"{m}{'+lookup' if lk else ''}" for m, lk in CASES])
def test_checks_are_the_rules_values(mode, lookup, greedy):
    prompt, events = _generate(mode, greedy, lookup)
    assert problems(prompt, events, greedy) == []
    checks = [c for ev in events if isinstance(ev, Verified) for c in ev.checks]
    # the cases really exercise what they name: rejections, and each proposing level
    assert any(not c.accepted for c in checks)
    want = {"triforce": {"draft", "retrieval"}, "retrieval": {"retrieval"}, "draft": {"draft"}, "lookup": set()}
    assert want[mode] - ({"draft"} if lookup else set()) <= {c.proposer for c in checks}
    if lookup:
        assert "lookup" in {c.proposer for c in checks}
    if mode == "triforce" and not lookup:
        assert {c.verifier for c in checks} == {"retrieval", "target"}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_the_targets_checks_of_what_the_middle_level_emitted_name_the_retrieval_level(greedy):
    """A row priced at a whole step: the target-level lookup proposes nothing, so the lookup runs
    reach the target inside the retrieval level's speculation, drawn from its law p_mid. The
    target's checks of those tokens report p_mid as q under the retrieval level's name, never
    as a lookup's point mass (a path a measured row price takes only now and then). The demo
    pair copies its document, so the retrieval level accepts lookup runs here."""
    from tests.helpers import ROOT
    from triforce_core.models.loading import DEMO_DRAFT, DEMO_TARGET

    engine = TriForceEngine.from_pretrained(str(DEMO_TARGET), str(DEMO_DRAFT), device="cpu")
    text = (ROOT / "assets" / "sample" / "python-tutorial-classes.txt").read_text(encoding="utf-8")[:3000]
    config = GenerationConfig(
        sampling=SamplingConfig(temperature=0.0 if greedy else TEMPERATURE, seed=1),
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=48, ignore_eos=True, lookup=True,
                                      lookup_row_cost=1.0),
        cache=CacheConfig(budget=256, chunk_size=8))
    events = list(engine.generate(engine.encode(text + "\n\n" + text[:400]), config, inspect=True))
    checks = {level: [c for ev in events if isinstance(ev, Verified) and ev.level == level for c in ev.checks]
              for level in ("retrieval", "target")}
    committed = [lvl for ev in events if isinstance(ev, Committed) for lvl in ev.levels]
    # the path ran: the middle level accepted lookup tokens, and they were committed
    assert any(c.proposer == "lookup" and c.accepted for c in checks["retrieval"]) and "lookup" in committed
    assert checks["target"] and {c.proposer for c in checks["target"]} == {"retrieval"}
    for c in checks["retrieval"] + checks["target"]:
        if c.proposer == "lookup":
            assert c.q == 1.0 and c.q_top == ((c.token_id, 1.0),)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_inspect_changes_nothing_else(greedy):
    """Same tokens, same events (but for the checks) with inspect on and off; off reports none."""
    _, on = _generate("triforce", greedy, lookup=True, inspect=True, seed=3)
    _, off = _generate("triforce", greedy, lookup=True, inspect=False, seed=3)
    assert all(not ev.checks for ev in off if isinstance(ev, Verified))
    def same(events):  # all but timings and the checks
        return [replace(ev, checks=()) if isinstance(ev, Verified) else ev for ev in events
                if not isinstance(ev, (Prefilled, Finished))]

    assert same(on) == same(off)
    assert any(ev.checks for ev in on if isinstance(ev, Verified))


def test_negative_control_wrong_row_fails(monkeypatch):
    """A report that reads p one row too far (the next position's law) is caught."""

    def off_by_one(verifier, tokens, levels, q, p, result):
        return token_checks(verifier, tokens, levels, q, torch.cat([p[1:], p[-1:]]), result)

    monkeypatch.setattr(speculation, "token_checks", off_by_one)
    prompt, events = _generate("triforce", False, lookup=True)
    assert any("Hugging Face" in m for m in problems(prompt, events, greedy=False))


def test_negative_control_wrong_decision_fails(monkeypatch):
    """A report whose u is not the rule's draw is caught by the decision check."""

    def fresh_u(verifier, tokens, levels, q, p, result):
        return tuple(replace(c, u=1.0 - c.u) for c in token_checks(verifier, tokens, levels, q, p, result))

    monkeypatch.setattr(speculation, "token_checks", fresh_u)
    prompt, events = _generate("draft", False, lookup=False)
    assert any(m.startswith("decision") for m in problems(prompt, events, greedy=False))
