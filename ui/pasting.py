"""Big pastes: the chat box's cap on a question, and a long text used as the document instead.

The page's script (assets/app.js, "big pastes") refuses a paste or a drop that would take the
box over `MAX_QUESTION_CHARS`, in the browser, before the text reaches the box: what was
typed stays, and the note beside the box (`paste_note`, whose `data-max` tells the script the
cap) offers to read the text as the document. The server refuses an over-long question too
(`question_refused`), in one sentence, before any tokenizing, and the box keeps it
(`take_question`). `pasted_document` is the document a paste becomes: read like an uploaded
text file (Markdown headings are its sections).
"""

from __future__ import annotations

import html

import gradio as gr

from triforce_core.documents import Document, DocumentError
from triforce_core.documents.sections import with_ends
from triforce_core.documents.text import markdown_sections

MAX_QUESTION_CHARS = 20_000  # a question longer than this is a document
PASTED_NAME = "pasted text"


def paste_note(message: str = "", nonce: int = 0) -> str:
    """The note beside the chat box: empty until the page's script fills it (a paste over the
    cap), or `message` (the server's word on a paste used as the document). It carries the cap
    for the script. The script writes into the note itself, and Gradio redraws an HTML component
    only when its value changes: a new `nonce` makes an update that empties the note draw it."""
    body = html.escape(message)
    return (f'<div class="tf-paste-note" data-max="{MAX_QUESTION_CHARS}" data-nonce="{int(nonce)}" role="status" '
            f'aria-live="polite">{body}</div>')


PAGE_ADVICE = "shorten it, or paste it into the box and press Use this text as the document"


def question_refused(message: str, advice: str = PAGE_ADVICE) -> str | None:
    """Why `message` is refused as a question (one sentence with its length, the cap and `advice`:
    what the page, or the `chat` endpoint, offers instead), or None."""
    n = len(message)
    if n <= MAX_QUESTION_CHARS:
        return None
    return f"That question is {n:,} characters, too long for a question (the limit is {MAX_QUESTION_CHARS:,}): {advice}."


def take_question(message: str) -> tuple:
    """(the box, the question asked) when a question is sent: the box empties, what it held is
    asked; an over-long one stays in the box (nothing is lost) and is asked, to be refused."""
    message = message or ""
    return (gr.skip() if question_refused(message.strip()) else "", message)


def pasted_document(text: str, max_bytes: int) -> Document:
    """A pasted text as the document, read as an uploaded text file is (line ends made plain;
    Markdown headings, where it has them, its sections); a DocumentError (one line) for an empty
    paste or one over the upload limit."""
    text = (text or "").replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if not text.strip():
        raise DocumentError("the pasted text is empty")
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise DocumentError(f"the pasted text is {size / 1e6:.1f} MB, over the upload limit of "
                            f"{max_bytes / 1e6:.0f} MB")
    sections = markdown_sections(text)
    if not sections:
        return Document(text, "txt", PASTED_NAME)
    return Document(text, "md", PASTED_NAME, with_ends(sections, len(text)))

