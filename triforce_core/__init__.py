"""TriForce Studio's engine: lossless hierarchical speculative decoding for long contexts.

Public API:
    TriForceEngine, GenerationConfig, SamplingConfig, SpeculationConfig, CacheConfig,
    the events of `triforce_core.events`, and ModelLoadError / ContextLengthError.
Importing this package has no side effects (no model is loaded, nothing is downloaded).
"""

from .config import CacheConfig, ConfigError, GenerationConfig, SamplingConfig, SpeculationConfig
from .engine import ContextLengthError, GenerationResult, TriForceEngine
from .events import ChunksSelected, Committed, Drafted, Finished, GenerationStats, Prefilled, Verified
from .loading import ModelLoadError

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
    "TriForceEngine",
    "Verified",
]
__version__ = "0.1.0"
