"""What the real model costs a TPU slice, from the real compiler on any host (libtpu's Mosaic and XLA:TPU against
the abstract devices of a topology, `glm53.testing.tpu`; nothing is allocated).

The model is `Glm53Model` built abstractly on the topology's mesh (`glm53.parallel.abstract_sharded_model`):
routed experts as GGUF planes (`QuantizedExperts` of the config's mix), every other parameter as the memory
budget stores it (`glm53.memory.weights.storage_value`: the matrices of an int8 class as `Int8Weight`,
int8 + f32 scale per output channel, the embedding as `Int8Rows`, int8 + f32 scale per vocabulary row; every
other tensor in its class's dtype: router kernel and mHC fn bf16, norms and the KDA / mHC vectors f32; the MTP
block is not served) and placed as a memory-budget placement says (`glm53.memory.placement`; default: the one of
the config's `mesh.rules`, "tp" | "ep"; "prior_art" adds the prior art's conv-state and low-rank splits), so the
non-expert bytes per device equal the budget's (`weights_by_class` vs `non_expert_by_class`); the caches of
`context` tokens per stream (`init_cache` placed by `cache_shardings` under the placement's rules). Programs,
each with a donated cache:

  decode   one token for each of B streams (one program per stream count)
  prefill  P tokens of one stream into a one-stream cache (one program per bucket)

compose="full" compiles each program whole. compose="kinds" compiles each program as the sequence of units it
runs: one per distinct layer kind (attention KDA / DSA with its own or a shared indexer, FFN dense / MoE, the
expert formats of the mix: the UD mix makes layers 11, 12 and 44 kinds of their own), plus the embedding and
the head; the model's per-device totals are composed from them (`compiled_hlo.compose`). The compile census
times a second compile with the persistent compilation cache warm and a `jax.export` round trip.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from glm53 import logs
from glm53 import parallel as S
from glm53.benchmarks import compiled_hlo, harness
from glm53.benchmarks.compile_programs import Unit, device_bytes, programs
from glm53.build import kernels_from_experiment_config, quant_from_experiment_config
from glm53.config import ModelConfig, mesh_config_from_dict, model_config_from_dict
from glm53.layers.param import path_str
from glm53.layers.stack import describe_groups
from glm53.memory.inventory import tensor_class
from glm53.memory.placement import PLACEMENTS, Placement, get_placement
from glm53.memory.weights import STORAGE, non_expert_by_class, storage_value, tensor_rules
from glm53.model import Glm53Model
from glm53.progress import Progress
from glm53.testing import tpu

COMPOSE = ("kinds", "full")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to compile: topology, expert mix and layout, stream counts (decode), prefill buckets, context per
    stream, layers (0: all; n: n consecutive layers from the last dense one), compose mode, the census, the
    memory-budget placement ("": the config's mesh.rules)."""

    topology: str = "v5e:2x4"
    experts: str = "ud_iq3_xxs"
    layout: str = "planes"
    streams: tuple[int, ...] = (1, 3, 8)
    prefill: tuple[int, ...] = (256, 2048)
    context: int = 262144
    layers: int = 0
    compose: str = "kinds"
    census: bool = True
    placement: str = ""
    cache_tokens: int = 0  # > 0: paged DSA caches, a pool of this many tokens shared by the streams
    page_tokens: int = 256

    def __post_init__(self):
        if self.compose not in COMPOSE:
            raise ValueError(f"--compose={self.compose!r}: expected one of {COMPOSE}")
        if self.placement and self.placement not in PLACEMENTS:
            raise ValueError(
                f"--placement={self.placement!r}: expected one of {sorted(PLACEMENTS)} (or empty)"
            )
        if not (self.streams or self.prefill) or min((*self.streams, *self.prefill)) < 1:
            raise ValueError(
                f"--streams / --prefill must be positive (one may be empty), got {self.streams} / {self.prefill}"
            )
        if self.cache_tokens < 0 or self.page_tokens < 1:
            raise ValueError(f"--cache_tokens={self.cache_tokens} must be >= 0, --page_tokens >= 1")
        if self.context < max(self.prefill, default=1) or self.layers < 0:
            raise ValueError(f"--context={self.context} must hold the largest prefill; --layers >= 0")


# ---------------------------------------------------------------------------------------------- the model
def reduced_model_config(model: ml_collections.ConfigDict, layers: int) -> ModelConfig:
    """The model config with `layers` consecutive layers from the last dense one (all of them for 0), so that
    a short model has a dense, a DSA and a MoE layer."""
    cfg = model_config_from_dict(model)
    if not layers or layers >= cfg.num_hidden_layers:
        return cfg
    start = max(0, cfg.mlp_layer_types.index("moe") - 1) if "moe" in cfg.mlp_layer_types else 0
    start = min(start, cfg.num_hidden_layers - layers)
    d = model.to_dict()
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        d[key] = list(d[key])[start : start + layers]
    d["num_hidden_layers"] = layers
    return model_config_from_dict(d)


def _placement(placement: str | Placement | S.Rules) -> Placement:
    if isinstance(placement, S.Rules):
        return Placement(placement.name, placement, None, f"rule set {placement.name!r}")
    return get_placement(placement)


def abstract_model(
    cfg: ModelConfig, quant, mesh, placement: str | Placement | S.Rules, kernels=None
) -> Glm53Model:
    """The served model (no MTP block) as ShapeDtypeStructs on `mesh`, stored and placed as the module docstring
    says (`placement`: a memory-budget placement, or a rule set for every tensor); `kernels`: as `Glm53Model`."""
    place = _placement(placement)

    def build():
        with nnx.var_defaults(
            ref=True
        ):  # the RNG counter as a Ref: fast abstract init (glm53.memory.inventory)
            rngs = nnx.Rngs(0)
        return Glm53Model(cfg, rngs=rngs, dtype=jnp.bfloat16, quant=quant, kernels=kernels, with_mtp=False)

    graphdef, state = nnx.split(S.abstract_sharded_model(build, mesh, place.rules, moe_dispatch=False))

    def stored(path, var):
        what = f"parameter {path_str(path)}"
        axes = S.param_axes(var, what)
        v = storage_value(path_str(path), var.get_value())
        dtype = STORAGE.get(tensor_class(path_str(path)))
        rules = place.rules if dtype is None else tensor_rules(axes, dtype.dtype, place)
        leaves = S.value_leaf_axes(v, axes, what)
        placed = [
            jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=S.logical_to_sharding(a, mesh, rules, d, what)
            )
            for leaf, a, d in leaves
        ]
        return var.replace(value=jax.tree.unflatten(jax.tree.structure(v), placed))

    state = nnx.from_flat_state([(p, stored(p, v)) for p, v in nnx.to_flat_state(state)])
    return S.wrap_moe_layers(nnx.merge(graphdef, state), mesh, place.rules)


def weights_by_class(model: nnx.Module) -> dict[str, int]:
    """{tensor class: bytes one device holds} of the model's non-expert parameters (routed experts excluded)."""
    out: dict[str, int] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        cls = tensor_class(path_str(path))
        if cls != "routed_experts":
            out[cls] = out.get(cls, 0) + device_bytes(var.get_value())
    return dict(sorted(out.items()))


def compile_unit(unit: Unit) -> tuple[dict, jax.stages.Lowered | None]:
    """Lower and compile one unit for the mesh's devices: times and `compiled_hlo.analyse` (its entry
    parameters summed by tensor class: `weights_compiled`), or the error."""
    t0 = time.perf_counter()
    lowered = jax.jit(unit.fn, donate_argnums=unit.donate).lower(*unit.args)
    t1 = time.perf_counter()
    out = dict(lower_s=t1 - t0)
    try:
        compiled = lowered.compile()
    except Exception as e:  # the compiler's verdict (e.g. HBM exhausted) is a result, not a crash
        return dict(out, compile_s=time.perf_counter() - t1, error=f"{type(e).__name__}: {e}"[:2000]), None
    out["compile_s"] = time.perf_counter() - t1
    out.update(compiled_hlo.analyse(lowered, compiled))
    params = out.pop("parameters")
    out["weights_compiled"] = compiled_hlo.parameter_classes(params, unit.prefix)
    out["parameter_bytes"] = sum(p["bytes"] for p in params)
    return out, lowered


# ---------------------------------------------------------------------------------------------- census
def census(unit: Unit, cold: dict, cache_dir: str | None) -> dict:
    """A second compile of `unit` with the persistent compilation cache warm (in-memory caches cleared), and
    `jax.export` of it: export time, serialized bytes, deserialize time, and lowering and compiling the
    deserialized program (no Python tracing)."""
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jax.jit(unit.fn, donate_argnums=unit.donate).lower(*unit.args)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    out = dict(
        unit=unit.name,
        cold=dict(lower_s=cold["lower_s"], compile_s=cold["compile_s"]),
        warm_persistent_cache=dict(lower_s=t1 - t0, compile_s=t2 - t1),
        cache_dir=cache_dir,
        cache_entries=len(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else 0,
    )
    try:
        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(unit.args)  # flat in and out: nnx / cache pytrees do not serialize

        def flat(*leaves):
            return jax.tree.leaves(unit.fn(*jax.tree.unflatten(treedef, leaves)))

        exp = jax.export.export(jax.jit(flat), platforms=["tpu"])(*leaves)
        blob = exp.serialize()
        t1 = time.perf_counter()
        restored = jax.export.deserialize(blob)
        t2 = time.perf_counter()
        lowered = jax.jit(restored.call).lower(*leaves)
        t3 = time.perf_counter()
        lowered.compile()
        out["export"] = dict(export_s=t1 - t0, bytes=len(blob), deserialize_s=t2 - t1,
                             lower_s=t3 - t2, compile_s=time.perf_counter() - t3)  # fmt: skip
    except Exception as e:  # report what export cannot do rather than lose the census
        out["export"] = dict(error=f"{type(e).__name__}: {e}"[:1000])
    return out


def _accessed(cost: dict) -> str:
    """GB accessed per step; "lower-upper" when loops were counted (XLA's count .. with every iteration)."""
    lo, hi = cost.get("bytes_accessed_lower", cost["bytes_accessed"]), cost["bytes_accessed"]
    return _gb(hi) if lo == hi else f"{_gb(lo)}-{_gb(hi)}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def run(
    config: ml_collections.ConfigDict,
    settings: Settings,
    progress: Callable[[str], None] | None = None,
    partial: Callable[[dict], None] | None = None,
) -> dict:
    """Compile every program of `settings` for the config's model; the JSON result (module docstring).
    `progress` receives a line per compiled unit (None: printed, under a tqdm bar over the programs on a
    terminal: `glm53.progress`). `partial` receives the programs compiled so far after each one."""
    bar = Progress(desc="compile_tpu", unit="program", enabled=progress is None, lines=False)
    try:
        return _run(config, settings, functools.partial(bar.write, log=progress or print), partial, bar)
    finally:
        bar.close()


def _run(config, settings: Settings, progress: Callable[[str], None], partial, bar: Progress) -> dict:
    cfg = reduced_model_config(config.model, settings.layers)
    if settings.compose == "kinds":  # one unit per layer kind: composed from unrolled layers
        cfg = cfg.replace(scan_layers=False)
    quant = quant_from_experiment_config(config)
    quant = dataclasses.replace(quant, experts=settings.experts, layout=settings.layout)
    # compiled for TPU devices from any host: the experts run the Pallas TPU kernels whatever this backend is
    kernels = kernels_from_experiment_config(config).replace(moe="pallas_tpu")
    mesh_cfg = mesh_config_from_dict(config.mesh)
    logs.libtpu_env_defaults()  # libtpu's own stderr logs only with --verbosity >= 0
    with logs.native_stderr_quiet():  # libtpu's start-up messages (no TPU metadata on this host): held back
        devices = tpu.topology_devices(settings.topology)
    mesh = tpu.topology_mesh(settings.topology, mesh_cfg.resolved_shape(len(devices)), mesh_cfg.axes)
    place = get_placement(settings.placement or mesh_cfg.rules)
    rules = place.rules
    S.check_config(cfg, mesh, rules)
    t0 = time.perf_counter()
    model = abstract_model(cfg, quant, mesh, place, kernels)
    build_s = time.perf_counter() - t0
    progress(describe_groups(model.groups))
    model_by_class = weights_by_class(model)
    budget_by_class = {
        k: r["bytes_per_device"] for k, r in non_expert_by_class(cfg, len(devices), place).items()
    }
    shapes = [("decode", b, 1) for b in settings.streams] + [("prefill", 1, p) for p in settings.prefill]
    bar.set_total(len(shapes))
    results, first = [], None
    pages = None
    if settings.cache_tokens:  # a whole number of pages per device of the sequence axes, + one scratch page each
        n_seq = S.axis_size(mesh, rules.mesh_axes(S.CACHE_SEQ), "DSA cache")
        per = -(-settings.cache_tokens // (settings.page_tokens * n_seq)) + 1
        pages = (per * n_seq, settings.page_tokens)
    for phase, batch, tokens in shapes:
        units = programs(model, batch, tokens, settings.context, settings.compose, mesh, rules, pages)
        rows = []
        for j, u in enumerate(units):
            r, lowered = compile_unit(u)
            rows.append(dict(name=u.name, layers=u.layers, count=u.count, weights=u.weights,
                             cache=u.cache, pool=u.pool, expert_reads=u.expert_reads, **r))  # fmt: skip
            if lowered is not None and (first is None or r["compile_s"] > first[1]["compile_s"]):
                first = (u, r)  # the census recompiles the slowest unit of the first program
            mem = r.get("memory", {})
            progress(
                f"{phase} streams={batch} tokens={tokens} [{j + 1}/{len(units)}] {u.name} x{u.count}: "
                f"lower {r['lower_s']:.1f}s compile {r['compile_s']:.1f}s"
                + (
                    f" ERROR {r['error'][:200]}"
                    if "error" in r
                    else f" args {_gb(mem['argument'])} GB temp {_gb(mem['temp'])} GB code {mem['code'] / 1e6:.1f} MB "
                    f"collectives {sum(r['collectives'].values())} mosaic {r['mosaic_kernels']}"
                )  # fmt: skip
            )
        prog = dict(phase=phase, streams=batch, tokens=tokens, units=rows,
                    compile_s=sum(r["lower_s"] + r["compile_s"] for r in rows))  # fmt: skip
        ok = [dict(r, stats=r) for r in rows if "error" not in r]
        if len(ok) == len(rows):
            if settings.compose == "full":  # the program; its loop bodies' missing iterations are added below
                r = rows[0]
                ok = [dict(r, weights=sum(r["weights"].values()), stats=r)]
            else:
                ok = [dict(r, weights=sum(r["weights"].values()), stats=r) for r in rows]
            prog["total"] = t = compiled_hlo.compose(ok)
            # XLA's bytes accessed + what the Mosaic expert kernels stream (invisible to its cost analysis)
            t["expert_bytes_read"] = sum(r["count"] * r["expert_reads"] for r in rows)
            t["cost"]["bytes_accessed_xla"] = t["cost"]["bytes_accessed"]
            # XLA counts a loop body once: each loop's other iterations are added, measured on the loop compiled
            # alone (its one-time reads included: an upper bound; XLA's own count is the lower bound)
            loops = rows[1:] if settings.compose == "full" else []
            t["loop_iterations"] = {r["name"]: r["count"] for r in loops}
            t["cost"]["bytes_accessed_loops"] = sum(r["count"] * r["cost"]["bytes_accessed"] for r in loops)
            t["cost"]["flops"] += sum(r["count"] * r["cost"]["flops"] for r in loops)
            t["cost"]["bytes_accessed_lower"] = t["cost"]["bytes_accessed"] + t["expert_bytes_read"]
            t["cost"]["bytes_accessed"] += t["cost"]["bytes_accessed_loops"] + t["expert_bytes_read"]
            t["roofline"] = compiled_hlo.roofline(t["cost"]["flops"], t["cost"]["bytes_accessed"])
            by_class: dict[str, int] = {}
            for r in rows[:1] if settings.compose == "full" else rows:  # a loop unit's weights are the program's
                for cls, n in r["weights_compiled"].items():
                    by_class[cls] = by_class.get(cls, 0) + n * r["count"]
            prog["total"]["weights_compiled"] = dict(sorted(by_class.items()))
            if pages is None:
                prog["total"]["cache_per_stream"] = prog["total"]["cache"] // batch
                fixed = prog["total"]["total"] - prog["total"]["cache"]
                prog["total"]["context_sets_fit"] = max(
                    0, (prog["total"]["hbm"] - fixed) // prog["total"]["cache_per_stream"]
                )
            else:  # the pool's bytes per token, and how many tokens of it fit beside everything else
                pool = sum(r["count"] * r["pool"] for r in (rows[:1] if settings.compose == "full" else rows))
                t["pool"], t["pool_tokens"] = pool, (pages[0] - n_seq) * pages[1]
                t["pool_bytes_per_token"] = pool / (pages[0] * pages[1])  # per device, every DSA layer
                t["cache_per_stream"] = (t["cache"] - pool) // batch  # KDA states, rings, tables
                t["context_sets_fit"] = 0
                t["cache_tokens_fit"] = max(0, int((t["hbm"] - (t["total"] - pool)) / t["pool_bytes_per_token"]))
        results.append(prog)
        bar.update(1, postfix=f"{phase} {batch}x{tokens}")
        if partial is not None:
            partial(dict(settings=dataclasses.asdict(settings), programs=results))
    out = dict(
        settings=dataclasses.asdict(settings),
        machine=harness.machine(("libtpu",)),
        model=dict(
            layers=cfg.num_hidden_layers,
            layer_types=list(cfg.layer_types),
            mlp_layer_types=list(cfg.mlp_layer_types),
            groups=describe_groups(model.groups),
            build_s=build_s,
        ),  # fmt: skip
        mesh=dict(
            topology=settings.topology,
            shape=dict(mesh.shape),
            rules=rules.name,
            placement=place.name,
            device_kind=devices[0].device_kind,
        ),  # fmt: skip
        # non-expert weight bytes per device by tensor class: the placed model, its compiled programs, the budget
        # (glm53.memory.weights.non_expert_by_class: same config, devices and placement, on its 1 x n mesh)
        non_expert_weights=_non_expert_weights(model_by_class, budget_by_class, results),
        chip=compiled_hlo.V5E,
        programs=results,
    )
    if settings.census and first is not None:
        out["census"] = dict(
            distinct_programs=dict(
                decode=len(settings.streams),
                prefill=len(settings.prefill),
                units_per_program=[len(p["units"]) for p in results],
            ),  # fmt: skip
            compile_s=[
                dict(phase=p["phase"], streams=p["streams"], tokens=p["tokens"], s=p["compile_s"])
                for p in results
            ],  # fmt: skip
            **census(first[0], first[1], jax.config.jax_compilation_cache_dir),
        )
    return out


def _non_expert_weights(model: dict, budget: dict, programs: list[dict]) -> dict:
    """Non-expert weight bytes per device by tensor class: `model` (the placed parameters), `compiled` (the
    entry parameters of the first program that compiled whole, every layer counted) and `budget`."""
    compiled = next((p["total"]["weights_compiled"] for p in programs if "total" in p), None)
    if compiled is not None:
        compiled = {k: v for k, v in compiled.items() if k != "routed_experts"}
    return dict(
        model=model,
        compiled=compiled,
        budget=budget,
        model_total=sum(model.values()),
        compiled_total=None if compiled is None else sum(compiled.values()),
        budget_total=sum(budget.values()),
    )


def table(result: dict) -> str:
    """The result as a Markdown table: one row per program, per-device figures on one chip."""
    head = ("| program | compile s | weights GB | caches GB | temp GB | code MB | total GB | fits 16 GiB "
            "| context sets fit (paged: cache tokens fit) | GB accessed | roofline ms | all-reduce / all-gather / reduce-scatter / all-to-all "
            "/ permute | Mosaic kernels (gathers) |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in result["programs"]:
        name = f"{p['phase']} {p['streams']}x{p['tokens']}"
        t = p.get("total")
        if t is None:
            errors = "; ".join(f"{u['name']}: {u['error'][:120]}" for u in p["units"] if "error" in u)
            lines.append(f"| {name} | {p['compile_s']:.0f} | compile failed: {errors} |")
            continue
        coll = " / ".join(str(t["collectives"][k]) for k in compiled_hlo.COLLECTIVES)
        lines.append(
            f"| {name} | {p['compile_s']:.0f} | {_gb(t['weights'])} | {_gb(t['cache'])} | {_gb(t['temp'])} "
            f"| {t['code'] / 1e6:.1f} | {_gb(t['total'])} | {'yes' if t['fits'] else 'no'} "
            f"| {t.get('cache_tokens_fit', t['context_sets_fit'])} | {_accessed(t['cost'])} "
            f"| {t['roofline']['roofline_s'] * 1e3:.2f} | {coll} | {t['mosaic_kernels']} ({t['mosaic_gathers']}) |"
        )
    return "\n".join(lines)
