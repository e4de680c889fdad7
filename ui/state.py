"""What the app keeps: the context every handler shares (one engine, one worker, the cache
pools) and each browser session's `UserState`.

One engine (model weights) serves every user of a model; each browser session has its own
`UserState` in `gr.State` (its `ChatSession`, hence its own caches, and its answers' traces).
A user who switches the model holds its `ServedModel` (`triforce_core.serving.registry`); their
session runs on its engine, every other user keeps theirs. Every use of every engine goes
through the one `EngineWorker`, so users cannot corrupt each other's caches.

Under a remote engine (`python app.py --engine URL`) the engine is a `RemoteEngine`: the
sessions are its remote ones (`chat_session`, `book_session`), their caches are the server's,
and the worker runs each answer on a thread of its own (`ThreadWorker`).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

from triforce_core.documents import Document
from triforce_core.engine import TriForceEngine
from triforce_core.serving.book import BookSession
from triforce_core.serving.history import ConversationStore
from triforce_core.serving.registry import ServedModel, ServedModels
from triforce_core.serving.remote import RemoteBookSession, RemoteChatSession, RemoteEngine
from triforce_core.serving.worker import EngineWorker, Job
from triforce_core.serving.session import ChatSession
from triforce_core.serving.slots import SlotPool

from .settings import Settings
from .trace import AnswerTrace


def chat_session(engine, document=None, **kwargs) -> ChatSession:
    """A conversation on `engine`: in this process, or on a remote engine's server."""
    return (RemoteChatSession if isinstance(engine, RemoteEngine) else ChatSession)(engine, document, **kwargs)


def book_session(engine, document: Document, **kwargs) -> BookSession:
    """A book read by the sections each question needs, on `engine` (see `chat_session`)."""
    return (RemoteBookSession if isinstance(engine, RemoteEngine) else BookSession)(engine, document, **kwargs)


def reads_by_relevance(engine, document: Document) -> bool:
    """Whether `document` is read by relevance (a `book_session`: each question reads the parts
    most relevant to it) rather than whole: when its tokens exceed `engine`'s context window.
    The one decision of the page and the `chat` endpoint; run it on the worker (the tokenizer)."""
    return len(engine.encode(document.text)) > engine.context_window


@dataclass
class Answer:
    """What the page shows of one turn."""

    trace: AnswerTrace
    footer: str = ""
    settings: dict | None = None  # the generation settings it ran with (kept with the conversation)
    baseline: dict | None = None  # the autoregressive comparison of this answer
    ran_with: set[int] = field(default_factory=set)  # other generations run between its events (`Job.ran_with`)
    inspected: bool = False  # generated with inspect=True: its tokens carry the rule's values
    # the transcript's last rendering of this answer, (what it was drawn from, its HTML): a
    # finished answer is not rendered again each time the page redraws the conversation
    shown: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class Lesson:
    """The guided lesson of one user: the settings it changed, as the user had them (restored
    when it ends), and whether its question has been asked (that one answer runs by itself)."""

    saved: dict[str, object]
    asked: bool = False


@dataclass(eq=False)
class UserState:
    """One browser session: its document, conversation (a `ChatSession`) and answers."""

    session: ChatSession
    document: Document | None = None
    answers: list[Answer] = field(default_factory=list)
    job: Job | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)  # prompt token -> document chars
    doc_first: int = -1  # token position where the document begins
    book: Document | None = None  # the whole file when its sections can be picked (`document`: what is read)
    book_sizes: list[int] = field(default_factory=list)  # tokens of each of the book's sections
    last_used: float = field(default_factory=time.monotonic)
    auto_inspect: bool = False  # the lesson: open the inspector on the next answer's first rejection
    lesson: Lesson | None = None  # a lesson under way
    model: ServedModel | None = None  # a model the user switched to (None: the server's started model)
    # the mode picked since the last answer's panels were cleared (None: they show that answer's)
    panels_mode: str | None = None
    keep: bool = True  # saved in the conversation store (False: the lesson's own session, never saved)
    # the conversation store (ui.handlers.conversations): who owns this session's conversations
    # (a hash of its browser's token, and key), the stored conversation it writes to (None: a new
    # one on its next answer), the name of a reopened conversation's document no longer kept
    # (asking more needs it again), and what the last save said (shown in the sidebar)
    owner: str | None = field(default=None, repr=False)
    conversation_id: str | None = None
    document_gone: str | None = None
    history_note: str = ""
    # the answer the inspector and the narration were last drawn for (a new one clears them)
    panels_answer: Answer | None = field(default=None, repr=False)

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.finished.is_set()

    def new_conversation(self) -> None:
        """A document was loaded (or the conversation cleared): the next answer starts a new stored conversation."""
        self.conversation_id, self.document_gone = None, None


class SessionPool:
    """Caps how many users' sessions keep their KV caches, by count and by bytes (a 64K-token
    session holds about half a gigabyte): the least recently used idle ones are freed."""

    def __init__(self, worker: EngineWorker, max_cached: int, max_bytes: int | None = None):
        self.worker = worker
        self.max_cached = max_cached
        self.max_bytes = max_bytes
        self._users: "weakref.WeakSet[UserState]" = weakref.WeakSet()
        self._lock = threading.Lock()

    def touch(self, user: UserState) -> None:
        user.last_used = time.monotonic()
        with self._lock:
            self._users.add(user)
            holding = sorted(
                (u for u in self._users if u.session.cache_lengths()["target"] > 0 and u is not user),
                key=lambda u: u.last_used,
            )
        count = len(holding) + 1
        held = sum(u.session.cache_bytes() for u in holding) + user.session.cache_bytes()
        for u in holding:  # least recently used first
            over_bytes = self.max_bytes is not None and held > self.max_bytes
            if count <= self.max_cached and not over_bytes:
                break
            if not u.busy:
                held -= u.session.cache_bytes()
                count -= 1
                self.worker.call(u.session.release)

    def held_bytes(self) -> int:
        """Memory held by every user's caches."""
        with self._lock:
            users = list(self._users)
        return sum(u.session.cache_bytes() for u in users)


@dataclass
class AppContext:
    """What every handler shares: the engine, the one worker that runs it, the users' session
    pool, the `chat` endpoint's cache slots, and the app's fixed choices."""

    engine: TriForceEngine | RemoteEngine
    worker: EngineWorker
    sessions: SessionPool
    slots: SlotPool | None  # None under a remote engine (the server's slots serve its API)
    defaults: Settings
    max_bytes: int
    models: ServedModels | None = None  # the models users may switch to (None: `engine` alone)
    # the conversations kept (`ui.handlers.conversations`; None: not saved, `history_note` says why)
    history: ConversationStore | None = None
    history_note: str = ""
    model_name: str | None = None  # the model's name where there is no picker (`models` None)

    @property
    def remote(self) -> bool:
        """The engine is a server's (`--engine URL`)."""
        return isinstance(self.engine, RemoteEngine)

    @property
    def window(self) -> int:
        return self.engine.context_window

    def engine_of(self, user: UserState | None) -> TriForceEngine:
        """The engine a user's session runs on (the started model's for a new user)."""
        return user.session.engine if user is not None else self.engine

    def window_of(self, user: UserState | None) -> int:
        return self.engine_of(user).context_window

    def model_id_of(self, user: UserState | None) -> str | None:
        """The id of the user's model in `models` (None without them)."""
        if user is not None and user.model is not None:
            return user.model.id
        return self.models.started.id if self.models is not None else None

    def new_user(self) -> UserState:
        return UserState(chat_session(self.engine))

    @staticmethod
    def release_user(user: UserState | None) -> None:
        """A closed page: stop its generation and free its caches."""
        if user is not None:
            if user.job is not None:
                user.job.cancel()
            user.session.release()
