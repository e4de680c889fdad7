"""The models a server can switch to, and the ones it holds loaded.

    models = ServedModels(load, ModelFolders.default(["/data/models"]), started=("smollm2", None))
    models.choices()            # ModelChoice: the demo pair, SmolLM2, the started model, GGUF files found
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
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..engine import TriForceEngine
from ..models.gguf_file import SMOLLM2, GGUFError, smollm2_path
from ..models.loading import DEMO_DRAFT, DEMO_TARGET, ModelLoadError, default_model_names, served_model_name
from ..models.folders import ModelFolders
from .slots import SlotPool

DEMO_ID = "triforce-demo"
TOOL_NOTES = {"lmstudio": "LM Studio", "ollama": "Ollama", "hf": "Hugging Face cache", "models-dir": "models folder",
              "file": "opened by path"}


def _real(target: str) -> str:
    """A file's path with links resolved (other targets as they are)."""
    return str(Path(target).resolve()) if os.path.isfile(target) else target


class UnknownModel(ValueError):
    """No model of that id can be served (one line)."""


@dataclass(frozen=True)
class ModelChoice:
    id: str  # the picker's value and the HTTP API's `model`
    note: str  # one line on what it is
    target: str  # what `TriForceEngine.from_pretrained` loads
    draft: str | None = None

    @property
    def label(self) -> str:
        return f"{self.id} ({self.note})"


@dataclass(eq=False)
class ServedModel:
    """A loaded model: its engine and the HTTP API's cache slots over it."""

    choice: ModelChoice
    engine: TriForceEngine
    slots: SlotPool

    @property
    def id(self) -> str:
        return self.choice.id


def builtin_choices() -> list[ModelChoice]:
    """The embedded demo pair and SmolLM2, where installed."""
    out = []
    if DEMO_TARGET.is_dir():
        out.append(ModelChoice(DEMO_ID, "embedded demo pair: quotes from book-length documents; not a language model",
                               str(DEMO_TARGET), str(DEMO_DRAFT) if DEMO_DRAFT.is_dir() else None))
    try:
        smollm2_path()
    except GGUFError:
        pass  # not installed: not offered
    else:
        # Its draft, once one ships, comes by the same rule as on the command line.
        out.append(ModelChoice(SMOLLM2, "SmolLM2-135M-Instruct: real language, 8K window", SMOLLM2,
                               default_model_names(SMOLLM2, None)[1]))
    return out


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
                 started: tuple[str, str | None], *, keep: int = 1, slots: int = 4):
        self._load = load
        self.folders = folders
        self.keep = keep
        self.slots = slots
        self.started = started_choice(*started)
        self._opened: dict[str, ModelChoice] = {}  # files opened by path that discovery does not list
        self._alive: "weakref.WeakValueDictionary[str, ServedModel]" = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict[str, ServedModel] = collections.OrderedDict()
        self._pinned: ServedModel | None = None
        self._loading: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    # -- the catalogue ------------------------------------------------------------------------
    def choices(self) -> list[ModelChoice]:
        """Every model this server can switch to: the started one first, the built-in ones, the
        GGUF files found in the model folders (scanned now), files opened by path."""
        out = {self.started.id: self.started}
        for c in builtin_choices():
            out.setdefault(c.id, c)
        listed = {_real(c.target) for c in out.values()}
        for found in self.folders.discover():
            if str(found.path) not in listed:  # the started file is listed once, under its own id
                out.setdefault(found.id, ModelChoice(found.id, f"GGUF, {TOOL_NOTES[found.tool]}", str(found.path)))
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
        choice = ModelChoice(self.folders.id_for(path), f"GGUF, {TOOL_NOTES['file']}", str(path))
        with self._lock:
            self._opened.setdefault(choice.id, choice)
            return self._opened[choice.id]

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
            engine = self._load(choice)
            if engine.tokenizer is None:
                raise ModelLoadError(f"{choice.id} has no tokenizer: the app and the HTTP API need one")
            served = ServedModel(choice, engine, SlotPool(engine, capacity=self.slots))
            with self._lock:
                self._alive[choice.id] = served
                self._use(served)
            return served

    def _use(self, served: ServedModel) -> None:
        """Most recently used; beyond `keep` (the started model aside), the oldest are let go."""
        if served.id == self.started.id:
            return
        self._recent[served.id] = served
        self._recent.move_to_end(served.id)
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)
