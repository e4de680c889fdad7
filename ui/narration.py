"""One sentence per speculation round, for a teacher stepping through a generation. Pure.

Read from an answer's trace (`ui.trace.AnswerTrace`): who proposed, what each verifier kept,
which draw decided a rejection (with `inspect=True`), and what was committed.
"""

from __future__ import annotations

import html

from .render import LEVEL_STYLE
from .trace import AnswerTrace, Segment, check_summary

LOWER = {"lookup": "the context lookup", "draft": "the small draft", "retrieval": "the retrieval level",
         "target": "the full target"}


# A piece of text the page could not show as it is: an empty one, or one of blanks alone.
EMPTY_PIECE = "a token with no text of its own (the end of the answer, or part of a character the next token completes)"
BLANKS = {"\n": "⏎", " ": "␣", "\t": "⇥"}


def quoted(text: str) -> str:
    """A token's text in «», never «» nor a blank that reads as nothing: a newline shows as ⏎
    everywhere; a piece of blanks alone shows each blank (␣ a space, ⇥ a tab)."""
    if text == "":
        return EMPTY_PIECE
    if not text.strip():
        return "«" + "".join(BLANKS.get(c, c) for c in text) + "»"
    return "«" + text.replace("\n", "⏎") + "»"


def round_sentence(trace: AnswerTrace, n: int) -> str:
    """What happened in round `n` (1-based), in plain words."""
    if not 1 <= n <= len(trace.rounds):
        return ""
    segs = [s for s in trace.segments if s.round == n and s.kind != "round"]
    stats = trace.rounds[n - 1]
    committed = [s for s in segs if s.kind == "token"]
    proposers = []
    for s in segs:
        if s.level != "target" and s.level not in proposers:
            proposers.append(s.level)
    parts = []
    if not proposers and not stats.proposed:
        parts.append("nothing was proposed, so the full target decoded one token alone")
    else:
        parts.append(" and ".join(LOWER[p] for p in proposers) + " proposed")
    pr, ar = stats.proposed.get("retrieval", 0), stats.accepted.get("retrieval", 0)
    if pr:
        parts.append(f"the retrieval level checked {pr} token{'s' * (pr != 1)} from below and kept {ar}")
    pt, at = stats.proposed.get("target", 0), stats.accepted.get("target", 0)
    if pt:
        text = f"the full target checked {pt} and accepted {at}"
        rejected = _first_target_rejection(segs)
        own = committed[-1] if committed and committed[-1].level == "target" else None
        if rejected is not None and own is not None:
            c = next((c for c in rejected.checks if c.verifier == "target"), None)
            why = f" ({check_summary(c).split(': ', 1)[1]})" if c is not None else ""
            source = "from the residual" if c is not None and c.u is not None else "itself"
            text += f", rejected {quoted(rejected.text)}{why} and drew {quoted(own.text)} {source}"
        elif own is not None and at == pt:
            text += f", then added its own bonus token {quoted(own.text)}"
        parts.append(text)
    words = "".join(s.text for s in committed)
    count = f"{len(committed)} token{'s' * (len(committed) != 1)} committed"
    if pt and len(committed) < at:  # the answer's end (or its token limit) came within the accepted ones
        count += " (the answer ended within them)"
    shown = quoted(words) if words or len(committed) <= 1 else "tokens with no text of their own"
    parts.append(f"{count}: {shown}")
    return f"Round {n}: " + "; ".join(parts) + "."


def _first_target_rejection(segs: list[Segment]) -> Segment | None:
    return next((s for s in segs if s.rejected_by == "target"), None)


# Under the rounds: what the symbols of their sentences mean.
SYMBOLS = ("p: the verifier's probability of the token; q: the proposer's; u: a uniform random draw between 0 and 1 "
           "(a proposal is kept when u < p/q, so with probability min(1, p/q)); greedy: kept if and only if it is "
           "the verifier's likeliest token (its argmax). The residual is the distribution left after removing what "
           "the proposer already covered, norm(max(0, p − q)): a rejected proposal's replacement is drawn from it.")


def narration_html(trace: AnswerTrace | None, waiting: bool = False, auto_step: bool = False, label: str = "") -> str:
    """Every round's sentence, in a list that scrolls (app.css), newest last; `label`: which answer
    it describes (`ui.render.answer_label`); `waiting`: the generation waits for Step
    (`auto_step`: the lesson, whose next round follows by itself)."""
    if trace is None or not trace.rounds:
        return '<div class="tf-narration tf-empty">Each round of speculation is described here.</div>'
    n = len(trace.rounds)
    items = "".join(f"<li>{html.escape(round_sentence(trace, k))}</li>" for k in range(1, n + 1))
    nxt = ("The next round follows in a second, or press <b>Step</b>." if auto_step
           else "Press <b>Step</b> for the next round.")
    tail = f'<div class="tf-narration-next">{nxt}</div>' if waiting else ""
    head = f'<div class="tf-narration-head">{_count(n, "round")} of {html.escape(label)}</div>' if label else ""
    colours = " ".join(f'<span class="tf-tok tf-{lvl}">{name}</span>' for lvl, (name, _) in LEVEL_STYLE.items())
    return (f'<div class="tf-narration">{head}<ol class="tf-rounds">{items}</ol>{tail}<div>{colours}</div>'
            f'<div class="tf-symbols">{html.escape(SYMBOLS)}</div></div>')


def _count(n: int, one: str) -> str:
    return f"{n} {one}{'s' * (n != 1)}"


def levels_summary(trace: AnswerTrace) -> str:
    """Which level produced what in one answer, counted from its trace: each colour's tokens
    (the full target's split into replacements after its rejections and bonus tokens), and the
    struck-through drafts by the level that rejected them."""
    tokens = [s for s in trace.segments if s.kind == "token"]
    rejected = [s for s in trace.segments if s.kind == "rejected"]
    by = {level: sum(1 for s in tokens if s.level == level) for level in LEVEL_STYLE}
    target_rejected = {s.round for s in rejected if s.rejected_by == "target"}
    replaced = sum(1 for s in tokens if s.level == "target" and s.round in target_rejected)
    parts = []
    if by["lookup"]:
        parts.append(f"{by['lookup']} yellow (copied by the context lookup from earlier in the context)")
    if by["draft"]:
        parts.append(f"{by['draft']} green (the small draft's guesses that the retrieval level and the full target "
                     "both kept)")
    if by["retrieval"]:
        parts.append(f"{by['retrieval']} blue (the retrieval level's own: drawn where it rejected a guess, or "
                     "proposed after the kept ones)")
    if by["target"]:
        parts.append(f"{by['target']} red (the full target's own: {replaced} drawn where it rejected a proposal, "
                     f"{by['target'] - replaced} bonus after a round it accepted whole)")
    text = f"Its answer: {_count(len(tokens), 'token')} over {_count(len(trace.rounds), 'round')}"
    text += (": " + ", ".join(parts) + ".") if parts else "."
    if rejected:
        lower = sum(1 for s in rejected if s.rejected_by == "retrieval")
        why = [f"{lower} at the retrieval level's check"] if lower else []
        why += [f"{len(rejected) - lower} at the full target's"] if len(rejected) > lower else []
        text += (f" Struck through: {_count(len(rejected), 'rejected proposal')} ({', '.join(why)}; a rejection also "
                 "discards the proposals after it).")
    return text
