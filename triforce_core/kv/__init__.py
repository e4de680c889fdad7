"""Caches: preallocated tensors with an explicit length (see each module's docstring)."""

from .full import FullCache
from .retrieval import RetrievalCache, Selection
from .store import CacheFullError, KVStore
from .streaming import StreamingCache

__all__ = ["CacheFullError", "FullCache", "KVStore", "RetrievalCache", "Selection", "StreamingCache"]
