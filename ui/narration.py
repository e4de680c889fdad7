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


def _quote(text: str) -> str:
    shown = text.replace("\n", "⏎")
    return f"«{shown}»"


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
            text += f", rejected {_quote(rejected.text)}{why} and drew {_quote(own.text)} {source}"
        elif own is not None and at == pt:
            text += f", then added its own bonus token {_quote(own.text)}"
        parts.append(text)
    words = "".join(s.text for s in committed)
    parts.append(f"{len(committed)} token{'s' * (len(committed) != 1)} committed: {_quote(words)}")
    return f"Round {n}: " + "; ".join(parts) + "."


def _first_target_rejection(segs: list[Segment]) -> Segment | None:
    return next((s for s in segs if s.rejected_by == "target"), None)


def narration_html(trace: AnswerTrace | None, last: int = 4, waiting: bool = False, auto_step: bool = False) -> str:
    """The last rounds' sentences, newest last; `waiting`: the generation waits for Step
    (`auto_step`: the lesson, whose next round follows by itself)."""
    if trace is None or not trace.rounds:
        return '<div class="tf-narration tf-empty">Each round of speculation is described here.</div>'
    n = len(trace.rounds)
    items = "".join(f"<li>{html.escape(round_sentence(trace, k))}</li>" for k in range(max(1, n - last + 1), n + 1))
    nxt = ("The next round follows in a second, or press <b>Step</b>." if auto_step
           else "Press <b>Step</b> for the next round.")
    tail = f'<div class="tf-narration-next">{nxt}</div>' if waiting else ""
    colours = " ".join(f'<span class="tf-tok tf-{lvl}">{label}</span>' for lvl, (label, _) in LEVEL_STYLE.items())
    return f'<div class="tf-narration"><ol start="{max(1, n - last + 1)}">{items}</ol>{tail}<div>{colours}</div></div>'
