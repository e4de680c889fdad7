"""An answer as the page shows it: its text rendered as Markdown (markdown-it-py, CommonMark
with tables), each character coloured by the level that proposed its token, words whole.

The rendered text is nearly a subsequence of the answer's source (Markdown's marks, link
targets and indentation drop out; entities and escapes turn into the characters they stand
for), so every character of every text the renderer writes is matched to its place in the
source: a pointer walks the source to the next equal character, reset at each block's first
line (the parser's line map) so one unmatched character cannot shift the rest of the answer.
Its source offset names its token, hence its level.

Each maximal run of one token inside one text of the rendering becomes
`<span class="tf-tok tf-LEVEL" data-tf="turn:segment" title="...">`: the first piece of each
token has class `tf-tok`, a later piece of the same token (a token across a paragraph break
or into bold text) has `tf-tok-more`, and a token with no visible character (a Markdown mark,
a blank line) still has an empty `tf-tok`, so the page holds one `tf-tok` per token, in order.
The spans have no borders, padding or margins (app.css): the colours sit behind whole words.

An answer is untrusted text: raw HTML in it is shown as text, never run; links open in a new
tab with rel="noopener nofollow noreferrer"; an image is shown as its description, never
fetched. Code blocks keep the colours and get a copy button (assets/app.js).
"""

from __future__ import annotations

import html
import re
from typing import Sequence

from markdown_it import MarkdownIt

from .render import LEVEL_STYLE, segments_html

# How far ahead of the pointer a rendered character is looked for in the source: a link's
# target is skipped this way; a character with no match in reach (an entity's) stays where
# the pointer is. A bound keeps the walk linear in the answer's length.
REACH = 512
_LINES = re.compile(r"\r\n?|\n")  # what markdown-it counts as a line break


class _Aligner:
    """Each rendered character's token: the walk over the source described in the module docstring."""

    def __init__(self, pieces: Sequence[str], tokens: Sequence, key: int | None):
        self.source = "".join(pieces)
        self.owner: list[int] = []  # source character -> index of its token
        self.starts = [0]  # token -> offset of its first source character (and the end)
        for i, piece in enumerate(pieces):
            self.owner.extend([i] * len(piece))
            self.starts.append(self.starts[-1] + len(piece))
        self.lines = [0] + [m.end() for m in _LINES.finditer(self.source)]
        self.tokens = tokens
        self.key = key
        self.pos = 0  # next source character to match
        self.last = -1  # the last token given a span

    def at_line(self, line: int | None) -> None:
        """A block begins at this line of the source: its text is not before it."""
        if line is not None and 0 <= line < len(self.lines):
            self.pos = max(self.pos, self.lines[line])

    def _match(self, ch: str, loose: bool) -> int:
        """The token of rendered character `ch`, advancing the pointer past its source."""
        src, n = self.source, len(self.source)
        if n == 0:
            return -1
        end = min(n, self.pos + REACH)
        at = src.find(ch, self.pos, end)
        if loose and ch == " ":  # inline code writes its line breaks as spaces
            nl = src.find("\n", self.pos, end if at < 0 else at)
            at = nl if nl >= 0 else at
        if at < 0:
            return self.owner[min(self.pos, n - 1)]
        self.pos = at + 1
        return self.owner[at]

    def _span(self, index: int, text: str, first: bool) -> str:
        seg = self.tokens[index]
        label = LEVEL_STYLE.get(seg.level, (seg.level,))[0]
        title = html.escape(f"{label} · {seg.note}" if seg.note else label)
        data = f' data-tf="{self.key}:{seg.index}"' if self.key is not None else ""
        cls = "tf-tok" if first else "tf-tok-more"
        return f'<span class="{cls} tf-{seg.level}" title="{title}"{data}>{html.escape(text)}</span>'

    def _upto(self, index: int) -> list[str]:
        """Empty spans for the tokens before `index` that have no rendered character."""
        out = [self._span(i, "", True) for i in range(self.last + 1, index)]
        self.last = max(self.last, index - 1)
        return out

    def wrap(self, text: str, loose: bool = False) -> str:
        """A text of the rendering as coloured spans (escaped)."""
        if not self.tokens:
            return html.escape(text)
        src = self.source
        at = -1 if loose or not text else src.find(text, self.pos, self.pos + REACH + len(text))
        if at >= 0:  # the usual case: the text is a stretch of the source, cut at its tokens' ends
            out = []
            end = at + len(text)
            j = at
            while j < end:
                owner = self.owner[j]
                stop = min(end, self.starts[owner + 1])
                out.append(self._piece(owner, text[j - at:stop - at]))
                j = stop
            self.pos = end
            return "".join(out)
        out: list[str] = []
        run_owner, run_start = None, 0
        for j, ch in enumerate(text):
            owner = self._match(ch, loose)
            if owner != run_owner:
                if run_owner is not None:
                    out.append(self._piece(run_owner, text[run_start:j]))
                run_owner, run_start = owner, j
        if run_owner is not None:
            out.append(self._piece(run_owner, text[run_start:]))
        return "".join(out)

    def _piece(self, owner: int, text: str) -> str:
        if owner < 0:
            return html.escape(text)
        out = self._upto(owner)
        first = owner > self.last
        self.last = max(self.last, owner)
        out.append(self._span(owner, text, first))
        return "".join(out)

    def rest(self) -> str:
        """Empty spans for the tokens after the last one shown (a trailing blank line, a closing mark)."""
        return "".join(self._upto(len(self.tokens)))


class _Token:
    """A committed token of the answer as the spans need it."""

    __slots__ = ("index", "level", "note")

    def __init__(self, index: int, level: str, note: str):
        self.index, self.level, self.note = index, level, note


def _aligner(env, token) -> _Aligner | None:
    """This render's aligner (None: no colours), moved to `token`'s block when it is a block's first text."""
    al = env.get("tf") if isinstance(env, dict) else None
    if al is not None:
        al.at_line(token.meta.get("tf_line"))
    return al


def _text(self, tokens, idx, options, env):
    al = _aligner(env, tokens[idx])
    content = tokens[idx].content
    return al.wrap(content) if al is not None else html.escape(content)


def _break(tag: str):
    def rule(self, tokens, idx, options, env):
        al = _aligner(env, tokens[idx])
        return tag + (al.wrap("\n") if al is not None else "\n")
    return rule


def _code_inline(self, tokens, idx, options, env):
    al = _aligner(env, tokens[idx])
    content = tokens[idx].content
    body = al.wrap(content, loose=True) if al is not None else html.escape(content)
    return f"<code>{body}</code>"


COPY_CODE = '<button type="button" class="tf-copy-code" title="Copy the code" aria-label="Copy the code"></button>'


def _code(self, tokens, idx, options, env):
    """A fenced or indented code block: coloured like the text, with a copy button (its label
    is drawn by app.css, so the answer's text stays the answer's)."""
    token = tokens[idx]
    al = _aligner(env, token)
    if al is not None and token.map:
        al.at_line(token.map[0] + (1 if token.type == "fence" else 0))
    body = al.wrap(token.content) if al is not None else html.escape(token.content)
    info = token.info.strip().split(maxsplit=1)[0] if token.type == "fence" and token.info.strip() else ""
    lang = f' class="language-{html.escape(info)}"' if info else ""
    return f'<div class="tf-code">{COPY_CODE}<pre><code{lang}>{body}</code></pre></div>\n'


def _image(self, tokens, idx, options, env):
    """An image as its description: an answer's text fetches nothing."""
    token = tokens[idx]
    _aligner(env, token)
    return f'<span class="tf-image">{self.renderInline(token.children or [], options, env)}</span>'


def _link_open(self, tokens, idx, options, env):
    token = tokens[idx]
    token.attrSet("target", "_blank")
    token.attrSet("rel", "noopener nofollow noreferrer")
    return self.renderToken(tokens, idx, options, env)


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    for name, rule in (("text", _text), ("softbreak", _break("")), ("hardbreak", _break("<br />")),
                       ("code_inline", _code_inline), ("fence", _code), ("code_block", _code),
                       ("image", _image), ("link_open", _link_open)):
        md.add_render_rule(name, rule)
    return md


MARKDOWN = _markdown()  # stateless between renders (each render's state rides in its env)


CONTENT = ("text", "code_inline", "softbreak", "hardbreak", "image")  # inline tokens that write text


def _render(text: str, aligner: _Aligner | None) -> str:
    env: dict = {} if aligner is None else {"tf": aligner}
    blocks = MARKDOWN.parse(text, env)
    for block in blocks:  # each block's first text starts on the block's first line
        first = next((c for c in block.children or () if c.type in CONTENT), None)
        if block.type == "inline" and block.map and first is not None:
            first.meta["tf_line"] = block.map[0]
    return MARKDOWN.renderer.render(blocks, MARKDOWN.options, env)


def plain_html(text: str) -> str:
    """`text` as Markdown HTML, without colours: what `answer_body_html` shows, spans aside."""
    return _render(text, None)


def answer_body_html(segments, key: int | None = None) -> str:
    """An answer's committed tokens (`ui.trace` segments) as Markdown HTML, each character
    coloured by its token's level (see the module docstring); "" before its first token.

    With `key` (the answer's turn), each span carries `data-tf="turn:segment"`, which the
    page's script sends to the inspector when it is clicked."""
    tokens, pieces = [], []
    for i, seg in enumerate(segments):
        if seg.kind == "token":
            tokens.append(_Token(i, seg.level, seg.note))
            pieces.append(seg.text)
    if not tokens:
        return ""
    aligner = _Aligner(pieces, tokens, key)
    body = _render(aligner.source, aligner) + aligner.rest()
    return f'<div class="tf-answer-body">{body}</div>'


def rounds_html(segments, key: int | None = None) -> str:
    """The teaching view's token-by-token answer, one click away under it: each round's mark,
    its rejected drafts dimmed and struck through before the token that replaced them."""
    if not any(seg.kind == "token" for seg in segments):
        return ""
    body = segments_html(segments, teaching=True, key=key, token_class="tf-seg")
    return (f'<details class="tf-answer-rounds"><summary>Rounds and rejected drafts</summary>'
            f'<div class="tf-answer-rounds-body">{body}</div></details>')


def copy_buttons(text: str) -> str:
    """A finished answer's copy buttons: as Markdown (its source rides in a template, escaped)
    and as plain text (what the page shows of it: assets/app.js reads the answer's text)."""
    return ('<button type="button" class="tf-copy-md" title="Copy the answer as Markdown">Copy Markdown</button>'
            '<button type="button" class="tf-copy-text" title="Copy the answer as plain text">Copy text</button>'
            f'<template class="tf-md">{html.escape(text, quote=False)}</template>')
