"""The inspector: why one token of an answer was kept, rejected or drawn. Pure functions.

A clicked token (a `ui.trace.Segment`) shows each verification it went through: who proposed
it and who checked it, q(x) and p(x), and the rule. Sampling: the draw u on a line from 0 to 1
against the acceptance region [0, min(1, p/q)); greedy: whether x was the verifier's argmax.
The figure pairs the top entries of p and q at that position, with the residual
norm(max(0, p - q)) after a rejection (the distribution left after removing what the proposer
already covered), the law the replacement was drawn from. Both name the answer they show
(`ui.render.answer_label`): a new answer clears them (`ui.views.teaching_updates`). Every value is
the one the rule used (`events.TokenCheck`), not recomputed.
"""

from __future__ import annotations

import html
from typing import Callable, Sequence

import plotly.graph_objects as go

from triforce_core.decoding.events import TokenCheck

from .figures import empty_figure
from .render import LEVEL_STYLE
from .trace import Segment

Decode = Callable[[Sequence[int]], str]
# Under the p/q chart: what its bars are.
SYMBOLS = ("p: the verifier's probability of each token; q: the proposer's;  residual: the distribution left "
           "<br>after removing what the proposer already covered, norm(max(0, p − q))")
NO_DATA = ("Turn on the teaching view before asking: it records p, q and the draw u of every proposed token "
           "(left off, decoding computes none of them).")


def _label(level: str) -> str:
    return LEVEL_STYLE.get(level, (level, ""))[0]


def _tok(decode: Decode, token: int) -> str:
    text = decode([token]).replace("\ufffd", "\u00b7")
    return repr(text)[1:-1] or "∅"


def _number_line(c: TokenCheck) -> str:
    """u against the acceptance region [0, min(1, p/q)) on a 0..1 line."""
    ratio = c.p / c.q if c.q > 0 else 1.0
    edge = 100.0 * min(1.0, ratio)
    u = 100.0 * c.u
    return (
        '<div class="tf-line" title="accepted if and only if u < p/q">'
        f'<div class="tf-line-accept" style="width:{edge:.1f}%"></div>'
        f'<div class="tf-line-u{" tf-line-no" if not c.accepted else ""}" style="left:{u:.1f}%"></div>'
        "</div>"
        f'<div class="tf-line-legend"><span>0</span><span>kept where the draw lands left of p/q = {ratio:.3f}</span>'
        f"<span>1</span></div>"
    )


def _check_block(c: TokenCheck, decode: Decode, replaced_by: int = -1) -> str:
    """One verification; `replaced_by`: for a rejection, the token the verifier drew instead."""
    verdict = "accepted" if c.accepted else "rejected"
    head = (f'<div class="tf-check tf-check-{verdict}"><b>{html.escape(_label(c.verifier))}</b> checked it: '
            f"<b>{verdict}</b>. q(x) = {c.q:.4f}: the proposer's probability of this token x "
            f"({html.escape(_label(c.proposer))}"
            f"{', a point mass: the lookup copies' if c.proposer == 'lookup' and c.q == 1.0 else ''}); "
            f"p(x) = {c.p:.4f}: the verifier's.")
    if c.u is None:
        best, p_best = c.p_top[0] if c.p_top else (c.token_id, c.p)
        rule = ("Greedy: kept if and only if x is the verifier's most likely token. "
                + ("It is." if c.accepted else
                   f"It is not: the verifier's argmax is «{html.escape(_tok(decode, best))}» (p {p_best:.4f}), "
                   "which replaces it."))
        return f"{head}<br>{rule}</div>"
    sign = "&lt;" if c.accepted else "≥"
    rule = (f"Sampling: kept with probability min(1, p/q): u, a uniform random draw between 0 and 1, must fall "
            f"below p/q; here u = {c.u:.4f} {sign} p/q = "
            f"{c.p / c.q if c.q > 0 else float('inf'):.4f}.")
    after = ""
    if not c.accepted:
        drawn = f" «{html.escape(_tok(decode, replaced_by))}»" if replaced_by >= 0 else ""
        share = dict(c.residual_top).get(replaced_by) if replaced_by >= 0 else None
        odds = f" (residual probability {share:.4f})" if share is not None else ""
        after = (f"<br>Rejected, so the replacement{drawn} was drawn from the residual norm(max(0, p − q)){odds}: "
                 "the distribution left after removing what the proposer already covered, i.e. the tokens where "
                 "p exceeds q, rescaled to sum to 1 (the grey bars).")
    return f"{head}<br>{rule}{_number_line(c)}{after}</div>"


def inspector_html(seg: Segment | None, decode: Decode, inspected: bool = True, label: str = "") -> str:
    """The panel's text for one clicked segment of an answer generated with (`inspected`) or
    without the rule's values; `label` names that answer (`ui.render.answer_label`)."""
    if seg is None:
        return ('<div class="tf-inspector tf-empty">Click a token of an answer (with the teaching view on, '
                "rejected drafts too) to see why it was kept.</div>")
    kind = "rejected proposal" if seg.kind == "rejected" else "token"
    of = f'<div class="tf-panel-of">In {html.escape(label)}</div>' if label else ""
    parts = [f'<div class="tf-inspector">{of}<div><b>«{html.escape(_tok(decode, seg.token_id))}»</b> · {kind} '
             f"proposed by the <b>{html.escape(_label(seg.level))}</b> · round {seg.round}</div>"]
    for k, c in enumerate(seg.checks):
        last = k == len(seg.checks) - 1  # the check that rejected it, when it was rejected
        parts.append(_check_block(c, decode, seg.replaced_by if last else -1))
    d = seg.drawn_from
    if d is not None:
        how = ("from the residual norm(max(0, p − q)), what is left of p after removing what the proposer covered"
               if d.u is not None else "as its argmax (greedy)")
        parts.append(f'<div class="tf-check tf-check-drawn">The <b>{html.escape(_label(d.verifier))}</b> rejected '
                     f"«{html.escape(_tok(decode, d.token_id))}» ({html.escape(_label(d.proposer))}) and drew this "
                     f"token itself, {how}.</div>")
        parts.append(_check_block(d, decode))
    if not seg.checks and d is None:
        if not inspected:
            note = NO_DATA
        elif seg.kind == "rejected":
            note = "Discarded unchecked: a proposal before it was rejected, and everything after a rejection goes."
        else:
            note = ("The full target's own token: every proposal of the round was accepted and it drew one more "
                    "from p (the bonus), or there was nothing to verify and it decoded alone.")
        parts.append(f'<div class="tf-check">{html.escape(note)}</div>')
    parts.append("</div>")
    return "".join(parts)


def inspector_figure(seg: Segment | None, decode: Decode, label: str = "") -> go.Figure:
    """Top entries of p and q (and the residual after a rejection) as paired bars; `label`
    names the answer (`ui.render.answer_label`)."""
    c = None
    if seg is not None:
        c = seg.drawn_from if seg.drawn_from is not None else (seg.checks[-1] if seg.checks else None)
    if c is None:
        return empty_figure("p and q", "Click a checked token to compare the two laws.")
    ids: list[int] = []
    for y, _ in c.p_top + c.q_top + c.residual_top:
        if y not in ids:
            ids.append(y)
    p, q, r = dict(c.p_top), dict(c.q_top), dict(c.residual_top)
    ids.sort(key=lambda y: -max(p.get(y, 0.0), q.get(y, 0.0)))
    ids = ids[:12]
    names = [f"{_tok(decode, y)}" + (" ◀" if y == c.token_id else "") for y in ids]
    # equal names would merge into one bar: make each unique
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        seen[n] = seen.get(n, 0) + 1
        if seen[n] > 1:
            names[i] = f"{n} ({ids[i]})"
    fig = go.Figure(layout=dict(
        title=dict(text=(f"{_escape(label)}<br>" if label else "") + f"p ({_label(c.verifier)}) and q "
                   f"({_label(c.proposer)}) · ◀ the proposed token", font=dict(size=12)),
        barmode="group", margin=dict(l=48, r=16, t=64 if label else 40, b=100), height=340, template="plotly_white",
        font=dict(size=12), yaxis=dict(title="probability"), legend=dict(orientation="h", y=1.02, x=1,
                                                                        xanchor="right", yanchor="bottom")))
    fig.add_bar(name="p (verifier)", x=names, y=[p.get(y) for y in ids], marker_color=LEVEL_STYLE[c.verifier][1],
                marker_line=dict(color="#555", width=1))
    fig.add_bar(name="q (proposer)", x=names, y=[q.get(y) for y in ids],
                marker_color=LEVEL_STYLE.get(c.proposer, ("", "#ddd"))[1], marker_line=dict(color="#555", width=1))
    if c.residual_top:
        fig.add_bar(name="residual", x=names, y=[r.get(y) for y in ids], marker_color="#9a9a9a")
    fig.add_annotation(text=SYMBOLS if c.residual_top else SYMBOLS.split(";  residual")[0], showarrow=False,
                       x=0, y=-0.42, xref="paper", yref="paper", xanchor="left", align="left", font=dict(size=10))
    return fig


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
