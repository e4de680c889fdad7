"""Caches: preallocated tensors with an explicit length (see each module's docstring)."""

from .disk import DiskCache, model_fingerprint
from .full import FullCache
from .retrieval import RetrievalCache, Selection
from .store import CacheFullError, KVStore, kv_dtype_name, resolve_kv_dtype
from .streaming import StreamingCache

__all__ = ["CacheFullError", "DiskCache", "model_fingerprint", "FullCache", "KVStore", "RetrievalCache", "Selection", "StreamingCache",
           "kv_dtype_name", "resolve_kv_dtype"]
