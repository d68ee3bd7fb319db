"""Typed, frozen configuration models. Imports no torch and no ray.

Checkpoint metadata (JSON only) is read once, while a config is validated.
"""

from configs.cluster import ParallelConfig, ReplicaConfig
from configs.engine import LLMConfig
from configs.files import ConfigError, load, validate
from configs.serve import DeploymentOptions, ServeArgs
from configs.speculative import AdvancedSamplingMode, DSparkDecodingConfig, SpeculativeDecodingMode

__all__ = [
    "AdvancedSamplingMode",
    "ConfigError",
    "DeploymentOptions",
    "ServeArgs",
    "DSparkDecodingConfig",
    "LLMConfig",
    "ParallelConfig",
    "ReplicaConfig",
    "SpeculativeDecodingMode",
    "load",
    "validate",
]
