"""Routed-expert format mixes: the matrices, the storage layouts, the UD-IQ3_XXS table and the spec parser.

A mix gives each routed-expert matrix (layer, "gate" | "up" | "down") a GGUF format. Every place that names a
mix (the ``quant`` config section, the memory budget's --experts, the GGUF writer) reads it with `parse_mix`:

  "none"                              dense experts (no mix: `parse_mix` returns None)
  "Q4_K"                              one format for every matrix
  "gate=IQ2_S,up=IQ2_S,down=IQ3_S"    one format per matrix; also a mapping or (matrix, format) pairs
  "UD-IQ3_XXS" / "ud_iq3_xxs"         Unsloth's release mix, scaled to the model's MoE layers (`ud_iq3_xxs_mix`)

A format or "UD-IQ3_XXS" may be followed by per-matrix formats ("Q4_K,down=Q6_K"), and any mix by per-layer
overrides ("UD-IQ3_XXS,45.gate=Q4_K": GGUF block 45's gate). The result is an `ExpertMix`; `ExpertMix.formats`
gives {(layer, matrix): format} for a model's MoE layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from glm53.errors import ConfigError
from glm53.quant.formats import GGUF_FORMATS, UnknownFormatError, get_format

MATRICES = ("gate", "up", "down")  # the routed-expert matrices of a MoE layer
LAYOUTS = ("planes", "reencoded")  # expert storage: GGUF blocks as planes | re-encoded (layout.py)
UD_IQ3_XXS_NAME = "ud_iq3_xxs"
MIX_NAMES = ("none", UD_IQ3_XXS_NAME)

# The release's 42 routed-expert layers (blk.45, the MTP layer, is not in the table).
RELEASE_MOE_LAYERS = tuple(range(3, 45))
# UD-IQ3_XXS: IQ2_S gate/up and IQ3_S down, except three layers. Public sources fix only the counts (82 IQ2_S,
# 41 IQ3_S, 3 IQ4_XS) and that just three layers deviate (those with IQ4_XS down: 11, 12, 44); which of the three
# also has IQ3_S gate/up is an assumption. No byte total depends on it (gate/up are split by rows: no padding).
UD_BASE = {"gate": "IQ2_S", "up": "IQ2_S", "down": "IQ3_S"}
IQ4_XS_DOWN_LAYERS = (11, 12, 44)
IQ3_S_GATE_UP_LAYER = 44
_OVERRIDE = re.compile(rf"(\d+)\.({'|'.join(MATRICES)})")  # a per-layer override key: "45.gate"


def _release_format(i: int, matrix: str) -> str:
    """The format of `matrix` in the release's MoE layer of ordinal i (0..41)."""
    layer = RELEASE_MOE_LAYERS[i]
    if matrix == "down":
        return "IQ4_XS" if layer in IQ4_XS_DOWN_LAYERS else UD_BASE["down"]
    return "IQ3_S" if layer == IQ3_S_GATE_UP_LAYER else UD_BASE[matrix]


def ud_iq3_xxs_mix(moe_layers: Sequence[int]) -> dict[tuple[int, str], str]:
    """The UD-IQ3_XXS mix {(layer, matrix): format} for a model whose MoE layers are `moe_layers`.

    Rule for n layers: MoE ordinal j stands for the release's ordinals i with floor(i * n / 42) = j (its share of
    the depth; with n > 42, for the one ordinal floor(j * 42 / n)) and takes, per matrix, the format most of them
    have (a tie: the larger one). For the release's 42 layers (3..44) the rule is the identity (`UD_IQ3_XXS`); a
    model of fewer layers keeps the release's base (IQ2_S gate/up, IQ3_S down) wherever the deviations are a
    minority of the depth a layer stands for, as in the release, where they are 3 layers of 42.
    """
    layers = [int(x) for x in moe_layers]
    n, n_release = len(layers), len(RELEASE_MOE_LAYERS)
    size = {"IQ2_S": 0, "IQ3_S": 1, "IQ4_XS": 2}
    mix = {}
    for j, layer in enumerate(layers):
        covered = [i for i in range(n_release) if i * n // n_release == j] or [j * n_release // n]
        for m in MATRICES:
            votes: dict[str, int] = {}
            for i in covered:
                f = _release_format(i, m)
                votes[f] = votes.get(f, 0) + 1
            mix[(layer, m)] = max(votes, key=lambda f: (votes[f], size[f]))
    return mix


UD_IQ3_XXS: dict[tuple[int, str], str] = ud_iq3_xxs_mix(RELEASE_MOE_LAYERS)  # the release's 126 tensors


def expert_format(name: Any, field: str, whole_mix: bool = False) -> str:
    """The GGUF format named `name` (any case); a ConfigError naming `field` when there is none (`whole_mix`:
    the message also lists the other spellings of a whole mix)."""
    expected = f"a GGUF type {list(GGUF_FORMATS)}"
    if whole_mix:
        expected = f"one of {list(MIX_NAMES)}, {expected} or gate=FMT,up=FMT,down=FMT"
    try:
        f = get_format(str(name))
    except UnknownFormatError:
        raise ConfigError(f"{field}: unknown quantization format {name!r}; expected {expected}") from None
    if f.name not in GGUF_FORMATS:
        raise ConfigError(f"{field}: {f.name} is not a GGUF type; expected {expected}")
    return f.name


def _matrix(m: Any, field: str) -> str:
    if m not in MATRICES:
        raise ConfigError(f"{field}: unknown matrix {m!r}; expected one of {list(MATRICES)}")
    return m


@dataclasses.dataclass(frozen=True)
class ExpertMix:
    """GGUF formats of the routed-expert matrices (build one with `parse_mix`).

    Every layer's matrices are `gate` / `up` / `down`; with `ud`, the UD-IQ3_XXS deviations (`ud_iq3_xxs_mix`
    entries that differ from `UD_BASE`) replace them on the model's MoE layers; `overrides` (layer, matrix,
    format) come last. Format names are normalized (upper case) and checked; overrides are sorted.
    """

    gate: str
    up: str
    down: str
    overrides: tuple[tuple[int, str, str], ...] = ()
    ud: bool = False

    def __post_init__(self):
        for m in MATRICES:
            object.__setattr__(self, m, expert_format(getattr(self, m), f"expert mix {m}"))
        out = {}
        for layer, m, f in self.overrides:
            key = (int(layer), _matrix(m, f"expert mix override {layer}.{m}"))
            if key in out:
                raise ConfigError(f"expert mix: override {layer}.{m} given twice")
            out[key] = expert_format(f, f"expert mix override {layer}.{m}")
        ordered = sorted(out.items(), key=lambda kv: (kv[0][0], MATRICES.index(kv[0][1])))
        object.__setattr__(self, "overrides", tuple((layer, m, f) for (layer, m), f in ordered))

    @property
    def base(self) -> dict[str, str]:
        """{matrix: format} of a layer without deviations or overrides."""
        return {m: getattr(self, m) for m in MATRICES}

    @property
    def spec(self) -> str:
        """The shortest spec `parse_mix` reads back to this mix."""
        if self.ud:
            parts = [UD_IQ3_XXS_NAME] + [f"{m}={f}" for m, f in self.base.items() if f != UD_BASE[m]]
        elif len(set(self.base.values())) == 1:
            parts = [self.gate]
        else:
            parts = [f"{m}={f}" for m, f in self.base.items()]
        return ",".join(parts + [f"{layer}.{m}={f}" for layer, m, f in self.overrides])

    def resolve(self, moe_layers: Sequence[int]) -> ExpertMix:
        """The mix for a model whose MoE layers are `moe_layers`: the UD deviations become overrides."""
        if not self.ud:
            return self
        table = {k: f for k, f in ud_iq3_xxs_mix(moe_layers).items() if f != UD_BASE[k[1]]}
        table.update({(layer, m): f for layer, m, f in self.overrides})
        return ExpertMix(
            self.gate, self.up, self.down, tuple((layer, m, f) for (layer, m), f in table.items())
        )

    def format(self, layer: int, matrix: str) -> str:
        """The format of `matrix` in block `layer` (a UD mix must be `resolve`d to the model's layers first)."""
        if self.ud:
            raise ValueError(f"expert mix {self.spec!r}: resolve it to the model's MoE layers first")
        for b, m, f in self.overrides:
            if (b, m) == (layer, matrix):
                return f
        return self.base[_matrix(matrix, "expert mix")]

    def formats(self, moe_layers: Sequence[int]) -> dict[tuple[int, str], str]:
        """{(layer, matrix): format} over the MoE layers `moe_layers`."""
        mix = self.resolve(moe_layers)
        return {(int(layer), m): mix.format(int(layer), m) for layer in moe_layers for m in MATRICES}


def _items(spec: Any, field: str) -> list[tuple[str | None, Any]]:
    """A spec -> [(key, value)]: key None for a whole-mix item ("Q4_K", "ud_iq3_xxs"), else "gate" / "45.up"."""
    if isinstance(spec, str):
        out = []
        for i, item in enumerate(x.strip() for x in spec.split(",")):
            if "=" not in item and i == 0:
                out.append((None, item))
            elif item.count("=") == 1:
                key, value = (x.strip() for x in item.split("="))
                out.append((key.lower(), value))
            else:
                raise ConfigError(
                    f"{field}: cannot parse {item!r} in {spec!r}; write FMT, gate=FMT,up=FMT,down=FMT or "
                    "UD-IQ3_XXS, then optional N.matrix=FMT overrides"
                )
        return out
    if isinstance(spec, Mapping):
        return [(str(k).lower(), v) for k, v in spec.items()]
    if isinstance(spec, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in spec):
        return [(str(k).lower(), v) for k, v in spec]
    raise ConfigError(f"{field}: expected a string, a mapping or (matrix, format) pairs, got {spec!r}")


def parse_mix(spec: Any, field: str = "expert mix") -> ExpertMix | None:
    """An `ExpertMix` from any mix spelling (module docstring), or None for dense experts ("none", "", None).

    An ExpertMix is returned as is. Errors are ConfigErrors naming `field` and the offending item
    (`field`.down for a bad format of down).
    """
    if isinstance(spec, ExpertMix):
        return spec
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return None
    base: dict[str, str] = {}
    given: set[str] = set()
    overrides: dict[tuple[int, str], str] = {}
    ud = False
    for key, value in _items(spec, field):
        if key is None:
            if str(value).lower() == "none":
                raise ConfigError(f"{field}: 'none' (dense experts) takes no formats or overrides: {spec!r}")
            if str(value).lower().replace("-", "_") == UD_IQ3_XXS_NAME:
                ud, base = True, dict(UD_BASE)
            else:
                base = dict.fromkeys(MATRICES, expert_format(value, field, whole_mix=True))
            continue
        override = _OVERRIDE.fullmatch(key)
        if key not in MATRICES and override is None:
            raise ConfigError(
                f"{field}: cannot parse {key!r} in {spec!r}; keys are {list(MATRICES)} or N.matrix (N a layer)"
            )
        if key in given:
            raise ConfigError(f"{field}: {key!r} given twice in {spec!r}")
        given.add(key)
        fmt = expert_format(value, f"{field}.{key}")
        if override is None:
            base[key] = fmt
        else:
            overrides[(int(override[1]), override[2])] = fmt
    missing = [m for m in MATRICES if m not in base]
    if missing:
        raise ConfigError(
            f"{field}: no type for {missing} in {spec!r}; a mix needs exactly one format per matrix "
            f"{list(MATRICES)}, one format for all, or {MIX_NAMES}"
        )
    return ExpertMix(**base, overrides=tuple((b, m, f) for (b, m), f in overrides.items()), ud=ud)
