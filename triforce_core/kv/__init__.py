"""The kv wing: caches as preallocated tensors with an explicit length (see each module's docstring).

The full cache, the retrieval level's selection over it, the small draft's StreamingLLM
window, and the content-keyed disk cache. May import `models` and the base modules only.
"""

from .disk import DiskCache, model_fingerprint
from .full import FullCache
from .retrieval import RetrievalCache, Selection
from .store import CacheFullError, KVStore, kv_dtype_name, resolve_kv_dtype
from .streaming import StreamingCache

__all__ = ["CacheFullError", "DiskCache", "model_fingerprint", "FullCache", "KVStore", "RetrievalCache", "Selection", "StreamingCache",
           "kv_dtype_name", "resolve_kv_dtype"]
