"""Multi-turn episodes: environments that answer the model, tools it may call, and the
episode runner that keeps every token's role (action or context) from rendering to loss.

- `base`: the environment protocol (`reset`, `step` -> `StepResult`), loading, checks, timeouts
- `tools`: tools as plain functions, their schemas, the call parsers (hermes and plain)
- `render`: the chat template's per-turn delta, with the model's own ids kept as generated
- `episode`: `run_episodes` over a `generate` callable, and `collate_episodes` into tensors
- `preflight`: one canned episode before any model loads

docs/environments.md is the user's guide; `rlhflab.ops.multiturn` holds the advantages.
"""

from rlhflab.envs.base import EnvConfig, EnvError, Environment, StepResult, ToolUseEnv
from rlhflab.envs.episode import Episode, EpisodeBatch, EpisodeSetup, Generated, collate_episodes, run_episodes, \
    setup_episodes
from rlhflab.envs.preflight import EnvPreflight, preflight_env
from rlhflab.envs.render import ChatRenderer
from rlhflab.envs.tools import Tool, ToolCall, ToolTurn, answer_calls, load_tools, parse_calls, parse_hermes, \
    parse_plain

__all__ = [
    "EnvConfig", "EnvError", "Environment", "StepResult", "ToolUseEnv",
    "Episode", "EpisodeBatch", "EpisodeSetup", "Generated", "collate_episodes", "run_episodes", "setup_episodes",
    "EnvPreflight", "preflight_env", "ChatRenderer",
    "Tool", "ToolCall", "ToolTurn", "answer_calls", "load_tools", "parse_calls", "parse_hermes", "parse_plain",
]
