"""What a compiled TPU program holds: per-device memory, cost analysis and the roofline it implies, collectives
by kind, Mosaic kernels and their in-register gathers; and the per-device total of a model composed from the
programs of its layer kinds."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping

import jax

from glm53.memory.inventory import tensor_class
from glm53.testing import tpu

GIB = 1 << 30
V5E = dict(hbm_bytes=16 * GIB, hbm_bytes_per_s=819e9, bf16_flops_per_s=197e12)  # one v5e chip

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction `... = type op(` or its async start `op-start(`; names (`%all-reduce.3 =`) do not match.
_COLLECTIVE = re.compile(rf"\s({'|'.join(COLLECTIVES)})(?:-start)?\(")
# The base64 Mosaic module of a tpu_custom_call in the lowered StableHLO text (its backend_config is escaped).
_MOSAIC_BODY = re.compile(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22")


def collectives(hlo_text: str) -> dict[str, int]:
    """{kind: count} of the collectives in an HLO module's text (async start/done pairs count once)."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for m in _COLLECTIVE.finditer(hlo_text):
        out[m.group(1)] += 1
    return out


def mosaic_gathers(lowered_text: str) -> list[int]:
    """tpu.dynamic_gather count of every Mosaic kernel embedded in a lowered program's StableHLO text."""
    from jax._src.lib import tpu as tpu_dialect  # jaxlib internals, loaded only to parse Mosaic bytecode
    from jax._src.lib.mlir import ir  # jaxlib internals, loaded only to parse Mosaic bytecode

    counts = []
    for body in _MOSAIC_BODY.findall(lowered_text):
        ctx = ir.Context()
        tpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        with ctx:
            counts.append(str(ir.Module.parse(base64.b64decode(body))).count("tpu.dynamic_gather"))
    return counts


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
# `%param.1 = s8[128,256]{1,0:T(32,128)(4,1)} parameter(0), sharding=..., metadata={op_name="state[..]..."}`
_PARAMETER = re.compile(r"^\s*%?[\w.\-]+ = (\w+)\[([\d,]*)\](?:\{[^}]*\})? parameter\((\d+)\)(.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def entry_parameters(hlo_text: str) -> list[dict]:
    """The parameters of a compiled (SPMD-partitioned) HLO module's ENTRY computation, by number: element type,
    per-device shape, bytes (without the layout's tile padding, which `memory_analysis` counts) and the jit
    argument path the parameter came from (its op_name, e.g. "state['embed']['embedding'].value.values")."""
    start = hlo_text.index("\nENTRY ")
    end = hlo_text.find("\n}", start)
    out = []
    for line in hlo_text[start : None if end < 0 else end].splitlines():
        m = _PARAMETER.match(line)
        if m is None:
            continue
        dtype, dims_, index, rest = m.groups()
        shape = tuple(int(d) for d in dims_.split(",") if d)
        name = _OP_NAME.search(rest)
        out.append(dict(index=int(index), dtype=dtype, shape=shape,
                        bytes=math.prod(shape) * _DTYPE_BYTES[dtype],
                        name=name.group(1).replace("\\'", "'") if name else ""))  # fmt: skip
    return sorted(out, key=lambda p: p["index"])


_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]")


def parameter_classes(parameters: list[dict], prefix: str = "") -> dict[str, int]:
    """{tensor class: bytes per device} of a compiled program's weights: its entry parameters
    (`entry_parameters`) that come from the state argument (args[0], named "state"), whose
    parameter paths are `prefix` + the path within the state."""
    out: dict[str, int] = {}
    for p in parameters:
        if not p["name"].startswith("state["):
            continue
        keys = p["name"].split(".value", 1)[0]
        cls = tensor_class(prefix + ".".join(a or b for a, b in _KEY.findall(keys)))
        out[cls] = out.get(cls, 0) + p["bytes"]
    return dict(sorted(out.items()))


def _cost(compiled: jax.stages.Compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return dict(flops=float(c.get("flops", 0.0)), bytes_accessed=float(c.get("bytes accessed", 0.0)))


def roofline(flops: float, bytes_accessed: float, chip: Mapping = V5E) -> dict:
    """Seconds the per-device flops and bytes take at the chip's peak (bf16) and HBM bandwidth; the larger."""
    t_mem = bytes_accessed / chip["hbm_bytes_per_s"]
    t_flops = flops / chip["bf16_flops_per_s"]
    return dict(memory_s=t_mem, flops_s=t_flops, roofline_s=max(t_mem, t_flops))


def analyse(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled) -> dict:
    """Per-device memory (tpu.memory_stats), entry parameters, cost and roofline, collectives by kind, Mosaic
    kernels and their gathers of one compiled program."""
    mem = tpu.memory_stats(compiled)
    cost = _cost(compiled)
    gathers = mosaic_gathers(lowered.as_text())
    text = compiled.as_text()
    return dict(
        memory=mem,
        parameters=entry_parameters(text),
        cost=cost,
        roofline=roofline(cost["flops"], cost["bytes_accessed"]),
        collectives=collectives(text),
        mosaic_kernels=tpu.mosaic_kernels(compiled),
        mosaic_gathers=dict(kernels=len(gathers), dynamic_gather=sum(gathers), per_kernel=gathers),
    )


def compose(parts: list[dict], hbm_bytes: int = V5E["hbm_bytes"]) -> dict:
    """Per-device totals of a model run as a sequence of programs (one per layer kind, each `count` times).

    parts: {name, count, weights, cache, stats (from `analyse`)}; weights / cache: the bytes one device holds
    of one instance's parameters / caches. Held at once: every instance's weights and caches, the largest
    temporary buffer of any program (layers run one after another and reuse it), the code of every instance
    (the model's Python loop unrolls its layers into one program), the largest output. Cost and collectives
    add up over instances.
    """
    weights = sum(p["count"] * p["weights"] for p in parts)
    cache = sum(p["count"] * p["cache"] for p in parts)
    temp = max(p["stats"]["memory"]["temp"] for p in parts)
    code = sum(p["count"] * p["stats"]["memory"]["code"] for p in parts)
    output = max(p["stats"]["memory"]["output"] - p["stats"]["memory"]["alias"] for p in parts)
    flops = sum(p["count"] * p["stats"]["cost"]["flops"] for p in parts)
    nbytes = sum(p["count"] * p["stats"]["cost"]["bytes_accessed"] for p in parts)
    coll = {k: sum(p["count"] * p["stats"]["collectives"][k] for p in parts) for k in COLLECTIVES}
    total = weights + cache + temp + code + output
    return dict(
        weights=weights,
        cache=cache,
        temp=temp,
        code=code,
        output=output,
        total=total,
        hbm=hbm_bytes,
        fits=total <= hbm_bytes,
        cost=dict(flops=flops, bytes_accessed=nbytes),
        roofline=roofline(flops, nbytes),
        collectives=coll,
        mosaic_kernels=sum(p["count"] * p["stats"]["mosaic_kernels"] for p in parts),
        mosaic_gathers=sum(p["count"] * p["stats"]["mosaic_gathers"]["dynamic_gather"] for p in parts),
    )
