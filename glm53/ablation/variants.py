"""Ablation variants: what `config.variants` names, parsed and checked against the base model before any work.

`config.variants` is a comma-separated list; a variant is

  FMT                              one GGUF format for every routed-expert matrix (F32, BF16, Q8_0, ... IQ2_XXS)
  gate=FMT,up=FMT,down=FMT         one format per matrix (the three keys belong to one variant)
  UD-IQ3_XXS                       Unsloth's release mix scaled to the model's MoE layers
  ...,N.matrix=FMT                 per-layer overrides of the variant before them (``F32,7.down=IQ2_S``)

each optionally followed by flags: ``+imatrix`` (quantize with the importance matrix), ``+int8`` (also the
non-expert matrices as int8 per output channel, the prior art's storage; glm53 only: GGUF has no such type, the
GGUF keeps them F32) or ``+q8_0`` (the non-expert matrices as Q8_0 in the GGUF), and ``+latent_int8`` /
``+latent_bf16`` / ``+latent_f32``: the DSA layers' MLA latent cache stored as int8 with one f32 absmax scale
per token (the release's serving layout) / bfloat16 / float32 (`ModelConfig.latent_cache_dtype`; glm53 only,
the GGUF is the same; without one the latent stays exact, in the model's dtype, as in the base;
``F32+latent_int8`` is the int8 latent alone). A new variant starts at an item without ``=``, at a key its
variant already has, or at ``gate=`` after a format (so a per-matrix mix is written gate first;
``Q4_K,down=Q6_K`` stays one variant); ``;`` also separates variants. Two expansions: ``per_role:FMT`` (one
variant per matrix role in FMT, the others F32) and ``per_layer:FMT`` (one variant per MoE layer in FMT, the
others F32).
"""

from __future__ import annotations

import dataclasses
import re

from glm53.config import ModelConfig
from glm53.errors import ConfigError
from glm53.quant.formats import get_format
from glm53.quant.mixes import MATRICES, ExpertMix, parse_mix

LATENT_FLAGS = {"latent_int8": "int8", "latent_bf16": "bfloat16", "latent_f32": "float32"}
FLAGS = ("imatrix", "int8", "q8_0", *LATENT_FLAGS)
FIELD = "config.variants"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # the spec as written (normalized spacing), flags last
    mix: ExpertMix  # unresolved (a UD mix resolves to the model's MoE layers)
    imatrix: bool = False
    int8: bool = False
    q8_0: bool = False
    latent: str = "auto"  # the latent_cache_dtype the variant runs with ("auto": exact, the base's)

    @property
    def file(self) -> str:
        """DIR/<file>: the name with ``=`` as ``-`` and ``,`` as ``_``, + ``.gguf``."""
        return _UNSAFE.sub("_", self.name.replace("=", "-").replace(",", "_")) + ".gguf"

    @property
    def dense_type(self) -> str:
        return "Q8_0" if self.q8_0 else "F32"

    def formats(self, cfg: ModelConfig) -> dict[tuple[int, str], str]:
        """{(layer, matrix): format} over the model's MoE layers."""
        return self.mix.formats(moe_layers(cfg))


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]


def _groups(spec: str) -> list[str]:
    out: list[list[str]] = []
    for part in spec.split(";"):
        current: list[str] | None = None
        keys: set[str] = set()
        for item in (x.strip() for x in part.split(",")):
            if not item:
                continue
            core = item.split("+")[0]
            key = core.split("=")[0].strip().lower() if "=" in core else None
            starts = key is None or key in keys or (key == "gate" and bool(current) and "=" not in current[0])
            if current is None or starts:
                current, keys = [], set()
                out.append(current)
            current.append(item)
            if key is not None:
                keys.add(key)
    return [",".join(g) for g in out]


def _one(text: str) -> Variant:
    flags: list[str] = []
    items = []
    for item in text.split(","):
        core, *fl = (x.strip() for x in item.split("+"))
        items.append(core)
        for f in fl:
            if f.lower() not in FLAGS:
                raise ConfigError(
                    f"{FIELD}: unknown flag +{f} in {text!r}; flags are {['+' + x for x in FLAGS]}"
                )
            if f.lower() not in flags:
                flags.append(f.lower())
    if "int8" in flags and "q8_0" in flags:
        raise ConfigError(f"{FIELD}: {text!r}: +int8 and +q8_0 both set the non-expert matrices; choose one")
    latent = [f for f in flags if f in LATENT_FLAGS]
    if len(latent) > 1:
        raise ConfigError(f"{FIELD}: {text!r}: {' and '.join('+' + f for f in latent)} both set the latent "
                          "cache; choose one")  # fmt: skip
    spec = ",".join(items)
    mix = parse_mix(spec, f"{FIELD} ({spec!r})")
    if mix is None:
        raise ConfigError(f"{FIELD}: {spec!r} quantizes nothing; use F32 for the unquantized reference")
    name = spec + "".join(f"+{f}" for f in FLAGS if f in flags)
    latent_dtype = LATENT_FLAGS[latent[0]] if latent else "auto"
    return Variant(name, mix, "imatrix" in flags, "int8" in flags, "q8_0" in flags, latent_dtype)


def _expand(text: str, cfg: ModelConfig | None) -> list[str]:
    kind, _, fmt = text.partition(":")
    fmt = fmt.strip()
    if kind == "per_role":
        return [",".join(f"{m}={fmt if m == r else 'F32'}" for m in MATRICES) for r in MATRICES]
    if cfg is None:
        raise ConfigError(f"{FIELD}: {text!r} needs the model's MoE layers")
    return ["F32," + ",".join(f"{layer}.{m}={fmt}" for m in MATRICES) for layer in moe_layers(cfg)]


def parse_variants(spec: str, cfg: ModelConfig | None = None) -> list[Variant]:
    """The variants of a `config.variants` string (module docstring); ConfigError naming the item otherwise.

    With `cfg`, each is also checked against the model (`check_variant`)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{FIELD}: expected a non-empty comma-separated string of variants, got {spec!r}")
    texts: list[str] = []
    for g in _groups(spec):
        head = g.split(",")[0]
        if head.startswith(("per_role:", "per_layer:")):
            if "," in g:
                raise ConfigError(f"{FIELD}: {g!r}: per_role: / per_layer: take one format and no overrides")
            texts.extend(_expand(g, cfg))
        else:
            texts.append(g)
    out: list[Variant] = []
    for t in texts:
        v = _one(t)
        if any(v.name == o.name for o in out):
            raise ConfigError(f"{FIELD}: variant {v.name!r} is listed twice")
        if cfg is not None:
            check_variant(v, cfg)
        out.append(v)
    return out


def row_length(cfg: ModelConfig, matrix: str) -> int:
    """The length of a routed-expert matrix's GGUF rows (its input width): hidden for gate / up, F for down."""
    return cfg.moe_intermediate_size if matrix == "down" else cfg.hidden_size


def check_variant(v: Variant, cfg: ModelConfig) -> None:
    """ConfigError when the model has no MoE layer, a latent flag has no DSA layer to act on, an override names
    another layer, or a format's block size does not divide the rows it would quantize."""
    moe = moe_layers(cfg)
    if not moe:
        raise ConfigError(f"{FIELD}: the base model has no routed experts (no MoE layer) to quantize")
    if v.latent != "auto" and "dsa" not in cfg.layer_types:
        raise ConfigError(f"{FIELD}: {v.name!r}: the base model has no DSA layer, so no latent cache to store "
                          f"as {v.latent}")  # fmt: skip
    for layer, _m, _ in v.mix.overrides:
        if layer not in moe:
            raise ConfigError(
                f"{FIELD}: {v.name!r}: layer {layer} is not a MoE layer of the base model {moe}"
            )
    for (layer, m), fmt in v.formats(cfg).items():
        k, bs = row_length(cfg, m), get_format(fmt).block_size
        if k % bs:
            raise ConfigError(
                f"{FIELD}: {v.name!r}: {fmt} blocks of {bs} do not divide the expert width: layer {layer} {m} rows "
                f"have {k} columns (hidden_size {cfg.hidden_size}, moe_intermediate_size {cfg.moe_intermediate_size})"
            )


def expert_bytes(v: Variant, cfg: ModelConfig) -> tuple[int, int]:
    """(bytes, weights) of the routed experts of the trunk's MoE layers in this variant."""
    e, total, n = cfg.n_routed_experts, 0, 0
    for (_, m), fmt in v.formats(cfg).items():
        k = row_length(cfg, m)
        rows = cfg.hidden_size if m == "down" else cfg.moe_intermediate_size
        total += e * rows * get_format(fmt).nbytes(k)
        n += e * rows * k
    return total, n
