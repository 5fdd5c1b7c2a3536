"""The ``mesh`` section of an experiment config: mesh axes, their sizes and the sharding rule set."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from glm53.config.fields import from_dict
from glm53.errors import ConfigError

RULE_SET_NAMES = ("tp", "ep")  # the rule sets of glm53.parallel.rules (a test checks they agree)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ``mesh`` section of an experiment config.

    axes: mesh axis names. shape: devices per axis, at most one -1 (= the remaining devices); the default puts
    every device on "model". rules: the rule set, a key of `RULE_SETS` ("tp" | "ep").
    """

    axes: tuple[str, ...] = ("data", "model")
    shape: tuple[int, ...] = (1, -1)
    rules: str = "tp"

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "shape", tuple(self.shape))
        if (
            not self.axes
            or len(set(self.axes)) != len(self.axes)
            or not all(isinstance(a, str) for a in self.axes)
        ):
            raise ConfigError(f"config field 'mesh.axes': need distinct axis names, got {self.axes!r}")
        if len(self.shape) != len(self.axes):
            raise ConfigError(f"config field 'mesh.shape': {self.shape!r} has {len(self.shape)} entries for axes "
                              f"{self.axes!r}")  # fmt: skip
        ok = all(isinstance(s, int) and not isinstance(s, bool) and (s >= 1 or s == -1) for s in self.shape)
        if not ok or self.shape.count(-1) > 1:
            raise ConfigError(f"config field 'mesh.shape': sizes must be positive with at most one -1, got "
                              f"{self.shape!r}")  # fmt: skip
        if self.rules not in RULE_SET_NAMES:
            raise ConfigError(f"config field 'mesh.rules': unknown rule set {self.rules!r}; expected one of "
                              f"{sorted(RULE_SET_NAMES)}")  # fmt: skip

    def resolved_shape(self, n_devices: int) -> tuple[int, ...]:
        """`shape` with the -1 filled in for `n_devices` devices (ConfigError when they do not fit exactly)."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if n_devices % known:
                raise ConfigError(
                    f"config field 'mesh.shape': {self.shape!r} does not divide {n_devices} devices"
                )
            return tuple(n_devices // known if s == -1 else s for s in self.shape)
        if known != n_devices:
            raise ConfigError(
                f"config field 'mesh.shape': {self.shape!r} holds {known} devices, have {n_devices}"
            )
        return self.shape


def mesh_config_from_dict(d: Any) -> MeshConfig:
    """MeshConfig from the ``mesh`` ConfigDict / dict; unknown keys are an error."""
    return from_dict(MeshConfig, d, "mesh config")
