"""One kernel configuration (glm53/config/kernels.py): a frozen, validated `KernelConfig` names the implementation
of each kernel op, "auto" by default for models, entry points and training alike; the valid names are the kernel
packages' own; unknown ops and names are ConfigErrors naming the field and the choices. Decode-time weights carry
their own products, so no layer and no reference tests a weight's type."""

from __future__ import annotations

import ast
import pathlib
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import app
from flax import nnx

from configs import ablate, glm53_flash, tiny, train
from experiments import cli
from glm53 import build
from glm53.ablation import pipeline
from glm53.config import ConfigError, model_config_from_dict, quant_config_from_dict
from glm53.config.kernels import OPS, KernelConfig, kernel_config, kernel_config_from_dict
from glm53.layers.linear import Linear
from glm53.model import Glm53Model
from glm53.quant.int8 import quantize_int8
from kernels import kda, mhc, moe, sparse_mla
from kernels.matmul import api as matmul_api
from kernels.matmul.streamed import StreamedKernel
from kernels.moe import api as moe_api
from kernels.moe.expert_list import ExpertList, split_experts

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = model_config_from_dict(tiny.model_config("default"))


# ------------------------------------------------------------------------------------------------ the config
def test_every_op_defaults_to_auto_and_lists_its_package_names():
    assert KernelConfig() == KernelConfig(mhc="auto", kda="auto", sparse_mla="auto", moe="auto")
    assert [f for f in KernelConfig().to_dict()] == list(OPS)
    assert OPS == {
        "mhc": tuple(mhc.IMPLEMENTATIONS),
        "kda": tuple(kda.IMPLEMENTATIONS),
        "sparse_mla": tuple(sparse_mla.api.IMPLEMENTATIONS),
        "moe": tuple(moe.IMPLEMENTATIONS),
    }
    for valid in OPS.values():
        assert "auto" in valid and "reference" in valid
    assert {"blocked", "xla_cpu", "pallas_tpu", "pallas_gpu"} <= set(OPS["moe"])
    assert "gather" in OPS["sparse_mla"] and "xla_cpu" in OPS["kda"] and "xla_cpu" in OPS["mhc"]


@pytest.mark.parametrize("op", sorted(OPS))
def test_an_unknown_implementation_names_the_field_and_the_choices(op):
    with pytest.raises(
        ConfigError, match=rf"'kernels\.{op}': unknown implementation 'fast'; expected one of"
    ) as e:
        KernelConfig(**{op: "fast"})
    assert all(repr(name) in str(e.value) for name in OPS[op])
    with pytest.raises(ConfigError, match=rf"kernels\.{op}"):
        KernelConfig().replace(**{op: "fast"})
    with pytest.raises(ConfigError, match=rf"kernels\.{op}"):
        kernel_config({op: "fast"})


def test_an_unknown_op_is_rejected_with_the_valid_ops():
    with pytest.raises(
        ConfigError, match=r"unknown keys \['mo'\]; valid keys are \['kda', 'mhc', 'moe', 'sparse_mla'\]"
    ):
        kernel_config({"mo": "reference"})
    with pytest.raises(ConfigError, match="unknown ops"):
        KernelConfig().replace(mo="reference")
    with pytest.raises(ConfigError, match="unknown keys"):
        Glm53Model(CFG, rngs=nnx.Rngs(0), kernels={"moe": "reference", "matmul": "auto"})


def test_conversions():
    k = KernelConfig(moe="blocked")
    assert kernel_config(None) == KernelConfig()
    assert kernel_config(k) is k
    assert (
        kernel_config({"moe": "blocked"})
        == k
        == kernel_config_from_dict(ml_collections.ConfigDict({"moe": "blocked"}))
    )
    assert hash(k) == hash(KernelConfig(moe="blocked"))  # frozen: a static attribute of modules
    with pytest.raises(AttributeError):
        k.moe = "reference"


# ------------------------------------------------------------------------------------------------ the model
def _implementations(model: Glm53Model) -> set[tuple[str, str]]:
    out = set()
    for layer in model.unrolled_layers():
        out |= {("mhc", layer.attn_hc.implementation), ("mhc", layer.ffn_hc.implementation)}
        out.add(("kda" if layer.attn_kind == "kda" else "sparse_mla", layer.self_attn.implementation))
        if layer.mlp_kind == "moe":
            out.add(("moe", layer.mlp.experts.implementation))
    out |= {("sparse_mla", model.mtp.self_attn.implementation), ("moe", model.mtp.mlp.experts.implementation)}
    return out


def test_the_model_builds_every_op_from_the_one_config():
    model = Glm53Model(CFG, rngs=nnx.Rngs(0))
    assert model.kernels == KernelConfig()
    assert _implementations(model) == {(op, "auto") for op in OPS}
    chosen = KernelConfig(mhc="reference", kda="xla_cpu", sparse_mla="gather", moe="blocked")
    for kernels in (chosen, chosen.to_dict()):
        model = Glm53Model(CFG, rngs=nnx.Rngs(0), kernels=kernels)
        assert model.kernels == chosen
        assert _implementations(model) == set(chosen.to_dict().items())
    partial = Glm53Model(CFG, rngs=nnx.Rngs(0), kernels={"moe": "reference"})
    assert partial.kernels == KernelConfig(moe="reference")


# ------------------------------------------------------------------------------------------------ configs
def test_config_files_carry_a_kernels_section():
    assert build.kernels_from_experiment_config(tiny.get_config()) == KernelConfig()
    assert build.kernels_from_experiment_config(glm53_flash.get_config()) == KernelConfig()
    assert build.kernels_from_experiment_config(train.get_config()) == KernelConfig(
        moe="blocked"
    )  # training's
    assert build.kernels_from_experiment_config(None) == KernelConfig()
    no_section = ml_collections.ConfigDict({"model": tiny.model_config()})
    assert build.kernels_from_experiment_config(no_section) == KernelConfig()
    assert pipeline.ablate_config(ablate.get_config()).kernels == KernelConfig()
    # a locked config takes --config.kernels.<op> overrides; a mistyped op is no field of it
    c = tiny.get_config()
    c.lock()
    c.kernels.moe = "reference"
    assert build.kernels_from_experiment_config(c) == KernelConfig(moe="reference")
    with pytest.raises(AttributeError):
        c.kernels.mo = "reference"
    c.kernels.moe = "fast"
    with pytest.raises(ConfigError, match=r"'kernels\.moe'"):
        build.kernels_from_experiment_config(c)


def test_model_from_experiment_config_uses_its_kernels_section():
    c = tiny.get_config()
    c.model.num_nextn_predict_layers = 0
    c.kernels.moe = "dense_einsum"
    c.kernels.kda = "reference"
    _, model = build.model_from_experiment_config(c)
    assert model.kernels == KernelConfig(kda="reference", moe="dense_einsum")
    run = build.sharded_model(c, with_mtp=False)
    assert run.model.kernels == KernelConfig(kda="reference", moe="dense_einsum")
    # an explicit argument replaces the section (the entry points pass experiments.cli.kernel_config's)
    run = build.sharded_model(c, with_mtp=False, kernels={"moe": "reference"})
    assert run.model.kernels == KernelConfig(moe="reference")


def test_quant_moe_impl_points_at_kernels_moe():
    with pytest.raises(
        ConfigError, match=r"'quant\.moe_impl': the expert kernel moved .* kernels\.moe='auto'"
    ):
        quant_config_from_dict({"experts": "none", "moe_impl": "auto"})
    assert "moe_impl" not in tiny.get_config().quant and "moe_impl" not in glm53_flash.get_config().quant


def test_the_moe_impl_flag_is_the_config_field_of_a_run_without_config():
    flag = types.SimpleNamespace(value=None)
    assert cli.kernel_config(None, flag) == KernelConfig()
    assert cli.kernel_config(train.get_config(), flag) == KernelConfig(moe="blocked")
    flag.value = "reference"
    assert cli.kernel_config(None, flag) == KernelConfig(moe="reference")
    with pytest.raises(app.UsageError, match="--config.kernels.moe=reference"):
        cli.kernel_config(tiny.get_config(), flag)


# ------------------------------------------------------------------------------------------------ weights
def test_weights_multiply_themselves():
    """kernels.matmul.api.matmul: an array, a StreamedKernel and an Int8Weight give the same product as the
    plain array; a Linear reads any of them."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    want = np.asarray(x @ w)
    np.testing.assert_allclose(matmul_api.matmul(x, w), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(matmul_api.matmul(x, StreamedKernel(w)), want, rtol=1e-5, atol=1e-5)
    hi = matmul_api.matmul(x, StreamedKernel(w), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(hi, want, rtol=1e-5, atol=1e-5)
    q = quantize_int8(np.asarray(w))
    np.testing.assert_allclose(matmul_api.matmul(x, q), np.asarray(x @ q.dequantize()), rtol=1e-5, atol=1e-5)
    lin = Linear(8, 5, (None, None), rngs=nnx.Rngs(0))
    lin.kernel.set_value(StreamedKernel(w))
    np.testing.assert_allclose(lin(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["reference", "dense_einsum", "xla_cpu_prefill"])
def test_the_moe_api_unwraps_decode_weights(implementation):
    """ExpertList / StreamedKernel experts reach an implementation other than the xla_cpu decode form as plain
    arrays (kernels.moe.api.READS_DECODE_WEIGHTS): the same output as the stacked kernels."""
    rng = np.random.default_rng(1)
    e, d, f, t, k = 4, 8, 6, 3, 2
    ws = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    wt = jnp.asarray(rng.random((t, k)), jnp.float32)
    want = moe_api.moe_experts(x, ids, wt, *ws, 10.0, implementation=implementation)
    for wrap in (split_experts, StreamedKernel):
        got = moe_api.moe_experts(x, ids, wt, *map(wrap, ws), 10.0, implementation=implementation)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert moe_api.READS_DECODE_WEIGHTS == ("xla_cpu_decode",)
    assert isinstance(split_experts(ws[0]).unwrap(), jax.Array) and isinstance(
        ExpertList(list(ws[0])), ExpertList
    )


# Weight types whose use a layer or a reference leaves to the weight's own methods (matmul / unwrap).
WEIGHT_TYPES = {"StreamedKernel", "ExpertList", "Int8Weight"}


def _type_tests(path: pathlib.Path) -> list[str]:
    """`isinstance(..., T)` checks and imports of a weight type T of WEIGHT_TYPES in a source file."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and len(node.args) == 2
        ):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            found += [f"{path.name}:{node.lineno}: isinstance(..., {t})" for t in names & WEIGHT_TYPES]
        if isinstance(node, ast.ImportFrom):
            found += [
                f"{path.name}:{node.lineno}: imports {a.name}" for a in node.names if a.name in WEIGHT_TYPES
            ]
    return found


def test_no_layer_or_reference_tests_a_weight_type(tmp_path):
    files = [
        *sorted((ROOT / "glm53" / "layers").glob("*.py")),
        *sorted((ROOT / "kernels").glob("*/reference.py")),
    ]
    assert len(files) > 10
    bad = [hit for p in files for hit in _type_tests(p)]
    assert not bad, "weight types tested outside the weights' own methods:\n  " + "\n  ".join(bad)
    probe = tmp_path / "probe.py"  # the checker sees the checks this file replaced
    probe.write_text(
        "from kernels.matmul.streamed import StreamedKernel\nisinstance(w, Int8Weight | m.StreamedKernel)\n"
    )
    assert len(_type_tests(probe)) == 3
