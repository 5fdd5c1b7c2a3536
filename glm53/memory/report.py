"""The human-readable tables of a `glm53.memory.budget.memory_budget` result."""

from __future__ import annotations

from glm53.quant.budget import GB


def _gb(x: float) -> str:
    return f"{x / GB:.3f}"


def _num(v, decimals: int | None) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{(decimals or 0) + 2}f}"


def _line(label: str, nbytes: float, note: str = "") -> str:
    return f"  {label:40s} {_gb(nbytes):>8s}   {note}".rstrip()


def _whose(placement: str, run: str) -> str:
    """`placement` and whose it is: the run's (the config's mesh.rules) or asked for instead of the run's."""
    if placement == run:
        return f"{placement} (the config's mesh.rules: what the run uses)"
    return f"{placement} (asked for with --placement; the run uses {run})"


def _header(r: dict) -> list[str]:
    c = r["config"]
    growth = (
        "a 2-byte field takes a word where a device holds an odd number of blocks per row"
        if c["layout"] == "planes"
        else "the re-encoded layout of glm53/quant/reencode.py; IQ4_XS stays as planes"
    )
    head = f"{c['experts_label']} ({c['layout']}), {c['devices']} devices x {c['hbm_gb']} GB"
    return [
        f"GLM-5.3-Flash memory budget: {head}, {c['streams']} context set(s) of {c['context']:,} tokens, "
        f"placement {_whose(c['placement'], c['run_placement'])}",
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
    ]


def _per_device(r: dict) -> list[str]:
    c, pd = r["config"], r["per_device"]
    lines = [
        "",
        f"  {'per device':40s} {'GB':>8s}   storage",
        _line(f"routed experts ({c['layout']})", pd["routed_experts"],
              f"GGUF blocks {_gb(r['routed_gguf_bytes_per_device'])}"),
    ]  # fmt: skip
    for cls, row in r["non_expert_per_device_by_class"].items():
        n = row["replicated_fallbacks"]
        fb = f" ({n} indivisible: held whole)" if n else ""
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
    return lines + [
        _line(sets, pd["caches"]),
        _line("workspace", pd["workspace"], r["workspace_source"]),
        _line("TOTAL", r["per_device_total_bytes"], f"of {c['hbm_gb']} GB: {fits}"),
        _line("(weights alone)", r["per_device_weights_bytes"]),
    ]


_ROLE = {"run": "the run's", "prior art": "the prior art's", "headline": "headline"}


def _placements(r: dict) -> list[str]:
    lines = [
        "",
        "per device under each placement (same mix, vision and workspace)",
        f"  {'placement':10s} {'experts':>8s} {'non-exp':>8s} {'ctx set':>8s} {'total':>8s}  fits  max sets  "
        f"{'whose':26s} rules",
    ]
    for name, row in r["placements"].items():
        roles = ", ".join(_ROLE[x] for x in row.get("roles", ()))
        if "error" in row:
            lines.append(f"  {name:10s} n/a: {row['error']}  ({roles or 'other'})")
            continue
        lines.append(
            f"  {name:10s} {_gb(row['routed_experts']):>8s} {_gb(row['non_expert']):>8s} "
            f"{_gb(row['context_set']):>8s} {_gb(row['total']):>8s}  {'yes ' if row['fits'] else 'no  '}  "
            f"{row['max_streams']!s:8s}  {roles or 'other':26s} {row['note']}"
        )
    return lines


def _comparison(r: dict) -> list[str]:
    place = r.get("comparison_placement", r["config"]["placement"])
    lines = [
        "",
        f"compared with the audit article, under the prior art's placement ({place}, whose totals are in its "
        "row above)" + ("" if place == r["config"]["placement"] else f", not the headline's ({r['config']['placement']})"),
        f"{'quantity':70s} {'ours':>16s} {'article':>16s}  why it differs",
    ]
    for row in r["comparison"]:
        q, d = f"{row['quantity']} ({row['unit']})", row["decimals"]
        ref = _num(row["reference"], d - 2 if d is not None else None)
        lines.append(f"{q:70s} {_num(row['ours'], d):>16s} {ref:>16s}  {row['why']}")
        if "detail" in row:
            lines.append(f"{'':104s}  {row['detail']}")
    return lines


def _ladder(r: dict) -> list[str]:
    lines = [
        "",
        f"ladder ({r['config']['streams']} context sets, same non-expert / vision / workspace)",
        f"  {'mix':50s} {'bpw':>6s} {'GGUF GB':>9s} {'experts/dev':>11s} {'total/dev':>9s}  fits  max sets",
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
    return lines


def report(r: dict) -> str:
    """The tables of a budget result: parameters, per-device bytes, placements, comparison, ladder."""
    lines = _header(r) + _per_device(r) + _placements(r)
    if "comparison" in r:
        lines += _comparison(r)
    if "ladder" in r:
        lines += _ladder(r)
    lines += ["", "assumptions:"] + [f"  - {a}" for a in r["assumptions"]]
    return "\n".join(lines)
