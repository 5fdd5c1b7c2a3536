"""Checkpoints of scanned models (`ModelConfig.scan_layers`, docs/scan.md "Checkpoints"): every writer writes the
files of the unrolled model, every loader (HF, GGUF, hybrid, Orbax, `glm53.build`) returns a scanned model when
asked whose per-layer parameters and logits are those of the unrolled load.

The model is the `sharded` tiny variant (8 heads: every split divides the 8 CPU devices) with 12 layers, DSA at
3, 7, 11, MoE from layer 3 and expert width 128, so that scan_layers groups it as 0-2 (scan 3 x 1), 3,
4-11 (scan 2 x 4). The reference is always the unrolled model (or the unrolled load of the same files), the values
of both read through nnx and sliced by this file's `layer_leaves`, never through `glm53.checkpoint.scan`:
per-layer values must be bitwise equal (and per-layer shardings equal on a mesh). Logits are compared once, the
scanned HF load against the unrolled model (each compile of the 12-layer model costs seconds on CPU).
"""

import filecmp
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from glm53 import build
from glm53 import parallel as S
from glm53.checkpoint import gguf as gguf_ckpt
from glm53.checkpoint import gguf_export, hf, hf_export, scan
from glm53.checkpoint import orbax as orbax_ckpt
from glm53.checkpoint.convert import convert, save_model
from glm53.config import QuantConfig, model_config_from_dict, model_config_to_dict
from glm53.errors import CheckpointError
from glm53.layers.stack import LayerGroup
from glm53.model import Glm53Model
from glm53.quant.int8 import Int8Weight
from glm53.quant.qweight import QuantizedExperts

N = 12
_D = tiny.model_config("sharded")
_D.update(num_hidden_layers=N, moe_intermediate_size=128,
          layer_types=["dsa" if i % 4 == 3 else "kda" for i in range(N)],
          mlp_layer_types=["dense"] * 3 + ["moe"] * (N - 3), indexer_types=["full"] * N)  # fmt: skip
CFG = model_config_from_dict(_D)
SCFG = CFG.replace(scan_layers=True)
GROUPS = (LayerGroup(0, 1, 3), LayerGroup(3), LayerGroup(4, 4, 2))
EXPERTS = "Q8_0"  # block 32 with a 2-byte f16 scale: the down matrices' 4 input blocks re-paired on a (2, 4) mesh
TOKENS = np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The unrolled random model and the files written from it: an f32 HF folder, an F32 GGUF, a GGUF with
    Q8_0 experts, and the Orbax checkpoint of the HF folder + those experts (int8 non-expert kernels)."""
    d = tmp_path_factory.mktemp("scan_ckpt")
    ref = Glm53Model(CFG, rngs=nnx.Rngs(0))
    hf_dir = str(d / "hf")
    hf_export.export_hf(ref, CFG, hf_dir, dtype="float32")
    params = gguf_export.model_params(ref)
    f32, q = str(d / "f32.gguf"), str(d / "q.gguf")
    gguf_export.write_gguf(f32, CFG, params)
    gguf_export.write_gguf(q, CFG, params, experts=EXPERTS)
    ckpt = convert(hf_dir, str(d / "ckpt"), gguf=[q], dtype="float32", int8=True, int8_min_size=4096,
                   chunk_bytes=4096, progress=False)  # fmt: skip
    return dict(dir=d, ref=ref, hf=hf_dir, f32=f32, q=q, ckpt=ckpt)


# ------------------------------------------------------------------------------------------------ helpers
def layer_leaves(model):
    """(per-layer name, leaf, r) of every leaf of the model's state, r the repeat of a stacked leaf [R, ...] (None:
    a plain leaf): this file's own reading of the layout, independent of `glm53.checkpoint.scan`."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        g = model.groups[path[1]] if path[0] == "layers" else None
        for kp, x in jax.tree_util.tree_flatten_with_path(var.get_value())[0]:
            leaf = jax.tree_util.keystr(kp)
            if g is not None and g.scanned:
                assert path[2] == "period" and x.shape[0] == g.repeats, path
                for r in range(g.repeats):
                    yield ".".join(map(str, ("layers", g.layer(r, path[3]), *path[4:]))) + leaf, x, r
            else:
                name = ("layers", g.first, *path[2:]) if g is not None else path
                yield ".".join(map(str, name)) + leaf, x, None


def per_layer(model) -> dict[str, np.ndarray]:
    """{per-layer name: host value} of every leaf (a stacked leaf sliced)."""
    host = {}
    out = {}
    for name, x, r in layer_leaves(model):
        h = host.setdefault(id(x), np.asarray(x))
        out[name] = h if r is None else h[r]
    return out


def per_layer_specs(model) -> dict[str, tuple]:
    """{per-layer name: its PartitionSpec, padded to the leaf's rank} (a stacked leaf's leading axis: unsharded)."""
    out = {}
    for name, x, r in layer_leaves(model):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        if r is not None:
            assert spec[0] is None, (name, spec)
            spec = spec[1:]
        out[name] = spec
    return out


def assert_same_params(got, want) -> None:
    a, b = per_layer(got), per_layer(want)
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_scanned(model) -> None:
    assert model.groups == GROUPS and model.cfg.scan_layers
    assert [type(u).__name__ for u in model.layers] == ["LayerStack", "DecoderLayer", "LayerStack"]


_JITTED = {}
# XLA:CPU without its optimizing passes (glm53.train.step.FAST_COMPILE): compiles the tiny 12-layer model in a few
# seconds; the scanned and unrolled programs then agree to rounding (the optimized ones differ by ~2e-6 relative,
# fusion order, with bitwise-equal parameters).
FAST = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True}  # fmt: skip


def logits(model) -> np.ndarray:
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(TOKENS)
    if graphdef not in _JITTED:
        fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
        _JITTED[graphdef] = fn.lower(state, tokens).compile(FAST)
    return np.asarray(_JITTED[graphdef](state, tokens))


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def scanned_twin(model):
    """A scanned copy of an unrolled model (the model's own stacking)."""
    m = nnx.merge(*nnx.split(model))
    m.set_scan_layers(True)
    assert_scanned(m)
    return m


# ------------------------------------------------------------------------------------------------ per-layer view
def test_per_layer_view_is_the_unrolled_state(world):
    """The scanned model built from the same seed: its per-layer view has the unrolled model's paths, in its order,
    and its values."""
    model = Glm53Model(SCFG, rngs=nnx.Rngs(0))
    assert_scanned(model)
    want = [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(nnx.state(world["ref"]))]
    got = list(scan.per_layer_values(model))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    assert [p for p, _ in scan.per_layer_items(world["ref"])] == [p for p, _ in want]


# ------------------------------------------------------------------------------------------------ writers
def test_hf_export_of_a_scanned_model_writes_the_same_files(world, tmp_path):
    model = scanned_twin(world["ref"])
    a, b = str(tmp_path / "unrolled"), str(tmp_path / "scanned")
    sa = hf_export.export_hf(world["ref"], CFG, a)  # bfloat16, f32 parameters kept f32
    sb = hf_export.export_hf(model, SCFG, b)
    assert sa == sb
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == sorted(sa["files"])
    for f in sa["files"]:
        assert filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False), f


def test_gguf_export_of_a_scanned_model_writes_the_same_file(world, tmp_path):
    model = scanned_twin(world["ref"])
    pa, pb = gguf_export.model_params(world["ref"]), gguf_export.model_params(model)
    assert list(pa) == list(pb)
    a, b = str(tmp_path / "unrolled.gguf"), str(tmp_path / "scanned.gguf")
    gguf_export.write_gguf(a, CFG, pa, experts=EXPERTS)
    gguf_export.write_gguf(b, SCFG, pb, experts=EXPERTS)
    assert filecmp.cmp(a, b, shallow=False)


def test_orbax_save_of_a_scanned_model_writes_the_same_checkpoint(world, tmp_path):
    """save_model: the same sidecar (manifest with every leaf's CRC-32, config with scan_layers False) and unit
    manifests whatever the layout; either checkpoint restores into either layout."""
    model = scanned_twin(world["ref"])
    a = save_model(world["ref"], str(tmp_path / "unrolled"), chunk_bytes=4096)
    b = save_model(model, str(tmp_path / "scanned"), chunk_bytes=4096)
    for name in (orbax_ckpt.META, orbax_ckpt.COMPLETE):
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name
    meta = orbax_ckpt.read_metadata(b)
    assert meta["config"]["scan_layers"] is False and meta["config"] == model_config_to_dict(CFG)
    assert meta["units"][:4] == ["embed", "layers.0", "layers.1", "layers.2"]
    for unit in meta["units"]:
        ma, mb = (json.load(open(os.path.join(x, "units", unit, "manifest.json"))) for x in (a, b))
        assert ma == mb, unit
    restored = orbax_ckpt.restore_model(b, scan_layers=True)
    assert_scanned(restored)
    assert_same_params(restored, world["ref"])


def test_stacked_paths_in_per_layer_code_are_errors_naming_scan_layers(world):
    path = ("layers", 2, "period", 1, "mlp", "router", "kernel")
    for call in (
        lambda: orbax_ckpt.unit_of(path),
        lambda: hf_export.hf_tensors(path, np.zeros((64, 8), np.float32), CFG),
        lambda: gguf_export.write_gguf("/nonexistent/x.gguf", CFG, {path: np.zeros((64, 8), np.float32)}),
    ):
        with pytest.raises(CheckpointError, match=r"scan_layers=True.*set_scan_layers\(False\)"):
            call()


# ------------------------------------------------------------------------------------------------ loaders
def test_hf_loader_returns_a_scanned_model_when_asked(world):
    ref = hf.load_hf_checkpoint(world["hf"], dtype=jnp.float32)[0]
    assert_same_params(ref, world["ref"])
    model, report = hf.load_hf_checkpoint(world["hf"], SCFG, dtype=jnp.float32)
    assert_scanned(model)
    assert_same_params(model, ref)
    # a scanned abstract model handed to load_hf_weights: filled per layer, then stacked
    abstract = nnx.eval_shape(lambda: Glm53Model(SCFG, rngs=nnx.Rngs(0)))
    model2, _ = hf.load_hf_weights(world["hf"], abstract, SCFG)
    assert_scanned(model2)
    assert_same_params(model2, ref)
    assert_scanned(abstract)  # the caller's model is left as it was


def test_scanned_hf_load_computes_the_unrolled_logits(world):
    model, _ = hf.load_hf_checkpoint(world["hf"], SCFG, dtype=jnp.float32)
    a, b = logits(model), logits(world["ref"])
    print(f"\nHF load, scanned vs the unrolled model: rel {rel(a, b):.1e}")
    assert rel(a, b) <= 1e-6


def test_gguf_loaders_return_a_scanned_model_when_asked(world):
    _, ref, _ = gguf_ckpt.load_gguf_checkpoint(world["f32"], dtype=jnp.float32)
    cfg, model, _ = gguf_ckpt.load_gguf_checkpoint(world["f32"], SCFG, dtype=jnp.float32)
    assert cfg.scan_layers
    assert_scanned(model)
    assert_same_params(model, ref)
    abstract = nnx.eval_shape(lambda: Glm53Model(SCFG, rngs=nnx.Rngs(0), dtype=jnp.float32))
    with gguf_ckpt.open_gguf_model(world["f32"]) as g:
        model2, _ = gguf_ckpt.load_gguf_weights(g, abstract, SCFG)
        assert set(gguf_ckpt.expert_tensors(g, SCFG)) == set(gguf_ckpt.expert_tensors(g, CFG))
    assert_scanned(model2)
    assert_same_params(model2, ref)


def test_hybrid_loader_with_quantized_experts_returns_a_scanned_model(world):
    quant = QuantConfig(experts=EXPERTS)
    _, ref = gguf_ckpt.load_hybrid(world["hf"], world["q"], dtype=jnp.float32, quant=quant)
    cfg, model = gguf_ckpt.load_hybrid(world["hf"], world["q"], SCFG, dtype=jnp.float32, quant=quant)
    assert cfg.scan_layers
    assert_scanned(model)
    assert isinstance(model.layers[2].period[0].mlp.experts.down_proj.get_value(), QuantizedExperts)
    assert_same_params(model, ref)


# ------------------------------------------------------------------------------------------------ Orbax restore
def test_orbax_restore_into_either_layout(world):
    """A converted checkpoint (int8 kernels, Q8_0 experts) restores unrolled by default and scanned when asked,
    each layer's tensors written straight into its stacked parameters."""
    ref = orbax_ckpt.restore_model(world["ckpt"])
    assert not scan.is_scanned(ref)
    cfg, model = orbax_ckpt.load_checkpoint(world["ckpt"], scan_layers=True)
    assert cfg.scan_layers
    assert_scanned(model)
    kinds = {type(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model.layers[2]))}
    assert {Int8Weight, QuantizedExperts} <= kinds
    assert_same_params(model, ref)


def test_orbax_sharded_restore_into_the_scanned_layout(world):
    """On a (2, 4) mesh: every layer's slice of a stacked parameter has the sharding and the value of that
    layer's parameter in the sharded unrolled restore (the leading LAYERS axis unsharded)."""
    mesh = S.make_mesh(dict(axes=("data", "model"), shape=(2, 4), rules="tp"))
    ref = orbax_ckpt.restore_model(world["ckpt"], mesh, "tp")
    model = orbax_ckpt.restore_model(world["ckpt"], mesh, "tp", scan_layers=True)
    assert_scanned(model)
    assert_same_params(model, ref)
    got, want = per_layer_specs(model), per_layer_specs(ref)
    assert got == want
    assert any(any(a is not None for a in spec) for spec in want.values())
    assert {x.sharding.mesh for _, x, _ in layer_leaves(model)} == {mesh}
    down = model.layers[2].period[0].mlp.experts.down_proj.get_value()
    assert down.planes.block_splits == 4  # re-paired per layer, then stacked


# ------------------------------------------------------------------------------------------------ build
@pytest.mark.parametrize("source", ["hf", "ckpt", "f32"])
def test_build_sharded_model_with_scan_layers(world, source):
    """`glm53.build.sharded_model` with a config whose model section sets scan_layers: the weights' config has
    it False, the loaders build per layer, the run gets the scanned model, with the values and per-layer
    shardings of the run of the same config without scan_layers."""
    mesh = dict(axes=("data", "model"), shape=(2, 4), rules="tp")  # 4-way "model": the Q8_0 experts' 4 blocks
    runs = {}
    for scan_layers in (False, True):
        section = model_config_to_dict(build.weights_config(world[source]).replace(scan_layers=scan_layers))
        config = ml_collections.ConfigDict(dict(model=section, mesh=mesh))
        runs[scan_layers] = build.sharded_model(config, weights=world[source], dtype=jnp.float32)
    run, ref = runs[True], runs[False]
    assert run.cfg.scan_layers and run.model.cfg == run.cfg
    assert_scanned(run.model)
    assert not scan.is_scanned(ref.model)
    assert_same_params(run.model, ref.model)
    assert per_layer_specs(run.model) == per_layer_specs(ref.model)
