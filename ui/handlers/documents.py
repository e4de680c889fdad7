"""Loading a document: an upload (a clear error for a file that cannot be read) or the sample."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from triforce_core.documents import Document, DocumentError, load_document
from triforce_core.resources import SAMPLE_DOCUMENT

from ..figures import retrieval_map_figure
from ..render import status_html
from ..state import AppContext, UserState
from ..views import doc_info, gauge, transcript


class DocumentHandlers:
    """Outputs in `ui.views.DOCUMENT_OUTPUTS` order."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def set_document(self, user: UserState | None, doc: Document, budget) -> tuple:
        user = user or self.ctx.new_user()
        if user.busy:
            raise gr.Error("An answer is being generated; stop it before changing the document.")
        self.ctx.worker.call(lambda: (user.session.set_document(doc), user.session.document_tokens))
        user.document, user.answers, user.spans = doc, [], []
        return (
            user, doc_info(user), gauge(user, budget, self.ctx.window),
            status_html(f"Loaded {doc.name}: {user.session.document_tokens:,} tokens. Ask a question.", "ok"),
            transcript(user, False), retrieval_map_figure(None),
        )

    def on_upload(self, file, user, budget):
        if file is None:
            return (gr.skip(),) * 6
        path = Path(file if isinstance(file, str) else file.name)
        try:
            doc = load_document(path, max_bytes=self.ctx.max_bytes, name=path.name)
        except DocumentError as e:
            message = f"Could not read {path.name}: {e}"
            gr.Warning(message)
            return (user, gr.skip(), gr.skip(), status_html(message, "error"), gr.skip(), gr.skip())
        return self.set_document(user, doc, budget)

    def on_sample(self, user, budget):
        doc = load_document(SAMPLE_DOCUMENT, max_bytes=self.ctx.max_bytes)
        return self.set_document(user, doc, budget)
