"""The kv wing: caches as preallocated tensors with an explicit length (see each module's docstring).

The full cache (float, or int16 planes for the integer kernel), the retrieval level's selection over it, the small draft's StreamingLLM
window, and the content-keyed disk cache. May import `models` and the base modules only.
"""

from .disk import DiskCache, model_fingerprint
from .full import FullCache
from .int16 import INT16, Int16Cache, check_int16, new_full_cache
from .retrieval import RetrievalCache, Selection
from .store import CacheFullError, KVStore, kv_dtype_name, resolve_kv_dtype
from .streaming import StreamingCache

__all__ = ["CacheFullError", "DiskCache", "model_fingerprint", "FullCache", "INT16", "Int16Cache", "KVStore",
           "RetrievalCache", "Selection", "StreamingCache", "check_int16", "kv_dtype_name", "new_full_cache",
           "resolve_kv_dtype"]
