"""Every error type glm53 raises for bad input, in one place.

Each names what was wrong: the config field, the file and tensor, the GGUF path, the rule and tensor. Entry
points print one line per error (and the list of problems where there are several) and exit non-zero.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration field is unknown, missing or inconsistent. The message names the field."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded. ``problems`` lists every problem found (one line each)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


class GGUFError(ValueError):
    """A GGUF file that cannot be read: malformed, truncated, unsupported, or unreachable."""


class ShardingError(ValueError):
    """A rule set cannot shard a tensor (collision, unknown axis, indivisible dimension); the message names it."""


class DataError(ValueError):
    """A corpus, tokenizer or token file that cannot be used; the message names the file or field."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a non-finite loss); the message names the step and the checkpoint kept."""
