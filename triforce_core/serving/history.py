"""The conversations kept: one SQLite database in the app's data folder, every conversation of
every browser in it, each listed, opened, renamed, deleted and restored by its owner only.

    store = ConversationStore.open(default_data_dir())       # or a --data-dir; HistoryError if refused
    owner = owner_id(browser_token, key_token)                # who may see what: a hash, never the token
    cid, let_go = store.save(owner, None, document=doc, model="demo", turns=[{...}, ...])
    store.listing(owner)                                      # newest first: [Listed(...), ...]
    store.load(owner, cid).turns                              # None for a conversation of another owner

What is kept: the conversation's document (its text, name, format, sections), the model it
ran on, and each turn as one JSON record (the question, the answer, its token ids and levels,
its citations, statistics and footer: whatever the app hands in). A save writes the whole
conversation in one transaction: a process killed during a write leaves the conversation as
it was before the write or as it is after it, never half of it (SQLite's journal, in WAL mode).

Documents are kept up to `max_document_bytes` together (of every owner: it is the disk's): the
least recently used are let go first, and their conversations stay, listed and openable, with
`document` None (the app says so; asking more needs the document again).

Every query names the owner: an id handed in by a page that is not the owner's finds nothing.
A file that is not this store (not SQLite, another program's database, a newer schema) is
refused with one line (`HistoryError`); nothing in it is changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..documents import Document, Section

SCHEMA = 1
APPLICATION = "triforce-studio conversations"
FILE_NAME = "conversations.sqlite3"
DEFAULT_MAX_DOCUMENT_BYTES = 200_000_000
TITLE_CHARS = 200  # a title given by the user is cut to this


class HistoryError(RuntimeError):
    """The store cannot be used (a foreign or damaged file, a folder that cannot be written); one line."""


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/triforce-studio`, else `~/.local/share/triforce-studio`: the app's data
    folder (what it keeps for its users, unlike the caches it can rebuild)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "triforce-studio"


def owner_id(browser_token: str, key_token: str | None = None) -> str:
    """Who owns a conversation: a hash of the browser's token and, on a server with an API key,
    of the key's token too (the database never holds either)."""
    return hashlib.sha256(f"browser:{browser_token}\nkey:{key_token or ''}".encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (a browser's, a conversation's id): unguessable."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Listed:
    """One conversation in a listing."""

    id: str
    title: str  # the user's name for it, or "" (then the document and first question name it)
    document_name: str
    first_question: str
    updated: float
    turns: int
    document_kept: bool

    @property
    def label(self) -> str:
        if self.title:
            return self.title
        question = " ".join(self.first_question.split())
        question = question if len(question) <= 60 else question[:59] + "…"
        return f"{self.document_name or 'no document'} · {question}" if question else (self.document_name or "empty")


@dataclass(frozen=True)
class Stored:
    """One conversation as kept: `document` None when it was let go (`document_name` still says which)."""

    id: str
    title: str
    document: Document | None
    document_name: str
    model: str
    settings: dict
    turns: list[dict]
    created: float
    updated: float

    @property
    def label(self) -> str:
        first = self.turns[0].get("question", "") if self.turns else ""
        return Listed(self.id, self.title, self.document_name, first, self.updated, len(self.turns),
                      self.document is not None).label


def _document_json(doc: Document) -> str:
    return json.dumps({"text": doc.text, "format": doc.format, "name": doc.name, "pages": doc.pages,
                       "sections": [dataclasses.asdict(s) for s in doc.sections]}, ensure_ascii=False)


def _document_of(body: str) -> Document:
    d = json.loads(body)
    names = {f.name for f in dataclasses.fields(Section)}
    sections = tuple(Section(**{k: v for k, v in s.items() if k in names}) for s in d.get("sections", []))
    return Document(d["text"], d["format"], d.get("name", ""), sections, d.get("pages"))


_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE documents (
    id INTEGER PRIMARY KEY, owner TEXT NOT NULL, sha TEXT NOT NULL, body TEXT NOT NULL,
    bytes INTEGER NOT NULL, used REAL NOT NULL, UNIQUE (owner, sha));
CREATE TABLE conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL DEFAULT '',
    document_id INTEGER REFERENCES documents(id) ON DELETE SET NULL, document_name TEXT NOT NULL,
    model TEXT NOT NULL, settings TEXT NOT NULL, first_question TEXT NOT NULL, turn_count INTEGER NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, deleted REAL);
CREATE INDEX conversations_by_owner ON conversations (owner, updated);
CREATE TABLE turns (
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, record TEXT NOT NULL, PRIMARY KEY (conversation_id, position));
"""


class ConversationStore:
    """The database (see the module docstring). Thread-safe: one connection, one lock."""

    def __init__(self, path: str | Path, max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES):
        if max_document_bytes < 0:
            raise HistoryError(f"the documents' cap must be >= 0 bytes, got {max_document_bytes}")
        self.path = Path(path)
        self.max_document_bytes = int(max_document_bytes)
        self._lock = threading.Lock()
        self._digests: dict[int, tuple] = {}  # id(document) -> (document, hash, stored form, bytes)
        existed = self.path.exists()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        except sqlite3.Error as e:
            raise HistoryError(f"cannot open the conversation store {self.path}: {e}") from None
        try:
            if not existed:
                os.chmod(self.path, 0o600)
            self._check_and_create()
            self._db.execute("PRAGMA foreign_keys = ON")
        except HistoryError:
            self._db.close()
            raise
        except (sqlite3.Error, OSError) as e:
            self._db.close()
            raise HistoryError(f"{self.path} is not a TriForce Studio conversation store ({e})") from None

    @classmethod
    def open(cls, data_dir: str | Path, max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> "ConversationStore":
        """The store in `data_dir` (created, readable by this user only, if it is not there)."""
        folder = Path(data_dir).expanduser()
        try:
            if not folder.exists():
                folder.mkdir(mode=0o700, parents=True)
                os.chmod(folder, 0o700)  # whatever the umask
            elif not folder.is_dir():
                raise HistoryError(f"the data folder {folder} is a file, not a folder")
        except OSError as e:
            raise HistoryError(f"cannot create the data folder {folder}: {e.strerror or e}") from None
        return cls(folder / FILE_NAME, max_document_bytes)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- the file ------------------------------------------------------------------------------
    def _check_and_create(self) -> None:
        db = self._db
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("BEGIN IMMEDIATE")
            try:  # statement by statement: executescript would commit on its own
                for statement in filter(str.strip, _TABLES.split(";")):
                    db.execute(statement)
                db.executemany("INSERT INTO meta VALUES (?, ?)", [
                    ("application", APPLICATION), ("schema", str(SCHEMA)), ("browser_secret", new_token())])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return
        meta = dict(db.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
        if meta.get("application") != APPLICATION:
            raise HistoryError(f"{self.path} is another program's database, not TriForce Studio's conversations: "
                               "move it away or pass another --data-dir")
        schema = int(meta.get("schema", "0") or 0)
        if schema > SCHEMA:
            raise HistoryError(f"{self.path} was written by a newer TriForce Studio (schema {schema}; this one "
                               f"reads {SCHEMA}): upgrade, or pass another --data-dir")
        if schema < 1 or not {"documents", "conversations", "turns"} <= tables:
            raise HistoryError(f"{self.path} is damaged (schema {schema}, tables {sorted(tables)})")
        db.execute("PRAGMA journal_mode = WAL")

    def browser_secret(self) -> str:
        """A secret made with the store (the key the page's browser token is kept under)."""
        with self._lock:
            return self._db.execute("SELECT value FROM meta WHERE key = 'browser_secret'").fetchone()[0]

    # -- writing -------------------------------------------------------------------------------
    def _transaction(self):
        store = self

        class _Tx:
            def __enter__(self):
                store._lock.acquire()
                try:
                    store._db.execute("BEGIN IMMEDIATE")
                except BaseException:
                    store._lock.release()
                    raise
                return store._db

            def __exit__(self, kind, value, tb):
                try:
                    store._db.execute("COMMIT" if kind is None else "ROLLBACK")
                finally:
                    store._lock.release()
                return False

        return _Tx()

    def save(self, owner: str, conversation_id: str | None, *, document: Document | None, model: str,
             turns: list[dict], settings: dict | None = None) -> tuple[str, list[str]]:
        """Write a conversation whole (its document, model, settings and every turn, replacing
        what it held), in one transaction: (its id, a new one when `conversation_id` is None or
        not the owner's; the names of the documents let go to keep under the cap)."""
        records = [json.dumps(t, ensure_ascii=False) for t in turns]  # a record that is not JSON fails here
        settings_json = json.dumps(settings or {}, ensure_ascii=False)
        first = str(turns[0].get("question", "")) if turns else ""
        try:
            return self._save(owner, conversation_id, document, model, records, settings_json, first)
        except sqlite3.Error as e:
            raise HistoryError(f"the conversation was not saved: {e}") from None

    def _save(self, owner, conversation_id, document, model, records, settings_json, first):
        turns = records
        now = time.time()
        with self._transaction() as db:
            doc_id = None
            if document is not None:
                sha, body, size = self._digest(document)
                row = db.execute("SELECT id FROM documents WHERE owner = ? AND sha = ?", (owner, sha)).fetchone()
                if row is None:
                    doc_id = db.execute("INSERT INTO documents (owner, sha, body, bytes, used) VALUES (?, ?, ?, ?, ?)",
                                        (owner, sha, body, size, now)).lastrowid
                else:
                    doc_id = row[0]
                    db.execute("UPDATE documents SET used = ? WHERE id = ?", (now, doc_id))
            name = document.name if document is not None else ""
            mine = conversation_id is not None and db.execute(
                "SELECT 1 FROM conversations WHERE id = ? AND owner = ? AND deleted IS NULL",
                (conversation_id, owner)).fetchone() is not None
            if mine:
                if document is None:  # kept as it was (a conversation whose document was let go)
                    db.execute("UPDATE conversations SET model = ?, settings = ?, first_question = ?, turn_count = ?, "
                               "updated = ? WHERE id = ?", (model, settings_json, first, len(turns), now,
                                                            conversation_id))
                else:
                    db.execute("UPDATE conversations SET document_id = ?, document_name = ?, model = ?, settings = ?, "
                               "first_question = ?, turn_count = ?, updated = ? WHERE id = ?",
                               (doc_id, name, model, settings_json, first, len(turns), now, conversation_id))
                db.execute("DELETE FROM turns WHERE conversation_id = ?", (conversation_id,))
            else:
                conversation_id = new_token()
                db.execute("INSERT INTO conversations (id, owner, document_id, document_name, model, settings, "
                           "first_question, turn_count, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (conversation_id, owner, doc_id, name, model, settings_json, first, len(turns), now, now))
            db.executemany("INSERT INTO turns (conversation_id, position, record) VALUES (?, ?, ?)",
                           [(conversation_id, i, r) for i, r in enumerate(records)])
            let_go = self._keep_under_cap(db)
        return conversation_id, let_go

    def _digest(self, document: Document) -> tuple[str, str, int]:
        """(its hash, its stored form, its text's bytes): computed once per document object (a
        conversation is saved at each answer, its document the same every time)."""
        known = self._digests.get(id(document))
        if known is None or known[0] is not document:
            body = _document_json(document)
            known = (document, hashlib.sha256(body.encode()).hexdigest(), body, len(document.text.encode()))
            while len(self._digests) >= 8:  # the documents of the sessions saving now, not every one ever
                self._digests.pop(next(iter(self._digests)))
            self._digests[id(document)] = known
        return known[1], known[2], known[3]

    def _keep_under_cap(self, db) -> list[str]:
        """Let go of the least recently used documents until those kept fit the cap."""
        total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM documents").fetchone()[0]
        let_go = []
        for doc_id, size, body in db.execute("SELECT id, bytes, body FROM documents ORDER BY used, id").fetchall():
            if total <= self.max_document_bytes:
                break
            let_go.append(json.loads(body).get("name") or "a document")
            db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
            total -= size
        return let_go

    def rename(self, owner: str, conversation_id: str, title: str) -> bool:
        """Give a conversation a name ("" : named by its document and first question again)."""
        title = " ".join(str(title or "").split())[:TITLE_CHARS]
        with self._transaction() as db:
            return db.execute("UPDATE conversations SET title = ? WHERE id = ? AND owner = ? AND deleted IS NULL",
                              (title, str(conversation_id), owner)).rowcount == 1

    def delete(self, owner: str, conversation_id: str) -> bool:
        """Take a conversation out of the list; it can be restored (`restore`) until the owner
        deletes another or the store is opened again (`purge`)."""
        with self._transaction() as db:
            self._purge(db, owner)
            return db.execute("UPDATE conversations SET deleted = ? WHERE id = ? AND owner = ? AND deleted IS NULL",
                              (time.time(), str(conversation_id), owner)).rowcount == 1

    def restore(self, owner: str, conversation_id: str) -> bool:
        """Undo `delete`."""
        with self._transaction() as db:
            return db.execute("UPDATE conversations SET deleted = NULL WHERE id = ? AND owner = ? AND deleted IS NOT "
                              "NULL", (str(conversation_id), owner)).rowcount == 1

    def purge(self) -> None:
        """Delete for good every conversation taken out of its list (the app does at start)."""
        with self._transaction() as db:
            self._purge(db, None)

    @staticmethod
    def _purge(db, owner: str | None) -> None:
        where, args = ("deleted IS NOT NULL", ()) if owner is None else ("deleted IS NOT NULL AND owner = ?", (owner,))
        db.execute(f"DELETE FROM conversations WHERE {where}", args)
        # documents no conversation holds any longer
        db.execute("DELETE FROM documents WHERE id NOT IN (SELECT document_id FROM conversations WHERE document_id "
                   "IS NOT NULL)")

    # -- reading -------------------------------------------------------------------------------
    def listing(self, owner: str) -> list[Listed]:
        """The owner's conversations, the newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, title, document_name, first_question, updated, turn_count, document_id IS NOT NULL "
                "FROM conversations WHERE owner = ? AND deleted IS NULL ORDER BY updated DESC, rowid DESC",
                (owner,)).fetchall()
        return [Listed(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6])) for r in rows]

    def load(self, owner: str, conversation_id: str) -> Stored | None:
        """The conversation, if it is the owner's (None otherwise, or when there is none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT c.id, c.title, d.body, c.document_name, c.model, c.settings, c.created, c.updated "
                "FROM conversations c LEFT JOIN documents d ON d.id = c.document_id "
                "WHERE c.id = ? AND c.owner = ? AND c.deleted IS NULL", (str(conversation_id), owner)).fetchone()
            if row is None:
                return None
            records = [r[0] for r in self._db.execute(
                "SELECT record FROM turns WHERE conversation_id = ? ORDER BY position", (row[0],))]
        document = _document_of(row[2]) if row[2] is not None else None
        return Stored(row[0], row[1], document, row[3], row[4], json.loads(row[5]), [json.loads(r) for r in records],
                      row[6], row[7])

    def document_bytes(self) -> int:
        """Bytes of the documents kept, of every owner."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM documents").fetchone()[0]
