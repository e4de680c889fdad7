"""Prefilled K/V kept on disk: read back bit for bit, answers identical, bad files never used."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_main
from tests.helpers.disk_cache import CHUNK, DOCUMENT, Q1, block_files, config, document_end, new_engine, two_turns
from tests.helpers.models import make_hf, perturbed, to_ours, words
from triforce_core.engine import TriForceEngine
from triforce_core.decoding.events import Committed
from triforce_core.kv import model_fingerprint
from triforce_core.serving.session import ChatSession
from triforce_core.serving.slots import Slot

MODES = ("triforce", "retrieval", "draft", "lookup", "autoregressive")


@pytest.fixture(scope="module")
def weights():
    hf = make_hf("llama_gqa_llama3", seed=0)
    return hf, perturbed(hf, 0.02)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", MODES)
def test_answers_after_a_reload_equal_a_fresh_prefill(weights, tmp_path, mode, sampled):
    cfg = config(mode, 0.8 if sampled else 0.0, seed=5 if sampled else None)
    reference, ref_stats, _ = two_turns(new_engine(weights), cfg)  # no disk at all
    written, w_stats, _ = two_turns(new_engine(weights, tmp_path), cfg)
    assert [s.disk_tokens for s in w_stats] == [0, 0]
    end = document_end(new_engine(weights), cfg)
    assert end == 301 and end % CHUNK  # the template's first token, then the 300 words' (the test tokenizer: one a word)
    # every whole block before the document's end, then the document's last part as a tail block
    assert len(block_files(tmp_path)) == end // CHUNK + 1
    read, r_stats, session = two_turns(new_engine(weights, tmp_path), cfg)
    assert read == written == reference
    first = r_stats[0]
    assert first.disk_tokens == end and first.reused_tokens == end  # only the question ran
    assert first.prefill_tokens == ref_stats[0].prefill_tokens - end
    assert r_stats[1].disk_tokens == 0  # the second turn reuses the memory cache
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".kv")]  # no temporary files left


def test_the_same_document_with_another_question_runs_only_the_question(weights, tmp_path):
    """The K/V up to the document's end, kept by one conversation, serve a later one that starts
    with another question: its prefill reads them back (the last partial chunk as a tail
    block), runs only the question, and its cache and answer equal a fresh prefill's bit for bit
    (whose chunks end at the document's end too). Control: a prefill that names no document end
    reads the whole blocks only."""
    cfg = config("autoregressive")
    two_turns(new_engine(weights, tmp_path), cfg)  # first question Q1
    end = document_end(new_engine(weights), cfg)
    q3 = words(7, 14)

    def ask(engine):
        session = ChatSession(engine, DOCUMENT, config=cfg)
        ids = [t for ev in session.ask(q3) if isinstance(ev, Committed) for t in ev.token_ids]
        return ids, session.turns[0].stats, session._slot.loop.full.cache

    fresh, f_stats, f_cache = ask(new_engine(weights))
    again, a_stats, a_cache = ask(new_engine(weights, tmp_path))
    assert again == fresh
    assert a_stats.disk_tokens == end and a_stats.prefill_tokens == f_stats.prefill_tokens - end
    assert torch.equal(f_cache.k[:, :, :end], a_cache.k[:, :, :end]) and torch.equal(f_cache.v[:, :, :end], a_cache.v[:, :, :end])
    engine = new_engine(weights, tmp_path)
    prompt = ChatSession(engine, DOCUMENT, config=cfg).prompt_ids(q3)
    prefilled = next(iter(Slot(engine).generate(prompt, cfg)))
    assert prefilled.disk_tokens == end // CHUNK * CHUNK


def test_the_cache_read_back_is_bit_identical(weights, tmp_path):
    cfg = config("autoregressive")
    prompt = new_engine(weights).encode(DOCUMENT)
    caches = []
    for folder in (None, tmp_path, tmp_path):
        slot = Slot(new_engine(weights, folder))
        events = list(slot.generate(prompt, cfg))
        caches.append((slot.loop.full.cache, events[0]))
    (fresh, _), (_, wrote), (back, read) = caches
    assert wrote.disk_tokens == 0 and read.disk_tokens == 9 * CHUNK
    n = len(prompt) - 1
    assert torch.equal(fresh.k[:, :, :n], back.k[:, :, :n]) and torch.equal(fresh.v[:, :, :n], back.v[:, :, :n])


def test_only_whole_aligned_chunks_are_written(weights, tmp_path):
    engine = new_engine(weights, tmp_path)
    cfg = config("autoregressive")
    slot = Slot(engine)
    ids = engine.encode(DOCUMENT)
    list(slot.generate(ids[:100], cfg))  # blocks 0-2 whole; 96..99 a partial chunk
    assert len(block_files(tmp_path)) == 3
    assert slot.loop.full.cache.canonical == 96
    list(slot.generate(ids[:200], cfg))  # memory holds 99 (+ the answer): resumes at 99, unaligned
    assert len(block_files(tmp_path)) == 3
    full = slot.loop.full.cache
    blocks = engine.disk_cache.blocks(ids[:200], CHUNK, full.k.dtype, arithmetic=engine.target.arithmetic)
    with pytest.raises(ValueError, match="not canonical"):
        engine.disk_cache.save(full, blocks[4])


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_header(path: Path) -> None:
    path.write_bytes(b"nonsense" + path.read_bytes()[8:])


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_header])
def test_a_bad_file_is_reported_rebuilt_and_never_used(weights, tmp_path, caplog, damage):
    cfg = config("triforce")
    reference, _, _ = two_turns(new_engine(weights, tmp_path), cfg)
    engine = new_engine(weights, tmp_path)
    body = ChatSession(engine, DOCUMENT, config=cfg).prompt_ids(Q1)[:-1]
    blocks = engine.disk_cache.blocks(body, CHUNK, engine.kv_dtype_for(cfg), arithmetic=engine.target.arithmetic)
    bad = engine.disk_cache.path(blocks[4])
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="triforce_core.kv.disk"):
        answers, stats, _ = two_turns(engine, cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and bad.name in lines[0] and "\n" not in lines[0], lines
    assert engine.disk_cache.problems == lines
    assert answers == reference
    assert stats[0].disk_tokens == 4 * CHUNK  # the blocks before the bad one
    assert bad.is_file()  # rebuilt by that prefill
    again, stats, _ = two_turns(new_engine(weights, tmp_path), cfg)
    assert again == reference and stats[0].disk_tokens == document_end(new_engine(weights), cfg)  # whole blocks and the tail


def test_the_key_is_the_weights_and_the_dtype(weights, tmp_path):
    hf, draft = weights
    base = to_ours(hf)
    assert model_fingerprint(base) == model_fingerprint(to_ours(hf))
    assert model_fingerprint(base) != model_fingerprint(to_ours(perturbed(hf, 1e-4)))
    assert model_fingerprint(base) != model_fingerprint(type(base)(hf.config, hf.state_dict(), base.device, torch.float64))
    # Sampled hashing (large models) still tells checkpoints apart.
    assert model_fingerprint(base, full_limit=0) != model_fingerprint(to_ours(perturbed(hf, 1e-4)), full_limit=0)
    cfg = config("autoregressive")
    two_turns(new_engine(weights, tmp_path), cfg)
    other = new_engine((perturbed(hf, 1e-3), draft), tmp_path)
    _, stats, _ = two_turns(other, cfg)
    assert stats[0].disk_tokens == 0


def test_the_folder_is_capped_least_recently_used_first(weights, tmp_path):
    engine = new_engine(weights, tmp_path)
    cfg = config("autoregressive")
    ids = engine.encode(DOCUMENT)
    block_bytes = block_files_after(engine, ids[:40], cfg, tmp_path)  # text A: one block
    engine.disk_cache.max_bytes = 4 * block_bytes
    (a0,) = block_files(tmp_path)
    list(Slot(engine).generate(ids[64:200], cfg))  # text B: 4 whole blocks, A's is evicted
    b = [engine.disk_cache.path(block) for block in engine.disk_cache.blocks(ids[64:199], CHUNK, engine.kv_dtype_for(cfg),
                                                                            arithmetic=engine.target.arithmetic)]
    assert set(block_files(tmp_path)) == set(b) and a0 not in b
    assert sum(p.stat().st_size for p in b) <= engine.disk_cache.max_bytes
    # Blocks written in one prefill may share a modification time (the file system's clock is
    # coarse): give B's blocks distinct ones, oldest first, an hour ago.
    hour_ago = time.time_ns() - 3600 * 10**9
    for i, path in enumerate(b):
        os.utime(path, ns=(hour_ago + i * 10**9, hour_ago + i * 10**9))
    # Reading touches a block: B's first becomes the most recently used, so A's block, written
    # again, evicts B's second instead.
    assert list(Slot(engine).generate(ids[64:104], cfg))[0].disk_tokens == CHUNK
    list(Slot(engine).generate(ids[:40], cfg))
    files = block_files(tmp_path)
    assert a0 in files and b[0] in files and b[1] not in files and len(files) == 4
    # One prompt's blocks never evict each other: over the cap, the later ones are not kept.
    small = new_engine(weights, tmp_path / "small", max_bytes=2 * block_bytes)
    list(Slot(small).generate(ids, cfg))
    assert len(block_files(tmp_path / "small")) == 2
    assert list(Slot(small).generate(ids, cfg))[0].disk_tokens == 2 * CHUNK


def block_files_after(engine, prompt, cfg, folder) -> int:
    list(Slot(engine).generate(prompt, cfg))
    files = block_files(folder)
    assert len(files) == 1
    return files[0].stat().st_size


def test_a_prefill_on_an_unwritable_folder_still_answers(weights, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    engine = new_engine(weights, blocked / "kv")
    answers, _, _ = two_turns(engine, config("lookup"))
    reference, _, _ = two_turns(new_engine(weights), config("lookup"))
    assert answers == reference


def test_cli_chat_reads_the_prefill_back_after_a_restart(tiny_pair_dir, tmp_path, monkeypatch):
    """Each `main` call loads the models afresh: a restart, as far as the disk cache can tell."""
    doc = tmp_path / "doc.txt"
    doc.write_text(words(300, 21), encoding="utf-8")
    folder = tmp_path / "kv"
    base = ["chat", "--target", tiny_pair_dir["target"], "--draft", tiny_pair_dir["draft"], "--document", str(doc),
            "--question", Q1, "--max-new-tokens", "8", "--ignore-eos", "--budget", "32", "--chunk-size", "4",
            "--draft-window", "16", "--prefill-chunk", "64", "--json"]

    def run(*extra):
        code, out, err = run_main(base + list(extra))
        assert code == 0, err
        return json.loads(out)["turns"][0]

    first = run("--kv-cache-dir", str(folder))
    second = run("--kv-cache-dir", str(folder))
    plain = run("--no-kv-cache")
    assert first["stats"]["disk_tokens"] == 0 and second["stats"]["disk_tokens"] >= 256
    assert first["token_ids"] == second["token_ids"] == plain["token_ids"]
    assert plain["stats"]["disk_tokens"] == 0
    # The default folder follows $XDG_CACHE_HOME; --no-kv-cache writes nothing there.
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    run("--no-kv-cache")
    assert not xdg.exists()
    run()
    assert len(list((xdg / "triforce-studio" / "kv").glob("*.kv"))) >= 4
    code, _, err = run_main(base + ["--kv-cache-max-gb", "0"])
    assert code == 2 and err.strip().splitlines() == ["error: --kv-cache-max-gb must be > 0, got 0.0"]


def test_blocks_from_another_arithmetic_are_never_read(weights, tmp_path, monkeypatch):
    """K/V written with the native kernels is not what PyTorch's path computes (another order
    of summation): with a model's arithmetic off the kernels, the same prompt finds none of the
    blocks, and with them on again it finds them all."""
    from dataclasses import replace

    from triforce_core.models import int8, native_layers
    from triforce_core.models.arithmetic import EXACT, arithmetic_key

    if native_layers.kernel() is None:
        pytest.skip("no C compiler: one arithmetic only")
    cfg = config("autoregressive")
    prompt = new_engine(weights).encode(DOCUMENT)
    native = arithmetic_key("cpu", new_engine(weights).target.arithmetic)
    first = list(Slot(new_engine(weights, tmp_path)).generate(prompt, cfg))[0]
    assert first.disk_tokens == 0 and len(block_files(tmp_path)) == 9
    assert arithmetic_key("cpu", replace(EXACT, products=int8.WIDE)) != arithmetic_key("cpu")  # another arithmetic
    monkeypatch.setenv("TRIFORCE_NATIVE_LAYERS", "0")  # no environment variable names another
    assert arithmetic_key("cpu", new_engine(weights).target.arithmetic) == native
    torch_path = replace(EXACT, native_layers=False, native_attention=False)
    assert arithmetic_key("cpu", torch_path) != native
    engine = new_engine(weights, tmp_path)
    for model in (engine.target, engine.draft):
        model.arithmetic = torch_path
    other = list(Slot(engine).generate(prompt, cfg))[0]
    assert other.disk_tokens == 0 and len(block_files(tmp_path)) == 18  # its own blocks, beside the others
    again = list(Slot(new_engine(weights, tmp_path)).generate(prompt, cfg))[0]
    assert again.disk_tokens == 9 * CHUNK


def test_a_large_model_is_keyed_by_its_files_content(tmp_path):
    """Past `full_limit` the key is the content of the files the model came from, hashed once
    (kept by the file's identity) and changed by any byte of the file."""
    from tests.helpers.gguf_files import write_gguf
    from triforce_core.kv import disk

    path = write_gguf(make_hf("llama_mha", seed=3), tmp_path / "m.gguf", {})
    model = TriForceEngine.from_pretrained(str(path), device="cpu").target
    digests = tmp_path / "digests"
    key = model_fingerprint(model, full_limit=0, source=str(path))
    assert key != model_fingerprint(model, full_limit=0)  # sampled, without a source
    assert disk.file_digest(path, digests) == disk.file_digest(path, digests)
    (kept,) = digests.iterdir()
    kept.write_text("0" * 64)  # the kept digest is what a second start uses: no re-read
    assert disk.file_digest(path, digests) == "0" * 64
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # one byte of the file: a new identity, a new digest
    assert disk.file_digest(path, digests) not in ("0" * 64, kept.read_text())


def test_two_processes_writing_the_same_block_at_once_never_corrupt_it(tmp_path):
    """Two writers (separate processes) write one missing block at once, 15 times, while a third
    process reads it back all along: no read ever meets a torn, mixed or half-written file
    (each would be reported as a problem and deleted), and the folder ends with the block
    whole and no temporary files. Negative control, run by hand: writing the file in place instead of
    replacing it makes the reader meet truncated files."""
    import multiprocessing

    from tests.helpers.disk_writers import empty_like, read_checked, shared_block, write_rounds

    ctx = multiprocessing.get_context("spawn")  # fresh processes, as separate replicas are
    ready, both, done, seen, results = ctx.Barrier(3), ctx.Barrier(2), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    folder = str(tmp_path)
    writers = [ctx.Process(target=write_rounds, args=(i, folder, ready, both, 15, seen)) for i in range(2)]
    reader = ctx.Process(target=read_checked, args=(folder, ready, done, seen, results))
    try:
        for p in (*writers, reader):
            p.start()
        for p in writers:
            p.join(timeout=900)
            assert p.exitcode == 0
        done.set()
        found, differ, problems = results.get(timeout=120)
        reader.join(timeout=120)
    finally:
        for p in (*writers, reader):
            if p.is_alive():
                p.kill()
    assert problems == [] and differ == 0 and found >= 15
    disk, block, cache = shared_block(folder)
    into = empty_like(cache)
    assert disk.load(into, [block], 0, 1) == block.end and torch.equal(into.v, cache.v)
    assert [p.name for p in tmp_path.iterdir()] == [disk.path(block).name]
