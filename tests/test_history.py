"""The conversation store (`triforce_core.serving.history`), on real SQLite files: what is kept
comes back, only to its owner; a save is whole or absent, even when the writer is killed; a
foreign file is refused untouched; documents over the cap are let go, oldest first."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from triforce_core.documents import Document, Section
from triforce_core.serving.history import (FILE_NAME, ConversationStore, HistoryError, default_data_dir,
                                          owner_id)

ALICE, BOB = owner_id("browser-a"), owner_id("browser-b")
BOOK = Document("Chapter one.\nCall me Ishmael.\nChapter two.\nThe whale.", "md", "book.md",
                (Section(0, "chapter: Chapter one", "Chapter one", 1, 30),
                 Section(30, "chapter: Chapter two", "Chapter two", 1, 52)))


def turn(question: str, answer: str = "an answer", **extra) -> dict:
    return {"question": question, "answer": answer, "token_ids": [5, 6, 7], "levels": ["target", "lookup", "target"],
            "passages": [{"kind": "quoted", "text": "Call me Ishmael.", "section": "Chapter one", "share": 0.5}],
            "sections_read": None, "footer": "lookup · 3 tokens", **extra}


def test_a_conversation_comes_back_whole_and_listed_newest_first(tmp_path):
    store = ConversationStore.open(tmp_path / "data")
    first, let_go = store.save(ALICE, None, document=BOOK, model="demo", turns=[turn("Who is Ishmael?")],
                               settings={"mode": "lookup"})
    assert let_go == []
    second, _ = store.save(ALICE, None, document=BOOK, model="demo", turns=[turn("What is the whale?")])
    first_again, _ = store.save(ALICE, first, document=BOOK, model="demo",
                                turns=[turn("Who is Ishmael?"), turn("And then?", "more")], settings={"mode": "lookup"})
    assert first_again == first
    listed = store.listing(ALICE)
    assert [c.id for c in listed] == [first, second]  # the one written last first
    assert listed[0].label == "book.md · Who is Ishmael?" and listed[0].turns == 2 and listed[0].document_kept
    kept = store.load(ALICE, first)
    assert kept.document == BOOK and kept.model == "demo" and kept.settings == {"mode": "lookup"}
    assert kept.turns == [turn("Who is Ishmael?"), turn("And then?", "more")]
    store.close()
    reopened = ConversationStore.open(tmp_path / "data")  # another process would read the same
    assert reopened.load(ALICE, first).turns == kept.turns


def test_the_secret_and_the_files_permissions_last(tmp_path):
    folder = tmp_path / "a" / "data"
    store = ConversationStore.open(folder)
    secret = store.browser_secret()
    assert len(secret) >= 32
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / FILE_NAME).stat().st_mode) == 0o600
    store.close()
    again = ConversationStore.open(folder)
    assert again.browser_secret() == secret  # the browsers' tokens stay readable after a restart
    mode = sqlite3.connect(folder / FILE_NAME).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_nothing_of_one_owner_reaches_another(tmp_path):
    store = ConversationStore.open(tmp_path)
    mine, _ = store.save(ALICE, None, document=BOOK, model="demo", turns=[turn("Mine?")])
    assert store.listing(BOB) == []
    assert store.load(BOB, mine) is None
    assert not store.rename(BOB, mine, "stolen")
    assert not store.delete(BOB, mine)
    # Bob's save naming Alice's id makes a conversation of his own; hers is as it was
    his, _ = store.save(BOB, mine, document=BOOK, model="demo", turns=[turn("Overwrite?")])
    assert his != mine
    assert store.load(ALICE, mine).turns == [turn("Mine?")] and store.load(ALICE, mine).title == ""
    assert [c.id for c in store.listing(BOB)] == [his]
    # a browser token and a key make another owner than the token alone
    assert owner_id("browser-a", "key-token") not in (ALICE, owner_id("browser-a", "other-key"))


def test_rename_delete_restore_and_purge(tmp_path):
    store = ConversationStore.open(tmp_path)
    cid, _ = store.save(ALICE, None, document=BOOK, model="demo", turns=[turn("Who is Ishmael?")])
    assert store.rename(ALICE, cid, "  Ishmael \n notes ")
    assert store.listing(ALICE)[0].label == "Ishmael notes"
    assert store.rename(ALICE, cid, "") and store.listing(ALICE)[0].label == "book.md · Who is Ishmael?"
    assert store.delete(ALICE, cid) and store.listing(ALICE) == [] and store.load(ALICE, cid) is None
    assert not store.rename(ALICE, cid, "gone")
    assert store.restore(ALICE, cid) and [c.id for c in store.listing(ALICE)] == [cid]
    assert store.delete(ALICE, cid)
    store.purge()
    assert not store.restore(ALICE, cid)
    assert store.document_bytes() == 0  # its document went with it


def test_a_failed_save_leaves_the_conversation_as_it_was(tmp_path):
    store = ConversationStore.open(tmp_path)
    cid, _ = store.save(ALICE, None, document=BOOK, model="demo", turns=[turn("One?")])
    db = sqlite3.connect(tmp_path / FILE_NAME)  # a write that fails half-way: the third turn's insert
    db.execute("CREATE TRIGGER fail BEFORE INSERT ON turns WHEN NEW.position = 2 BEGIN "
               "SELECT RAISE(ABORT, 'the disk is full'); END")
    db.commit()
    with pytest.raises(HistoryError, match="not saved.*the disk is full"):
        store.save(ALICE, cid, document=BOOK, model="other", turns=[turn("One?"), turn("Two?"), turn("Three?")])
    kept = store.load(ALICE, cid)
    assert kept.turns == [turn("One?")] and kept.model == "demo"
    with pytest.raises(TypeError):  # a record that is not JSON: refused before anything is written
        store.save(ALICE, cid, document=BOOK, model="demo", turns=[turn("One?", extra=object())])
    assert store.load(ALICE, cid).turns == [turn("One?")]


WRITER = """
import sys
from triforce_core.documents import Document
from triforce_core.serving.history import ConversationStore, owner_id
store = ConversationStore.open(sys.argv[1])
doc = Document("text " * 2000, "txt", "big.txt")
cid = None
for n in range(1, 100000):
    turns = [{"question": f"q{n}.{i}", "generation": n, "answer": "a" * 5000} for i in range(n % 40 + 1)]
    cid, _ = store.save(owner_id("w"), cid, document=doc, model="demo", turns=turns)
    print(n, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_every_conversation_whole(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(30):  # killed once it has written a few (never timed: at whatever point it is)
            assert proc.stdout.readline(), "the writer ended early"
    finally:
        proc.kill()
        proc.wait()
    store = ConversationStore.open(tmp_path)
    [listed] = store.listing(owner_id("w"))
    kept = store.load(owner_id("w"), listed.id)
    n = kept.turns[0]["generation"]
    assert n >= 30
    assert kept.turns == [{"question": f"q{n}.{i}", "generation": n, "answer": "a" * 5000} for i in range(n % 40 + 1)]
    assert listed.turns == len(kept.turns)


def test_a_foreign_or_newer_file_is_refused_untouched(tmp_path):
    text = tmp_path / "text" / FILE_NAME
    text.parent.mkdir()
    text.write_text("not a database\n" * 100)
    other = tmp_path / "other" / FILE_NAME
    other.parent.mkdir()
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE invoices (n INTEGER)")
    db.commit()
    db.close()
    newer = tmp_path / "newer"
    ConversationStore.open(newer).close()
    db = sqlite3.connect(newer / FILE_NAME)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    db.commit()
    db.close()
    for folder, why in ((text.parent, "not a TriForce Studio conversation store"),
                        (other.parent, "another program's database"), (newer, "newer TriForce Studio")):
        before = (folder / FILE_NAME).read_bytes()
        with pytest.raises(HistoryError, match=why) as refused:
            ConversationStore.open(folder)
        assert "\n" not in str(refused.value)
        assert (folder / FILE_NAME).read_bytes() == before
    file_as_folder = tmp_path / "plain"
    file_as_folder.write_text("")
    with pytest.raises(HistoryError, match="is a file, not a folder"):
        ConversationStore.open(file_as_folder)
    assert sqlite3.connect(other).execute("SELECT name FROM sqlite_master").fetchall() == [("invoices",)]


def test_documents_over_the_cap_are_let_go_oldest_first(tmp_path):
    store = ConversationStore.open(tmp_path, max_document_bytes=2_500)
    docs = [Document(str(i) * 1_000, "txt", f"doc{i}.txt") for i in range(3)]
    ids = []
    for i, doc in enumerate(docs):
        cid, let_go = store.save(ALICE, None, document=doc, model="demo", turns=[turn(f"about {i}?")])
        ids.append(cid)
        assert let_go == ([] if i < 2 else ["doc0.txt"])
    assert store.document_bytes() <= 2_500
    gone = store.load(ALICE, ids[0])
    assert gone.document is None and gone.document_name == "doc0.txt" and gone.turns == [turn("about 0?")]
    assert [c.document_kept for c in store.listing(ALICE)] == [True, True, False]
    # using a document again makes it the newest: the other one goes next
    store.save(ALICE, ids[1], document=docs[1], model="demo", turns=[turn("about 1?"), turn("more?")])
    _, let_go = store.save(ALICE, None, document=Document("x" * 1_000, "txt", "new.txt"), model="demo",
                           turns=[turn("new?")])
    assert let_go == ["doc2.txt"]
    assert store.load(ALICE, ids[1]).document == docs[1]


def test_the_default_data_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "triforce-studio"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir() == __import__("pathlib").Path(os.path.expanduser("~")) / ".local/share/triforce-studio"
