"""The decoding loop: TriForce's three levels and the single-level modes, one code path.

Structure (lanes in `lanes.py`, proposers and the round's choice among them in `proposers.py`,
proposal lengths in `schedule.py`, the retrieval level's refresh in `refresh.py`)
---------
A *lane* is one model running over one cache; it knows which token ids its cache holds, so
after any verification it can roll back to the longest common prefix with the current path by
setting the cache length (O(1)). A *proposer* produces speculative tokens and, for sampling,
the law each one was drawn from:

    autoregressive   no proposer: the target samples one token per forward
    lookup           Lookup (context n-gram match, no model)                      -> target verifies
    draft            ModelDraft(draft lane)                                       -> target verifies
    retrieval        ModelDraft(retrieval lane)                                   -> target verifies
    triforce         MiddleLevel(retrieval lane, ModelDraft(draft lane), gamma1)  -> target verifies

With `lookup` on (the default) every speculative mode first asks the context lookup: where the
sequence's last tokens recur in the context, the round is a lookup run straight to the target
(the target copies; a level in between could only cut the run short), and inside TriForce's
middle level the lookup stands in front of the small draft. A lookup proposal to the target
keeps a token while the chance that it and the tokens before it are accepted pays for its
verification row (`schedule.LookupLength`, at this machine's price of a row, `row_cost.py`):
where the text is copied, long proposals; where copies are rare, plain steps.

The middle level of TriForce verifies the small draft exactly (residual resampling), so each
token it emits follows the retrieval level's law p_mid given its prefix; that law is what the
target's verification uses as q. Every level therefore stays exact, and the committed tokens
follow the target's (warped) law, or equal its greedy output at temperature 0.

Invariant between rounds: every lane's cache holds the committed sequence except its last
token, which is "pending" and is the first input of the lane's next forward. (The small
draft's cache holds only sinks + a recent window of it; the retrieval cache a selection.)
The prefill (`prefill.py`, the `Prefill` half of `SpeculationLoop`) sets it up for a prompt.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from ..config import GenerationConfig, needs_draft
from ..detokenize import IncrementalDetokenizer
from .events import LEVELS, ChunksSelected, Committed, Event, Finished, GenerationStats, Prefilled
from ..kv import INT16, DiskCache, FullCache, RetrievalCache, StreamingCache, check_int16, new_full_cache, resolve_kv_dtype
from .lanes import Lane, RetrievalLane, StreamingLane
from .inspection import greedy_law, token_checks
from ..models.loading import sync_device
from ..models.transformer import Transformer
from .penalties import Penalties
from .prefill import Prefill
from .proposers import Counters, Lookup, MiddleLevel, ModelDraft, Proposal, RoundProposer, verified_event
from .refresh import RetrievalRefresh
from .sampling import VerifyResult, sample, verify_greedy, verify_stochastic, warp
from .row_cost import measured_row_cost
from .stop_text import StopText


class SpeculationLoop(Prefill):
    """Caches, lanes and proposers for one prompt; `run` yields the events of one generation.

    `prefill` (inherited from `Prefill`) runs the prompt once; `mark`/`restore` return to the
    post-prefill state so several samples of one prompt share a single prefill.
    """

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None,
        config: GenerationConfig,
        capacity: int,
        eos_ids: frozenset[int],
        generator: torch.Generator | None,
        detokenize=None,
        full_cache: FullCache | None = None,
        history: list[int] | None = None,
        disk: DiskCache | None = None,
        kv_dtype: str | None = None,
    ):
        """`full_cache` + `history` hand over a target cache from an earlier decoder (a chat
        session whose settings changed): `history[:full_cache.length]` are the tokens it holds;
        one of another K/V dtype is not used (its K/V are not what this dtype computes).
        `disk`: where prefilled blocks of the target's cache are read from and kept.
        `kv_dtype`: the caches' K/V dtype when the config names none (`CacheConfig.kv_dtype`;
        None: `kv.resolve_kv_dtype`'s default for each model)."""
        speculation, cc = config.speculation, config.cache
        if speculation.uses_draft_model and draft is None:
            raise ValueError(needs_draft(speculation.mode))
        self.target, self.draft, self.config = target, draft, config
        self.eos_ids = frozenset() if speculation.ignore_eos else eos_ids
        self.generator = generator
        self.disk = disk
        self.detokenize = detokenize
        shape = target.spec
        vocab = target.vocab_size
        margin = self.margin = speculation.cache_margin
        kv_name = cc.kv_dtype or kv_dtype
        self.kv_dtype = resolve_kv_dtype(kv_name, target.dtype, target.device, target.quantized, shape.head_dim,
                                         cc.chunk_size, shape.windowed)
        if self.kv_dtype == INT16:
            check_int16(shape.head_dim, cc.chunk_size)
        if full_cache is not None and full_cache.dtype != self.kv_dtype:
            full_cache, history = None, None
        if full_cache is None:
            full = new_full_cache(shape.num_layers, shape.num_kv_heads, shape.head_dim, capacity, self.kv_dtype,
                                  target.device)
        else:
            full = full_cache
            full.make_room(capacity)
        self.full = Lane(target, full, vocab)
        # Tokens of the current sequence: the full cache holds history[:full.covered].
        self.history: list[int] = list(history or [])[: full.length]
        self.full.covered = len(self.history)
        full.truncate(len(self.history))
        self.counters = Counters()
        self.retrieval: RetrievalLane | None = None
        self.small: StreamingLane | None = None
        if speculation.uses_retrieval:
            room = max(cc.refresh_every, 64) + margin
            rcache = RetrievalCache(full, cc.budget, cc.chunk_size, cc.recent, room, target.spec.sliding_windows)
            self.retrieval = RetrievalLane(target, rcache, vocab)
        if speculation.uses_draft_model:
            draft_shape = draft.spec
            scache = StreamingCache(
                draft_shape.num_layers, draft_shape.num_kv_heads, draft_shape.head_dim, cc.draft_sinks,
                cc.draft_window, margin,
                # an int16 target cache leaves the draft its default: a StreamingLLM window re-rotates
                # its keys, which float K/V do in one rounding
                draft.layer_rotary, resolve_kv_dtype(None if kv_name == "int16" else kv_name, draft.dtype, draft.device,
                                               draft.quantized), draft.device,
            )
            self.small = StreamingLane(draft, scache, vocab)
        sampling = config.sampling
        # One repetition-penalty processor for every level: each applies it to its own rows.
        self.penalties = pen = Penalties(sampling)
        self.lookup = (Lookup(speculation.lookup_min_match, speculation.lookup_agree, speculation.lookup_backoff)
                       if speculation.uses_lookup else None)
        # What one more verification row costs, in steps: lookup's proposals are cut where their
        # tokens stop paying for it (`schedule.LookupLength`). Measured once per machine and model.
        self.row_cost = None
        if self.lookup is not None:
            self.row_cost = speculation.lookup_row_cost
            if self.row_cost is None:
                self.row_cost = measured_row_cost(target, self.kv_dtype)
        if speculation.mode == "triforce":
            lower = ModelDraft(self.small, "draft", sampling, generator, pen, speculation.draft_confidence)
            self.proposer = MiddleLevel(self.retrieval, lower, speculation.gamma1, sampling, generator, self.counters,
                                        self.lookup, speculation.min_confidence, pen)
        elif speculation.mode == "retrieval":
            self.proposer = ModelDraft(self.retrieval, "retrieval", sampling, generator, pen)
        elif speculation.mode == "draft":
            self.proposer = ModelDraft(self.small, "draft", sampling, generator, pen, speculation.draft_confidence)
        else:
            self.proposer = None
        self.prompt: list[int] = []
        self.selection_event: ChunksSelected | None = None
        self._mark: tuple | None = None
        self.inspect = False
        self.answer_start: int | None = None  # `generate`'s: where a continued answer began in the prompt
        self.stops: tuple[str, ...] = ()  # `generate`'s: texts that end the answer (`stop_text`)

    # -- a generation: prefill (`Prefill`), then decoding ------------------------------------
    def generate(self, prompt: list[int], on_prefill_progress=None, progress_events: bool = False,
                 inspect: bool = False, boundary: int | None = None,
                 answer_start: int | None = None, stops: tuple[str, ...] = ()) -> Iterator[Event]:
        """One generation: prefill `prompt` (reusing the cached prefix), then decode.

        The one way the engine, chat sessions, cache slots and the bench run a generation.
        `on_prefill_progress(done, total)` is called after each prefill chunk; with
        `progress_events` a `PrefillProgress` event is also yielded there, so a scheduler can
        interleave other work with a long prefill (and close the generator to abort it).
        With `inspect`, each `Verified` event carries its `TokenCheck`s. `boundary`: where a
        document ends in the prompt (`Prefill.prefill_steps`). `answer_start`: where the answer
        begins in `prompt` when the prompt ends with an answer's first part (a continued answer):
        the penalties count the answer from there, as one longer generation's would, and the
        events' text follows that part's (None: the answer begins after the prompt). `stops`:
        texts that end the answer where its text reaches one (`stop_text.StopText`: the tokens
        before it are kept, the last event's text is cut there, the stop reason is "stop_text");
        they need the engine's detokenizer.
        """
        if stops and self.detokenize is None:
            raise ValueError("a stop text needs the model's tokenizer")
        self.set_inspect(inspect)
        self.answer_start = answer_start
        self.stops = tuple(stops)
        if progress_events:
            prefilled = yield from self.prefill_steps(prompt, on_prefill_progress, boundary)
        else:
            prefilled = self.prefill(prompt, on_prefill_progress, boundary)
        yield prefilled
        if self.selection_event is not None:
            yield self.selection_event
        yield from self.run(prefilled)

    def set_inspect(self, on: bool) -> None:
        """Report the verification rule's values (`TokenCheck`s) from now on, or stop."""
        self.inspect = on
        if self.proposer is not None:
            self.proposer.inspect = on

    def mark(self) -> None:
        """Remember the post-prefill state (call right after `prefill`)."""
        self._mark = tuple(
            None if lane is None else (lane.covered, list(lane.fed), list(lane.pending), lane.cache.snapshot())
            for lane in (self.full, self.retrieval, self.small)
        )

    def restore(self) -> None:
        """Return to the state saved by `mark` (O(budget + draft window), no prefill)."""
        assert self._mark is not None, "restore() without mark()"
        for lane, snap in zip((self.full, self.retrieval, self.small), self._mark):
            if lane is not None:
                covered, fed, pending, cache = snap
                lane.cache.restore(cache)
                lane.covered, lane.fed, lane.pending = covered, list(fed), list(pending)
        if self.lookup is not None and len(self.lookup.index.tokens) != len(self.prompt):
            self.lookup.index.reset(self.prompt)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.counters = Counters()
        if isinstance(self.proposer, MiddleLevel):
            self.proposer.counters = self.counters
        for lane in (self.full, self.retrieval, self.small):
            if lane is not None:
                lane.seconds, lane.forwards = 0.0, 0
        if self.lookup is not None:
            self.lookup.seconds, self.lookup.calls = 0.0, 0

    def _level_times(self) -> tuple[dict[str, float], dict[str, int]]:
        """Seconds and calls spent by each level during decoding."""
        seconds, calls = {}, {}
        for name, part in (("target", self.full), ("retrieval", self.retrieval), ("draft", self.small)):
            if part is not None:
                seconds[name], calls[name] = part.seconds, part.forwards
        if self.lookup is not None:
            seconds["lookup"], calls["lookup"] = self.lookup.seconds, self.lookup.calls
        return seconds, calls

    # -- decoding --------------------------------------------------------------------------
    def run(self, prefilled: Prefilled) -> Iterator[Event]:
        """Decode after `prefill`; yields Drafted/Verified/Committed/ChunksSelected, then Finished."""
        speculation = self.config.speculation
        committed = self.history = list(self.prompt)  # grows in place: the caches' token record
        # the answer, which the penalties count, starts here (a continued answer: where it began)
        start = len(committed) if self.answer_start is None else self.answer_start
        self.penalties.start = start
        proposer = RoundProposer(self.lookup, self.proposer, self.row_cost, speculation.lookup_max,
                                 speculation.gamma2, speculation.adaptive_gamma)
        refresh = None if self.retrieval is None else RetrievalRefresh(self.retrieval, self.config.cache, self.margin)
        detok = IncrementalDetokenizer(self.detokenize) if self.detokenize is not None else None
        if detok is not None:
            detok.ids = committed[start:]  # a continued answer's text goes on from its first part's
        stop = StopText(self.stops, self.detokenize, committed[start:]) if self.stops else None
        sent = len(stop.text) if stop is not None else 0  # characters of the answer's text said so far
        levels: list[str] = []  # who proposed each committed token of the answer
        rounds, stop_reason = 0, "max_new_tokens"
        t0 = time.perf_counter()
        while stop_reason == "max_new_tokens" and len(levels) < speculation.max_new_tokens:
            events: list[Event] = []
            # 1. Propose: lookup where the sequence's end recurs in the context and its tokens pay
            #    for their rows, else the levels below the target (lower levels first; they
            #    verify one another on the way).
            proposal = proposer.propose(committed, speculation.max_new_tokens - len(levels), events)
            # 2. Verify: the full target scores every proposed token in one forward, exactly.
            r, queries = self._verify(proposal, committed, refresh, events)
            proposer.update(proposal, r.accepted)
            rounds += 1
            # 3. Commit the accepted tokens and the target's own, up to EOS (kept) or the limit.
            new, by, eos = _accepted(proposal, r, speculation.max_new_tokens - len(levels), self.eos_ids)
            #    A stop text in them ends the answer: the tokens whose text begins at it or after are
            #    dropped, as a rejection's are (those kept are what the round commits without a stop).
            keep = stop.push(new) if stop is not None else None
            if keep is not None:
                new, by, eos = new[:keep], by[:keep], False
                stop_reason = "stop_text"
            committed += new
            levels += by
            stop_reason = "eos" if eos else stop_reason
            text = detok.push_text(new) if detok else ""
            if stop is not None and stop.cut is not None:
                text = text[: max(stop.cut - sent, 0)]
            sent += len(text)
            # Committed precedes a refresh's ChunksSelected (the order documented in events.py).
            events.append(Committed(tuple(new), tuple(by), text))
            # 4. Refresh: every lane rolls back to the committed sequence (O(1) per cache), and the
            #    retrieval level selects its chunks again when they are stale.
            done = stop_reason != "max_new_tokens" or len(levels) >= speculation.max_new_tokens
            self._roll_back(committed, len(new), done, refresh, queries, r.accepted, rounds, events)
            yield from events
        sync_device(self.target.device)
        refreshes = refresh.count if refresh is not None else 0
        yield Finished(self._stats(prefilled, levels, rounds, refreshes, stop_reason, time.perf_counter() - t0))

    def _verify(self, proposal: Proposal, committed: list[int], refresh: RetrievalRefresh | None,
                events: list[Event]) -> tuple[VerifyResult, torch.Tensor | None]:
        """The target's forward over `proposal` and its exact verification against the target's
        law; with a retrieval level also the forward's queries (and, when the selection follows
        the target's attention, what each chunk received)."""
        sampling = self.config.sampling
        self.full.sync(committed, [])
        queries = probe = None
        if refresh is not None:
            probe = refresh.probe(proposal)
            logits, queries, first_row = self.full.advance(proposal.tokens, capture_queries=True, key_mass=probe)
        else:
            logits = self.full.advance(proposal.tokens)
        # Row i follows committed + proposal.tokens[:i]: its penalty counts exactly that prefix.
        logits = self.penalties(logits, committed, (), proposal.tokens)
        if sampling.greedy:
            r = verify_greedy(proposal.tokens, logits)
            p = greedy_law(logits) if self.inspect else None
        else:
            p = warp(logits, sampling)
            if proposal.tokens:
                r = verify_stochastic(proposal.tokens, proposal.laws, p, self.generator)
            else:
                r = _bonus_only(p[0], self.generator)
        if proposal.tokens:
            self.counters.add("target", proposal.levels, r.accepted)
            # who drew each token from the law q the rule used: the middle level's p_mid for all it emitted
            proposers = [proposal.law_level] * len(proposal.tokens) if proposal.law_level else proposal.levels
            checks = token_checks("target", proposal.tokens, proposers, proposal.laws, p, r) if self.inspect else ()
            events.append(verified_event("target", proposal.tokens, r, checks))
        if refresh is not None:
            refresh.verified(proposal, r.accepted, probe, first_row)
        return r, queries

    def _roll_back(self, committed: list[int], new: int, done: bool, refresh: RetrievalRefresh | None,
                   queries: torch.Tensor | None, row: int, step: int, events: list[Event]) -> None:
        """Every lane to `committed` (`new` tokens more); the lower ones only while decoding goes
        on, the retrieval lane by `refresh` (a new selection's ChunksSelected joins `events`)."""
        self.full.commit(committed)
        if self.lookup is not None:
            self.lookup.commit(committed)
        if done:
            return
        if self.small is not None:
            self.small.commit(committed)
        if refresh is not None:
            sel = refresh.commit(committed, new, queries, row)
            if sel is not None:
                events.append(self._selection_event(sel, step))

    def _stats(self, prefilled: Prefilled, levels: list[str], rounds: int, refreshes: int, stop_reason: str,
               decode_s: float) -> GenerationStats:
        c = self.counters
        level_s, level_calls = self._level_times()
        return GenerationStats(
            prompt_tokens=len(self.prompt),
            new_tokens=len(levels),
            prefill_s=prefilled.seconds,
            decode_s=decode_s,
            tokens_per_s=len(levels) / decode_s if decode_s > 0 else 0.0,
            rounds=rounds,
            mean_accepted=len(levels) / rounds if rounds else 0.0,
            proposed=dict(c.proposed),
            accepted=dict(c.accepted),
            acceptance={k: (c.accepted.get(k, 0) / v if v else 0.0) for k, v in c.proposed.items()},
            committed_by_level={name: levels.count(name) for name in LEVELS},
            refreshes=refreshes,
            stop_reason=stop_reason,
            mode=self.config.speculation.mode,
            reused_tokens=prefilled.reused_tokens,
            disk_tokens=prefilled.disk_tokens,
            acceptance_by_proposer={k: c.pair_accepted.get(k, 0) / v for k, v in c.pair_proposed.items() if v},
            proposed_by_proposer=dict(c.pair_proposed),
            level_seconds=level_s,
            level_calls=level_calls,
        )


def _accepted(proposal: Proposal, r: VerifyResult, room: int, eos_ids: frozenset[int]):
    """The tokens a round commits and who proposed each: the accepted part of `proposal` and the
    target's own token, at most `room`, ending at the first EOS (kept). Returns (tokens, levels,
    whether an EOS ended them)."""
    new = (proposal.tokens[: r.accepted] + [r.token])[:room]
    levels = (proposal.levels[: r.accepted] + ["target"])[:room]
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1], levels[: i + 1], True
    return new, levels, False


def _bonus_only(p: torch.Tensor, generator) -> VerifyResult:
    return VerifyResult(accepted=0, token=sample(p, generator), bonus=True)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
