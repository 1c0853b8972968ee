"""Configs: YAML with `defaults:` inheritance, dotted overrides and typed sections."""

from rlhflab.config.loader import compose, load_config, save_effective_config
from rlhflab.config.schema import (
    DatasetConfig,
    GenerationConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    RewardConfig,
    RewardSource,
    TrainingConfig,
    f,
)

__all__ = [
    "compose", "load_config", "save_effective_config", "f",
    "DatasetConfig", "GenerationConfig", "LoggingConfig", "LoRAConfig", "ModelConfig",
    "RewardConfig", "RewardSource", "TrainingConfig",
]
