"""Ahead-of-time compilation for real TPUs from any host (the libtpu compiler, no TPU attached).

`topology_devices("v5e:2x4")` gives the abstract devices of a TPU slice; `lower_for` / `compile_for(fn, *args,
...)` lower and compile `fn` for them (Mosaic + XLA:TPU, what a TPU host would run); `mosaic_kernels` counts the
Pallas kernels of the result, `mosaic_ops` gives the op text of each kernel of a lowered program, and
`memory_stats` reads the compiled program's memory analysis. Needs `libtpu` (the `tpu` extra of setup.py); run
with JAX_PLATFORMS=cpu on a host without TPUs.
"""

from __future__ import annotations

import base64
import functools
import os
import re

import jax
import numpy as np
from jax._src.lib import tpu as tpu_dialect
from jax._src.lib.mlir import ir
from jax.experimental import topologies
from jax.sharding import Mesh, SingleDeviceSharding

__all__ = [
    "TOPOLOGIES",
    "topology_devices",
    "topology_mesh",
    "abstract",
    "lower_for",
    "compile_for",
    "mosaic_kernels",
    "mosaic_ops",
    "memory_stats",
]

# Slices the tests compile for (libtpu's topology names: "<chip>:<chips per axis>").
TOPOLOGIES = ("v5e:2x4", "v5p:2x2x1", "v6e:2x2")

_MOSAIC = re.compile(r'custom_call_target="tpu_custom_call"')
_MOSAIC_BODY = re.compile(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22")  # a kernel in a lowered module's text


@functools.cache
def topology_devices(name: str = "v5e:2x4") -> tuple:
    """The abstract TPU devices of topology `name` (e.g. "v5e:2x4": 8 v5e chips), usable for compiling only."""
    # Compiling touches no chip: let several compiling processes load libtpu at once (its lockfile is per host).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def topology_mesh(name: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    """A Mesh of `shape` over the devices of topology `name` (their product must equal the device count)."""
    devices = topology_devices(name)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, {name} has {len(devices)}")
    return Mesh(np.asarray(devices).reshape(shape), axis_names)


def abstract(tree, sharding: jax.sharding.Sharding):
    """ShapeDtypeStructs of the array leaves of `tree`, placed by `sharding` where a leaf has none."""

    def leaf(a):
        own = getattr(a, "sharding", None)
        keep = isinstance(a, jax.ShapeDtypeStruct) and own is not None
        dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        return jax.ShapeDtypeStruct(np.shape(a), dtype, sharding=own if keep else sharding)

    return jax.tree.map(leaf, tree)


def lower_for(fn, *args, devices=None, static_argnums=(), **jit_kwargs) -> jax.stages.Lowered:
    """`jax.jit(fn)` lowered for TPU devices (default: the first device of v5e:2x4).

    args: arrays or ShapeDtypeStructs (pytrees of them); a ShapeDtypeStruct that carries a sharding (e.g. a
    NamedSharding on a `topology_mesh`) keeps it, every other leaf is placed whole on devices[0].
    """
    devices = topology_devices() if devices is None else devices
    placed = SingleDeviceSharding(devices[0])
    structs = [a if i in static_argnums else abstract(a, placed) for i, a in enumerate(args)]
    return jax.jit(fn, static_argnums=static_argnums, **jit_kwargs).lower(*structs)


def compile_for(fn, *args, devices=None, static_argnums=(), **jit_kwargs) -> jax.stages.Compiled:
    """`lower_for(...)` compiled by libtpu. Compile errors (a Mosaic kernel the TPU compiler rejects, a VMEM
    overflow) raise."""
    return lower_for(fn, *args, devices=devices, static_argnums=static_argnums, **jit_kwargs).compile()


def mosaic_kernels(compiled: jax.stages.Compiled) -> int:
    """The number of Mosaic (Pallas TPU) kernel calls in a compiled TPU program."""
    return len(_MOSAIC.findall(compiled.as_text()))


def memory_stats(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program: arguments, outputs, temporaries, generated code, and `total`
    (arguments + outputs + temporaries - aliased)."""
    m = compiled.memory_analysis()
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "code": m.generated_code_size_in_bytes,
    }
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def mosaic_ops(lowered: jax.stages.Lowered) -> list[str]:
    """The MLIR text of every Mosaic kernel of a lowered program (the kernel as Pallas emitted it, before
    Mosaic's own passes), in program order."""
    texts = []
    for body in _MOSAIC_BODY.findall(lowered.as_text()):
        ctx = ir.Context()
        tpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        with ctx:
            texts.append(str(ir.Module.parse(base64.b64decode(body))))
    return texts
