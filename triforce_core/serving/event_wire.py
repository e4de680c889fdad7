"""The engine's events as JSON, for the HTTP stream's `triforce.events` extension, and back.

    data = event_to_json(Committed((5, 9), ("lookup", "target"), " the"))
    # {"type": "Committed", "token_ids": [5, 9], "levels": ["lookup", "target"], "text": " the"}
    event_from_json(data) == Committed((5, 9), ("lookup", "target"), " the")   # True

One place for both sides: the server writes each event of a streamed answer with
`event_to_json`, a client (`triforce_core.serving.remote`) rebuilds the same frozen dataclasses
with `event_from_json`, so whatever renders events in this process renders a served engine's
unchanged. Every field of the dataclass is written (tuples as lists, `TokenCheck`s and
`GenerationStats` as nested objects).

What comes back from a server is untrusted: `event_from_json` takes only a known type with
exactly its fields, each of its declared type (a bool is no int, an int passes for a float, a
float is finite), lists and strings bounded, levels among `LEVELS` (the statistics' keys too), a
statistics' mode among `MODES`, and the lengths that go together equal (a commit's tokens and
levels, a selection's spans and counts); anything else is a `WireError` naming the field. A
missing field is an error even where the dataclass has a default: a writer that dropped one must
not pass unnoticed. What an event says against the prompt it answers (positions, counts) is the
reader's to check (`remote`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from ..config import MODES
from ..decoding import events as ev

EVENT_TYPES = {cls.__name__: cls for cls in (ev.PrefillProgress, ev.Prefilled, ev.ChunksSelected, ev.Drafted,
                                             ev.Verified, ev.Committed, ev.Finished)}
MAX_ITEMS = 1 << 20  # a list's length: a selection over a million-token context fits
MAX_TEXT = 1 << 22  # a string's characters
MAX_INT = 1 << 53  # an integer's size (a count, a position, a token id): exact as a float too
# Fields that hold level names, and the names they may hold.
_LEVEL_FIELDS = {("Drafted", "level"), ("Verified", "level"), ("Committed", "levels"), ("TokenCheck", "proposer"),
                 ("TokenCheck", "verifier")}
_HINTS: dict[type, dict[str, Any]] = {}


class WireError(ValueError):
    """An event that cannot be read back (one line naming the field)."""


def event_to_json(event: ev.Event) -> dict:
    """`event` as a JSON-ready dict: {"type": class name, every field}."""
    if type(event).__name__ not in EVENT_TYPES:
        raise TypeError(f"not an engine event: {type(event).__name__}")
    return {"type": type(event).__name__, **_plain(dataclasses.asdict(event))}


def event_from_json(data: Any) -> ev.Event:
    """The event `data` describes (`WireError` for anything but what `event_to_json` writes)."""
    if not isinstance(data, dict):
        raise WireError(f"an event must be an object, got {type(data).__name__}")
    name = data.get("type")
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"unknown event type {str(name)[:40]!r}")
    return _dataclass(cls, {k: v for k, v in data.items() if k != "type"}, name)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _dataclass(cls: type, data: Any, where: str):
    if not isinstance(data, dict):
        raise WireError(f"{where} must be an object")
    fields = {f.name for f in dataclasses.fields(cls)}
    missing, extra = fields - set(data), set(data) - fields
    if missing or extra:
        what = (f"lacks {', '.join(sorted(missing))}" if missing
                else f"has unknown fields {', '.join(sorted(extra))[:200]}")
        raise WireError(f"{where} {what}")
    hints = _hints(cls)
    values = {name: _value(data[name], hints[name], f"{where}.{name}") for name in fields}
    for name in fields:
        if (cls.__name__, name) in _LEVEL_FIELDS:
            levels = values[name] if isinstance(values[name], tuple) else (values[name],)
            _levels(levels, f"{where}.{name}")
    _together(cls, values, where)
    return cls(**values)


def _levels(names, where: str) -> None:
    bad = [x for x in names if x not in ev.LEVELS]
    if bad:
        raise WireError(f"{where}: unknown level {str(bad[0])[:40]!r}")


def _together(cls: type, values: dict, where: str) -> None:
    """The invariants between an event's fields that the engine always keeps."""
    if cls is ev.Committed and len(values["token_ids"]) != len(values["levels"]):
        raise WireError(f"{where}: {len(values['token_ids'])} token_ids but {len(values['levels'])} levels")
    if cls is ev.ChunksSelected and len(values["chunk_token_spans"]) != len(values["scores_or_counts"]):
        raise WireError(f"{where}: {len(values['chunk_token_spans'])} chunk_token_spans but "
                        f"{len(values['scores_or_counts'])} scores_or_counts")
    if cls is ev.GenerationStats:
        if values["mode"] not in MODES:
            raise WireError(f"{where}.mode: unknown mode {values['mode'][:40]!r}")
        for name, value in values.items():
            if isinstance(value, dict):  # keyed by level, or by "proposer:verifier"
                _levels([part for key in value for part in key.split(":")], f"{where}.{name}")


def _value(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _value(value, inner[0], where)
        raise WireError(f"{where}: unsupported type")  # no such field today
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise WireError(f"{where} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or not -MAX_INT <= value <= MAX_INT:
            raise WireError(f"{where} must be an integer of at most {MAX_INT} in size")
        return value
    if hint is float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, int) and not -MAX_INT <= value <= MAX_INT)
                or (isinstance(value, float) and not math.isfinite(value))):
            raise WireError(f"{where} must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise WireError(f"{where} must be a string of at most {MAX_TEXT} characters")
        return value
    if origin is tuple:
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise WireError(f"{where} must be a list of at most {MAX_ITEMS} items")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise WireError(f"{where} must have {len(args)} items")
        return tuple(_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict) or len(value) > MAX_ITEMS:
            raise WireError(f"{where} must be an object")
        return {_value(k, args[0], f"{where} key"): _value(v, args[1], f"{where}[{str(k)[:40]!r}]")
                for k, v in value.items()}
    raise WireError(f"{where}: unsupported type {hint!r}")
