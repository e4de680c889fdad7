"""The models a server can switch to, and the ones it holds loaded.

    models = ServedModels(load, ModelFolders.default(["/data/models"]), started=("smollm2", None))
    models.choices()            # ModelChoice: the started model, SmolLM2, the demo pair, GGUF files found
    served = models.get("smollm2")   # ServedModel(choice, engine, slots), loaded once

The app's model picker and the HTTP API's `/v1/models` list the same `choices()`; a user's pick
or a request's `model` is `get(id)`. Models are per caller, never per server: one user's switch
loads (or finds) another engine and changes nothing another user or request holds, so an answer
running on one model is never disturbed by a switch to another.

Memory: the started model stays loaded, and so do the `keep` most recently used others; a
model beyond those stays in memory only while something still holds its `ServedModel` (a
user's session, a request) and is freed with the last of them. Two callers asking for a model
being loaded wait for the one load. A load runs in the caller's thread, not on the engine's
worker, so the other users' answers go on meanwhile (loading touches no cache).

Loads stay within the machine: at most `max_loaded` models in memory at once and at most
`max_bytes` of their weights (`--max-loaded-models`, `--max-model-gb`; by default from the
machine's memory). A load that would pass either first lets go of the least recently used
models only the registry holds (never the started one, never one a caller holds: an answer
running on it is not disturbed), then, if still over, is refused in one line with the
numbers. A model's size before it is loaded is its files' size (a GGUF file's weights stay
as stored); once loaded, its weights' bytes count.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..config import GB
from ..engine import TriForceEngine
from ..models import families
from ..models.families import Refusal
from ..models.chunked_file import GEMMA3 as GEMMA3_FILE
from ..models.gguf_file import ARCHITECTURES, GEMMA3, SMOLLM2, GGUFError, header_facts, smollm2_path
from ..models.loading import (DEMO_DRAFT, DEMO_TARGET, ModelLoadError, default_model_names, served_model_name,
                              weight_files)
from ..models.folders import ModelFolders
from .slots import SlotPool

DEMO_ID = "triforce-demo"
# Of the machine's memory, what loaded models' weights may take by default: the rest is left to
# the caches (a long document's K/V is gigabytes), the documents and the other programs.
MEMORY_SHARE = 0.5
# A file pairs with a draft from the same folders whose tokens and ids are its own and whose file
# is at most this share of its size: a draft must cost far less than the target to pay.
DRAFT_SHARE = 0.25
TOOL_NOTES = {"lmstudio": "LM Studio", "ollama": "Ollama", "hf": "Hugging Face cache", "models-dir": "models folder",
              "file": "opened by path"}


def _real(target: str) -> str:
    """A file's path with links resolved (other targets as they are)."""
    return str(Path(target).resolve()) if os.path.isfile(target) else target


class UnknownModel(ValueError):
    """No model of that id can be served (one line)."""


def machine_memory() -> int | None:
    """Bytes of physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_limits() -> tuple[int, int | None]:
    """(models, bytes) loaded at most by default: half the memory for weights, and one model
    per 4 GB of memory (at least 2: the started model and one switched to)."""
    total = machine_memory()
    if total is None:
        return 2, None
    return max(2, int(total // (4 * 2**30))), int(total * MEMORY_SHARE)


def files_bytes(name: str | None) -> int:
    """The size of a model's weight files on disk (0 for a hub id or what cannot be read)."""
    try:
        return sum(f.stat().st_size for f in weight_files(name))
    except OSError:
        return 0


def engine_bytes(engine: TriForceEngine) -> int:
    """The weights a loaded engine holds (target and draft)."""
    return sum(m.weight_bytes() for m in (engine.target, engine.draft) if m is not None)


@dataclass(frozen=True)
class ModelChoice:
    id: str  # the picker's value and the HTTP API's `model`
    note: str  # one line on what it is
    target: str  # what `TriForceEngine.from_pretrained` loads
    draft: str | None = None
    refusal: Refusal | None = None  # a file of a family or feature the engine does not run (its header says)

    @property
    def label(self) -> str:
        """The picker's entry; a file the engine does not run says why ("— not supported: mixture
        of experts"): a Gradio dropdown cannot grey one entry out."""
        said = f" — {self.refusal.short}" if self.refusal is not None else ""
        return f"{self.id} ({self.note}){said}"


@dataclass(eq=False)
class ServedModel:
    """A loaded model: its engine and the HTTP API's cache slots over it."""

    choice: ModelChoice
    engine: TriForceEngine
    slots: SlotPool

    @property
    def id(self) -> str:
        return self.choice.id


DEMO_NOTE = "a 64K-window copier for demonstrations"
SMOLLM2_NOTE = "SmolLM2-135M-Instruct: real language"
# A base model: it continues text; a chat over a document is laid out as plain text (`prompting`).
GEMMA3_NOTE = "Gemma 3 270M, base model, no chat template"
DEMO_NAMES = ("demo", DEMO_ID)  # what `python app.py --target` takes for the embedded demo pair


def builtin_choices() -> list[ModelChoice]:
    """SmolLM2 and Gemma 3 270M (each where installed), then the embedded demo pair. Gemma 3's
    file is not assembled here (only its packages are looked for): the first load assembles it;
    whether the engine runs it is said by its family (`families.refusal`), as for any file."""
    out = []
    try:
        smollm2_path()
    except GGUFError:
        pass  # not installed: not offered
    else:
        # its small draft by the same rule as on the command line
        out.append(ModelChoice(SMOLLM2, SMOLLM2_NOTE, SMOLLM2, default_model_names(SMOLLM2, None)[1]))
    if GEMMA3_FILE.installed():
        out.append(ModelChoice(GEMMA3, GEMMA3_NOTE, GEMMA3, refusal=gemma3_refusal()))
    if DEMO_TARGET.is_dir():
        out.append(ModelChoice(DEMO_ID, DEMO_NOTE, str(DEMO_TARGET), str(DEMO_DRAFT) if DEMO_DRAFT.is_dir() else None))
    return out


def gemma3_refusal() -> Refusal | None:
    """Why the engine cannot run Gemma 3 270M, or None: its assembled file's header where the
    file is there, else its architecture alone (the file is not assembled to be listed)."""
    final = GEMMA3_FILE.final_path()
    if final.is_file() and final.stat().st_size == GEMMA3_FILE.size:
        return header_facts(final)[0]
    return families.refusal(GEMMA3_FILE.architecture, {}, ARCHITECTURES)


def app_model_names(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """The models the app starts with: no `--target`, SmolLM2 with its small draft (the app opens
    on real language); `demo` (or `triforce-demo`), the embedded demo pair; anything else as the
    command line takes it. The command line's own default stays the demo pair
    (`loading.default_model_names`). Raises ModelLoadError, saying what to do, where SmolLM2
    is not installed and no target was named."""
    if target in DEMO_NAMES:
        return default_model_names(None, draft)
    if target is None:
        try:
            smollm2_path()
        except GGUFError as e:
            raise ModelLoadError(f"the app opens on SmolLM2 by default, but {e}; or start the demo pair: "
                                 "python app.py --target demo") from None
        target = SMOLLM2
    return default_model_names(target, draft)


def started_choice(target: str, draft: str | None) -> ModelChoice:
    """The model the server was started with (`--target/--draft`, defaults filled in)."""
    model_id = served_model_name(target)
    builtin = {c.id: c for c in builtin_choices()}.get(model_id)
    if builtin is not None:
        return replace(builtin, draft=draft)
    return ModelChoice(model_id, "the model this server was started with", target, draft)


class ServedModels:
    """The catalogue of choices and the loaded engines (see the module docstring); thread-safe.

    `load(choice)` returns a ready engine (device, dtype and disk cache set) or raises
    ModelLoadError; `slots` is each model's `SlotPool` capacity."""

    def __init__(self, load: Callable[[ModelChoice], TriForceEngine], folders: ModelFolders,
                 started: tuple[str, str | None], *, keep: int = 1, slots: int = 4,
                 max_loaded: int | None = None, max_bytes: int | None = None):
        models, nbytes = default_limits()
        self.max_loaded = max_loaded if max_loaded is not None else models
        self.max_bytes = max_bytes if max_bytes is not None else nbytes
        if self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {self.max_loaded}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"--max-model-gb must be above 0, got {self.max_bytes / GB:g}")
        self._load = load
        self.folders = folders
        self.keep = keep
        self.slots = slots
        self.started = started_choice(*started)
        self._opened: dict[str, ModelChoice] = {}  # files opened by path that discovery does not list
        # path -> (file identity, (its header's verdict, its token list's digest, its size))
        self._refusals: dict[str, tuple[tuple, tuple[Refusal | None, str | None, int]]] = {}
        self._alive: "weakref.WeakValueDictionary[str, ServedModel]" = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict[str, ServedModel] = collections.OrderedDict()
        self._pinned: ServedModel | None = None
        self._loading: dict[str, threading.Lock] = {}
        self._pending: dict[str, int] = {}  # models being loaded now: the bytes each was counted at
        self._lock = threading.Lock()

    # -- the catalogue ------------------------------------------------------------------------
    def choices(self) -> list[ModelChoice]:
        """Every model this server can switch to: the started one first, the built-in ones, the
        GGUF files found in the model folders (scanned now), files opened by path."""
        out = {self.started.id: self.started}
        for c in builtin_choices():
            out.setdefault(c.id, c)
        listed = {_real(c.target) for c in out.values()}
        found_files = [f for f in self.folders.discover() if str(f.path) not in listed]  # the started file once
        # drafts: the files found and the listed ones (Gemma 3 270M by its name, once assembled)
        candidates = [(f.id, f.path) for f in found_files] + [(c.id, Path(c.target)) for c in out.values()
                                                              if os.path.isfile(c.target)]
        by_name = {}
        if GEMMA3 in out and GEMMA3_FILE.final_path().is_file():
            candidates.append((GEMMA3, GEMMA3_FILE.final_path()))
            by_name[str(GEMMA3_FILE.final_path())] = GEMMA3
        drafts = self._drafts(candidates)
        for found in found_files:
            draft = drafts.get(str(found.path))
            note = f"GGUF, {TOOL_NOTES[found.tool]}" + (f"; draft {draft[0]}" if draft else "")
            out.setdefault(found.id, ModelChoice(found.id, note, str(found.path),
                                                 by_name.get(draft[1], draft[1]) if draft else None,
                                                 refusal=self._refusal(found.path)))
        with self._lock:
            for c in self._opened.values():
                out.setdefault(c.id, c)
        return list(out.values())

    def find(self, model_id: str) -> ModelChoice:
        for c in self.choices():
            if c.id == model_id:
                return c
        raise UnknownModel(f"no model {model_id!r} here: pick one of the list (GET /v1/models)")

    def open_path(self, text: str) -> ModelChoice:
        """The GGUF file at `text`, when the model folders hold it (else PathRefused, one line)."""
        path = self.folders.allowed(text)
        for c in self.choices():
            if c.target == str(path):
                return c
        choice = ModelChoice(self.folders.id_for(path), f"GGUF, {TOOL_NOTES['file']}", str(path),
                             refusal=self._refusal(path))
        with self._lock:
            self._opened.setdefault(choice.id, choice)
            return self._opened[choice.id]

    def _refusal(self, path: Path) -> Refusal | None:
        """Why the engine cannot run the GGUF file (`gguf_file.refusal_of`: its header alone)."""
        return self._facts(path)[0]

    def _facts(self, path: Path) -> tuple[Refusal | None, str | None, int]:
        """(its refusal, its token list's digest, its size) of the GGUF file
        (`gguf_file.header_facts`), kept while the file is unchanged: the picker lists every
        file at each page load."""
        try:
            st = os.stat(path)
        except OSError:
            return None, None, 0
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            kept = self._refusals.get(str(path))
        if kept is not None and kept[0] == key:
            return kept[1]
        facts = (*header_facts(path), st.st_size)
        with self._lock:
            self._refusals[str(path)] = (key, facts)
        return facts

    def _drafts(self, files: list[tuple[str, Path]]) -> dict[str, tuple[str, str]]:
        """For each GGUF file among `files` ((id, path)), the draft the picker pairs it with:
        the smallest other file that the engine runs, whose token list is the same and whose
        size is at most DRAFT_SHARE of the target's (path -> (the draft's id, its path))."""
        facts = {}
        for model_id, path in files:
            if str(path) not in facts and (path.suffix.lower() == ".gguf" or os.path.isfile(path)):
                refusal, vocabulary, size = self._facts(path)
                if vocabulary is not None and refusal is None and size > 0:
                    facts[str(path)] = (model_id, vocabulary, size)
        pairs = {}
        for target, (_, vocabulary, size) in facts.items():
            fits = [(s, i, p) for p, (i, v, s) in facts.items() if p != target and v == vocabulary and s <= DRAFT_SHARE * size]
            if fits:
                _, draft_id, draft_path = min(fits)
                pairs[target] = (draft_id, draft_path)
        return pairs

    # -- loaded models ------------------------------------------------------------------------
    def loaded(self, model_id: str) -> ServedModel | None:
        """The model if it is in memory now (nothing is loaded)."""
        with self._lock:
            return self._alive.get(model_id)

    def default(self) -> ServedModel:
        """The started model, loaded on the first call and kept."""
        if self._pinned is None:
            self._pinned = self.get(self.started.id)
        return self._pinned

    def get(self, model_id: str) -> ServedModel:
        """The model `model_id`, loaded now if it is not in memory (UnknownModel, ModelLoadError)."""
        choice = self.find(model_id)
        if choice.refusal is not None:  # said without loading anything, as a failed load says it
            raise ModelLoadError(f"{Path(choice.target).name}: {choice.refusal.line}")
        with self._lock:
            served = self._alive.get(choice.id)
            if served is not None:
                self._use(served)
                return served
            gate = self._loading.setdefault(choice.id, threading.Lock())
        with gate:  # one load per model; the others wait for it
            with self._lock:
                served = self._alive.get(choice.id)
                if served is not None:
                    self._use(served)
                    return served
            self._make_room(choice)
            try:
                engine = self._load(choice)
                if engine.tokenizer is None:
                    raise ModelLoadError(f"{choice.id} has no tokenizer: the app and the HTTP API need one")
                served = ServedModel(choice, engine, SlotPool(engine, capacity=self.slots))
                with self._lock:
                    self._alive[choice.id] = served
                    self._use(served)
            finally:
                with self._lock:
                    self._pending.pop(choice.id, None)
            return served

    def memory(self) -> dict:
        """The models in memory now and their weights' bytes, against the limits."""
        with self._lock:
            alive = list(self._alive.values())
        return {"models": [m.id for m in alive], "bytes": sum(engine_bytes(m.engine) for m in alive),
                "max_models": self.max_loaded, "max_bytes": self.max_bytes}

    def _make_room(self, choice: ModelChoice) -> None:
        """Let go of the least recently used models only the registry holds until `choice` fits
        the limits; else ModelLoadError with the numbers."""
        need = files_bytes(choice.target) + files_bytes(choice.draft)

        def over() -> tuple[int, int] | None:
            alive = list(self._alive.values())
            count = len(alive) + len(self._pending)  # a model being loaded by another caller counts
            held = sum(engine_bytes(m.engine) for m in alive) + sum(self._pending.values())
            too_many = count + 1 > self.max_loaded
            too_big = self.max_bytes is not None and held + need > self.max_bytes
            return (count, held) if too_many or too_big else None

        with self._lock:
            while over() is not None and self._recent:
                self._recent.popitem(last=False)  # the oldest of those kept for reuse
                gc.collect()  # a let-go model's weights are freed before the next count
            numbers = over()
            if numbers is None:
                self._pending[choice.id] = need
                return
            count, held = numbers
            in_use = ", ".join(sorted([*self._alive.keys(), *self._pending]))
        limit = f"{self.max_loaded} models" + (f" / {self.max_bytes / GB:.1f} GB" if self.max_bytes else "")
        raise ModelLoadError(
            f"{choice.id} is not loaded: {count} models ({held / GB:.1f} GB) are in memory and in use ({in_use}), "
            f"and {choice.id} needs about {need / GB:.1f} GB more, over this server's limit of {limit} "
            f"(--max-loaded-models, --max-model-gb)")

    def _use(self, served: ServedModel) -> None:
        """Most recently used; beyond `keep` (the started model aside), the oldest are let go."""
        if served.id == self.started.id:
            return
        self._recent[served.id] = served
        self._recent.move_to_end(served.id)
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)
