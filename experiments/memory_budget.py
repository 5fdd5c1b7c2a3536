"""Per-device memory budget of GLM-5.3-Flash with GGUF routed experts, and how it compares with the audit article.

  python -m experiments.memory_budget --config=configs/glm53_flash.py --experts=ud_iq3_xxs \
      --devices=8 --hbm_gb=16.9 --context=262144 --streams=3 --ladder --out=budget.json

Prints the parameter counts, the per-device bytes by component (routed experts as GGUF blocks and as planes,
non-expert weights per tensor class, vision tower, caches per context set, workspace), total and headroom, a
comparison with the article's figures with a "why it differs" column, and with --ladder which expert
quantizations fit. --out writes the full result as JSON (atomically). Everything comes from the config's shapes
and the format definitions (glm53/memory.py); nothing is allocated.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from ml_collections import config_flags

from glm53 import memory
from glm53.config import ConfigError, model_config_from_dict

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config (configs/*.py[:variant])", lock_config=True)
_EXPERTS = flags.DEFINE_string("experts", "ud_iq3_xxs", f"routed-expert mix: {', '.join(memory.expert_mix_names())}")
_DEVICES = flags.DEFINE_integer("devices", 8, "tensor-parallel devices")
_HBM_GB = flags.DEFINE_float("hbm_gb", 16.9, "usable HBM per device, GB (1e9 bytes)")
_CONTEXT = flags.DEFINE_integer("context", 262144, "tokens per context set (one stream)")
_STREAMS = flags.DEFINE_integer("streams", 3, "context sets held at once")
_LAYOUT = flags.DEFINE_enum("layout", "planes", list(memory.qbudget.LAYOUTS), "routed-expert storage layout")
_LATENT = flags.DEFINE_enum("latent_cache", "int8", ["int8", "bf16"], "MLA latent cache dtype")
_INDEXER = flags.DEFINE_enum("indexer_cache", "pooled", ["pooled", "full"],
                             "indexer cache: pooled keys only, or per-token keys/gates too")  # fmt: skip
_MTP_CACHE = flags.DEFINE_bool("mtp_cache", False, "add the MTP block's DSA cache to each context set")
_VISION = flags.DEFINE_bool("vision", True, "hold the vision tower (bf16)")
_WORKSPACE = flags.DEFINE_float("workspace_gb", None, "workspace per device, GB (default: prior-art residual)")
_LADDER = flags.DEFINE_bool("ladder", False, "add the table of expert quantizations that fit")
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")


def _gb(x: float) -> str:
    return f"{x / memory.GB:9.3f}"


def _fmt(v, unit: str) -> str:
    if isinstance(v, int) and unit == "params":
        return f"{v:,}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def report(r: dict) -> str:
    """The human-readable tables of a `memory.memory_budget` result."""
    c = r["config"]
    n = c["devices"]
    lines = [
        f"GLM-5.3-Flash memory budget: {c['experts_label']} ({c['layout']}), {n} devices x {c['hbm_gb']} GB, "
        f"{c['streams']} context set(s) of {c['context']:,} tokens",
        "",
        "parameters",
        f"  total                 {r['total_params']:>17,}  (trunk {r['text_trunk_params']:,} + lm_head "
        f"{r['lm_head_params']:,} + MTP {r['mtp_params']:,} + vision {r['vision_params']:,})",
        f"  routed experts        {r['routed_expert_params']:>17,}  ({100 * r['routed_expert_share']:.1f}% of total)",
        f"  non-expert            {r['non_expert_params']:>17,}  (trunk + lm_head - routed experts; no MTP, no vision)",
        f"  active per token      {r['active_params_per_token']:>17,}  "
        f"({r['active_params_per_token_excl_embedding']:,} without the embedding)",
        "",
        "routed experts (all devices)",
        f"  GGUF blocks  {_gb(r['routed_gguf_bytes'])} GB  {r['routed_formats']}  "
        f"{r['routed_bits_per_weight']:.3f} bits/weight",
        f"  planes       {_gb(r['routed_planes_bytes'])} GB  (+{r['routed_planes_growth_bytes'] / 1e6:.1f} MB: "
        "2-byte fields padded to a word where a device holds an odd number of blocks per row)",
        "",
        f"per device                                   GB   storage",
        f"  routed experts (planes)               {_gb(r['per_device']['routed_experts'])}   "
        f"(as GGUF blocks {_gb(r['routed_gguf_bytes_per_device']).strip()})",
    ]  # fmt: skip
    for cls, row in r["non_expert_per_device_by_class"].items():
        lines.append(f"    {cls:34s}  {_gb(row['bytes_per_device'])}   {row['dtype']}, {row['placement']}"
                     + (f" ({row['replicated_fallbacks']} indivisible: replicated)" if row["replicated_fallbacks"] else ""))  # fmt: skip
    lines += [
        f"  non-expert weights                    {_gb(r['per_device']['non_expert'])}   "
        f"(1 byte/param split evenly: {_gb(r['non_expert_int8_flat_bytes_per_device']).strip()})",
        f"  vision tower                          {_gb(r['per_device']['vision'])}   bf16, split",
    ]
    for comp, b in r["context_set_by_component"].items():
        lines.append(f"    {comp:34s}  {_gb(b)}   per context set")
    lines += [
        f"  caches: {c['streams']} x {_gb(r['context_set_bytes_per_device']).strip()} GB       "
        f"{_gb(r['per_device']['caches'])}",
        f"  workspace                             {_gb(r['per_device']['workspace'])}   {r['workspace_source']}",
        f"  TOTAL                                 {_gb(r['per_device_total_bytes'])}   of {c['hbm_gb']} GB: "
        f"headroom {_gb(r['headroom_bytes']).strip()} GB, fits: {r['fits']}, room for {r['max_streams']} context sets",
        f"  (weights alone {_gb(r['per_device_weights_bytes']).strip()} GB)",
    ]
    if "comparison" in r:
        lines += ["", f"{'quantity':66s} {'ours':>16s} {'article':>16s}  why it differs"]
        for row in r["comparison"]:
            lines.append(f"{row['quantity'] + ' (' + row['unit'] + ')':66s} {_fmt(row['ours'], row['unit']):>16s} "
                         f"{_fmt(row['reference'], row['unit']):>16s}  {row['why']}")  # fmt: skip
            if "detail" in row:
                lines.append(f"{'':66s} {'':>16s} {'':>16s}  {row['detail']}")
    if "ladder" in r:
        lines += ["", f"ladder ({c['streams']} context sets, same non-expert / vision / workspace)",
                  f"  {'mix':52s} {'bpw':>6s} {'GGUF GB':>9s} {'experts/dev':>11s} {'total/dev':>9s}  fits  max sets"]
        for row in r["ladder"]:
            if "error" in row:
                lines.append(f"  {row['name']:52s} n/a: {row['error']}")
                continue
            lines.append(
                f"  {row['label']:52s} {row['bits_per_weight']:6.3f} {_gb(row['gguf_bytes'])} "
                f"{_gb(row['experts_bytes_per_device']):>11s} {_gb(row['total_bytes_per_device'])}  "
                f"{'yes ' if row['fits'] else 'no  '}  {row['max_streams']}"
            )
    lines += ["", "assumptions:"] + [f"  - {a}" for a in r["assumptions"]]
    return "\n".join(lines)


def write_json_atomic(path: str, obj: dict) -> None:
    """Writes JSON to a temp file in the target folder, then renames it over `path`."""
    out_dir = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=out_dir, suffix=".json.tmp", delete=False) as tmp:
        json.dump(obj, tmp, indent=1, sort_keys=False)
        tmp.write("\n")
    os.replace(tmp.name, path)


def main(argv):
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (e.g. configs/glm53_flash.py)")
    try:
        cfg = model_config_from_dict(_CONFIG.value.model)
        result = memory.memory_budget(
            cfg, _EXPERTS.value, _DEVICES.value, _HBM_GB.value, _CONTEXT.value, _STREAMS.value,
            layout=_LAYOUT.value,
            cache=memory.CacheLayout(latent=_LATENT.value, indexer=_INDEXER.value, include_mtp=_MTP_CACHE.value),
            vision=_VISION.value, workspace_gb=_WORKSPACE.value, ladder=_LADDER.value,
        )  # fmt: skip
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    print(report(result))
    if _OUT.value:
        write_json_atomic(_OUT.value, result)
        print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
