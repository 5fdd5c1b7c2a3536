"""Per-device memory budget of GLM-5.3-Flash with GGUF routed experts, compared with the audit article.

  python -m experiments.memory_budget --config=configs/glm53_flash.py --experts=ud_iq3_xxs \
      --devices=8 --hbm_gb=16.9 --context=262144 --streams=3 --ladder --out=budget.json

Prints the parameter counts, the per-device bytes by component (routed experts as GGUF blocks and as planes,
non-expert weights per tensor class, vision tower, caches per context set, workspace), total and headroom under
the placement the run uses (the config's ``mesh.rules``; --placement for another), the totals under every
placement (the model's own tp / ep rules and the prior art's layout; a column says which is the run's and which
the prior art's), a comparison with the article's figures (under the prior art's placement) with a "why it
differs" column, and with --ladder which expert quantizations fit. --out
writes the full result as JSON (atomically). Everything comes from the model's shapes and logical axes, the
sharding rules and the format definitions (glm53/memory/); nothing is allocated.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from experiments import cli
from glm53.config import ConfigError, model_config_from_dict
from glm53.config.mesh import MeshConfig, mesh_config_from_dict
from glm53.files import write_json
from glm53.memory import budget
from glm53.memory.caches import CacheLayout
from glm53.memory.placement import PLACEMENTS
from glm53.memory.report import report
from glm53.quant.budget import LAYOUTS

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_EXPERTS = flags.DEFINE_string(
    "experts", "ud_iq3_xxs", f"routed-expert mix: {', '.join(budget.expert_mix_names())}"
)
_DEVICES = flags.DEFINE_integer("devices", 8, "tensor-parallel devices")
_HBM_GB = flags.DEFINE_float("hbm_gb", 16.9, "usable HBM per device, GB (1e9 bytes)")
_CONTEXT = flags.DEFINE_integer("context", 262144, "tokens per context set (one stream)")
_STREAMS = flags.DEFINE_integer("streams", 3, "context sets held at once")
_PLACEMENT = flags.DEFINE_enum(
    "placement",
    None,
    list(PLACEMENTS),
    "rule sets the tensors are placed by (glm53/memory/placement.py); default: the config's mesh.rules, "
    "what the run uses",
)
_LAYOUT = flags.DEFINE_enum("layout", "planes", list(LAYOUTS), "routed-expert storage layout")
_LATENT = flags.DEFINE_enum("latent_cache", "int8", ["int8", "bf16"], "MLA latent cache dtype")
_INDEXER = flags.DEFINE_enum(
    "indexer_cache",
    "pooled",
    ["pooled", "full"],
    "indexer cache: pooled keys only, or per-token keys/gates too",
)
_MTP_CACHE = flags.DEFINE_bool("mtp_cache", False, "add the MTP block's DSA cache to each context set")
_VISION = flags.DEFINE_bool("vision", True, "hold the vision tower (bf16)")
_WORKSPACE = flags.DEFINE_float(
    "workspace_gb", None, "workspace per device, GB (default: prior-art residual)"
)
_LADDER = flags.DEFINE_bool("ladder", False, "add the table of expert quantizations that fit")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")


def main(argv):
    del argv
    cli.require_config(_CONFIG.value, "configs/glm53_flash.py")
    try:
        section = _CONFIG.value.get("mesh")
        mesh = MeshConfig() if section is None else mesh_config_from_dict(section)
        result = budget.memory_budget(
            model_config_from_dict(_CONFIG.value.model),
            _EXPERTS.value,
            _DEVICES.value,
            _HBM_GB.value,
            _CONTEXT.value,
            _STREAMS.value,
            placement=_PLACEMENT.value,
            mesh_rules=mesh.rules,
            layout=_LAYOUT.value,
            cache=CacheLayout(latent=_LATENT.value, indexer=_INDEXER.value, include_mtp=_MTP_CACHE.value),
            vision=_VISION.value,
            workspace_gb=_WORKSPACE.value,
            ladder=_LADDER.value,
        )
    except (ConfigError, ValueError) as e:  # bad values: the message names the flag / field, no usage dump
        raise SystemExit(f"memory_budget: {e}") from None
    print(report(result))
    cli.write_result(_OUT.value, result, write_json, blank_line=True)


if __name__ == "__main__":
    cli.run(main)
