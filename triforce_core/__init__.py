"""TriForce Studio's engine: lossless hierarchical speculative decoding for long contexts.

Public API:
    TriForceEngine, GenerationConfig, SamplingConfig, SpeculationConfig, CacheConfig,
    the events of `triforce_core.decoding.events`, and ModelLoadError / ContextLengthError.
Importing this package has no side effects (no model is loaded, nothing is downloaded).
"""

from typing import TYPE_CHECKING

# Names are resolved on first use, so that light parts (document ingestion, the command
# line's --help) do not pay for importing torch and transformers.
_EXPORTS = {
    "CacheConfig": "config",
    "ConfigError": "config",
    "GenerationConfig": "config",
    "SamplingConfig": "config",
    "SpeculationConfig": "config",
    "ContextLengthError": "engine",
    "GenerationResult": "engine",
    "TriForceEngine": "engine",
    "ChunksSelected": "decoding.events",
    "Committed": "decoding.events",
    "Drafted": "decoding.events",
    "Finished": "decoding.events",
    "GenerationStats": "decoding.events",
    "Prefilled": "decoding.events",
    "TokenCheck": "decoding.events",
    "Verified": "decoding.events",
    "ModelLoadError": "models.loading",
}

if TYPE_CHECKING:  # pragma: no cover
    from .config import CacheConfig, ConfigError, GenerationConfig, SamplingConfig, SpeculationConfig
    from .engine import ContextLengthError, GenerationResult, TriForceEngine
    from .decoding.events import ChunksSelected, Committed, Drafted, Finished, GenerationStats, Prefilled, TokenCheck, Verified
    from .models.loading import ModelLoadError


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'triforce_core' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CacheConfig",
    "ChunksSelected",
    "Committed",
    "ConfigError",
    "ContextLengthError",
    "Drafted",
    "Finished",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "ModelLoadError",
    "Prefilled",
    "SamplingConfig",
    "SpeculationConfig",
    "TokenCheck",
    "TriForceEngine",
    "Verified",
]
__version__ = "0.1.0"
