"""Per-device memory budget of GLM-5.3-Flash with GGUF routed experts, compared with the audit article.

  python -m experiments.memory_budget --config=configs/glm53_flash.py --experts=ud_iq3_xxs \
      --devices=8 --hbm_gb=16.9 --context=262144 --streams=3 --ladder --out=budget.json

Prints the parameter counts, the per-device bytes by component (routed experts as GGUF blocks and as planes,
non-expert weights per tensor class, vision tower, caches per context set, workspace), total and headroom, a
comparison with the article's figures with a "why it differs" column, and with --ladder which expert
quantizations fit. --out writes the full result as JSON (atomically). Everything comes from the config's
shapes and the format definitions (glm53/memory.py); nothing is allocated.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from ml_collections import config_flags

from glm53.config import ConfigError, model_config_from_dict
from glm53.memory import budget as memory

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_EXPERTS = flags.DEFINE_string(
    "experts", "ud_iq3_xxs", f"routed-expert mix: {', '.join(memory.expert_mix_names())}"
)
_DEVICES = flags.DEFINE_integer("devices", 8, "tensor-parallel devices")
_HBM_GB = flags.DEFINE_float("hbm_gb", 16.9, "usable HBM per device, GB (1e9 bytes)")
_CONTEXT = flags.DEFINE_integer("context", 262144, "tokens per context set (one stream)")
_STREAMS = flags.DEFINE_integer("streams", 3, "context sets held at once")
_LAYOUT = flags.DEFINE_enum("layout", "planes", list(memory.qbudget.LAYOUTS), "routed-expert storage layout")
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


def _gb(x: float) -> str:
    return f"{x / memory.GB:.3f}"


def _num(v, decimals: int | None) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{(decimals or 0) + 2}f}"


def _line(label: str, nbytes: float, note: str = "") -> str:
    return f"  {label:40s} {_gb(nbytes):>8s}   {note}".rstrip()


def report(r: dict) -> str:
    """The human-readable tables of a `memory.memory_budget` result."""
    c, pd = r["config"], r["per_device"]
    growth = (
        "a 2-byte field takes a word where a device holds an odd number of blocks per row"
        if c["layout"] == "planes"
        else "the re-encoded layout of glm53/quant/reencode.py; IQ4_XS stays as planes"
    )
    gguf_dev = _gb(r["routed_gguf_bytes_per_device"])
    head = f"{c['experts_label']} ({c['layout']}), {c['devices']} devices x {c['hbm_gb']} GB"
    lines = [
        f"GLM-5.3-Flash memory budget: {head}, {c['streams']} context set(s) of {c['context']:,} tokens",
        "",
        "parameters",
        f"  total           {r['total_params']:>17,}  = trunk {r['text_trunk_params']:,} + lm_head "
        f"{r['lm_head_params']:,} + MTP {r['mtp_params']:,} + vision {r['vision_params']:,}",
        f"  routed experts  {r['routed_expert_params']:>17,}  "
        f"({100 * r['routed_expert_share']:.1f}% of total; trunk layers only)",
        f"  non-expert      {r['non_expert_params']:>17,}  "
        "(trunk + lm_head - routed experts; no MTP, no vision)",
        f"  active / token  {r['active_params_per_token']:>17,}  "
        f"({r['active_params_per_token_excl_embedding']:,} without the embedding)",
        "",
        "routed experts, all devices",
        f"  GGUF blocks {_gb(r['routed_gguf_bytes'])} GB  {r['routed_formats']}  "
        f"{r['routed_bits_per_weight']:.3f} bits/weight",
        f"  {c['layout']:11s} {_gb(r['routed_planes_bytes'])} GB  "
        f"(+{r['routed_planes_growth_bytes'] / 1e6:.1f} MB: {growth})",
        "",
        f"  {'per device':40s} {'GB':>8s}   storage",
        _line(f"routed experts ({c['layout']})", pd["routed_experts"], f"GGUF blocks {gguf_dev}"),
    ]
    for cls, row in r["non_expert_per_device_by_class"].items():
        fb = (
            f" ({row['replicated_fallbacks']} indivisible: replicated)" if row["replicated_fallbacks"] else ""
        )
        lines.append(_line(f"  {cls}", row["bytes_per_device"], f"{row['dtype']}, {row['placement']}{fb}"))
    flat = _gb(r["non_expert_int8_flat_bytes_per_device"])
    lines += [
        _line("non-expert weights", pd["non_expert"], f"(at 1 byte/param split evenly: {flat})"),
        _line("vision tower", pd["vision"], "bf16, split"),
    ]
    for comp, b in r["context_set_by_component"].items():
        lines.append(_line(f"  {comp}", b, "per context set"))
    sets = f"caches: {c['streams']} x {_gb(r['context_set_bytes_per_device'])} GB"
    fits = (
        f"headroom {_gb(r['headroom_bytes'])} GB, fits: {r['fits']}, room for {r['max_streams']} context sets"
    )
    lines += [
        _line(sets, pd["caches"]),
        _line("workspace", pd["workspace"], r["workspace_source"]),
        _line("TOTAL", r["per_device_total_bytes"], f"of {c['hbm_gb']} GB: {fits}"),
        _line("(weights alone)", r["per_device_weights_bytes"]),
    ]
    if "comparison" in r:
        lines += ["", f"{'quantity':70s} {'ours':>16s} {'article':>16s}  why it differs"]
        for row in r["comparison"]:
            q, d = f"{row['quantity']} ({row['unit']})", row["decimals"]
            ref = _num(row["reference"], d - 2 if d is not None else None)
            lines.append(f"{q:70s} {_num(row['ours'], d):>16s} {ref:>16s}  {row['why']}")
            if "detail" in row:
                lines.append(f"{'':104s}  {row['detail']}")
    if "ladder" in r:
        lines += [
            "",
            f"ladder ({c['streams']} context sets, same non-expert / vision / workspace)",
            f"  {'mix':50s} {'bpw':>6s} {'GGUF GB':>9s} {'experts/dev':>11s} {'total/dev':>9s}"
            "  fits  max sets",
        ]
        for row in r["ladder"]:
            if "error" in row:
                lines.append(f"  {row['name']:50s} n/a: {row['error']}")
                continue
            lines.append(
                f"  {row['label']:50s} {row['bits_per_weight']:6.3f} {_gb(row['gguf_bytes']):>9s} "
                f"{_gb(row['experts_bytes_per_device']):>11s} {_gb(row['total_bytes_per_device']):>9s}  "
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
            cfg,
            _EXPERTS.value,
            _DEVICES.value,
            _HBM_GB.value,
            _CONTEXT.value,
            _STREAMS.value,
            layout=_LAYOUT.value,
            cache=memory.CacheLayout(
                latent=_LATENT.value, indexer=_INDEXER.value, include_mtp=_MTP_CACHE.value
            ),
            vision=_VISION.value,
            workspace_gb=_WORKSPACE.value,
            ladder=_LADDER.value,
        )
    except (ConfigError, ValueError) as e:  # bad values: the message names the flag / field, no usage dump
        raise SystemExit(f"memory_budget: {e}") from None
    print(report(result))
    if _OUT.value:
        write_json_atomic(_OUT.value, result)
        print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
