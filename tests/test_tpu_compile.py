"""Programs compiled for real TPUs on this host (libtpu's compiler, no chip): the expert kernels through the
kernel api, and a reduced model at the release widths on a v5e-8 slice.

The per-case kernel compiles (every format, shape, activation dtype and path, for v5e, v5p and v6e) are in
tests/test_moe_pallas.py; the helpers in `glm53.testing.tpu`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from test_moe_pallas import LIMIT, case_data

from configs import glm53_flash
from glm53 import parallel as S
from glm53.benchmarks.compiled_hlo import collectives
from glm53.config import QuantConfig, model_config_from_dict
from glm53.model import Glm53Model
from glm53.quant.qweight import QuantizedExperts
from glm53.testing import tpu
from kernels.moe import api
from kernels.moe import pallas_tpu_decode as KD
from kernels.moe import pallas_tpu_prefill as KP

pytestmark = pytest.mark.tpu_compile

_FAST_COMPILE = {"xla_backend_optimization_level": 0}  # interpret-mode kernels are big straight-line bodies


def _while_loops(compiled) -> int:
    return len(re.findall(r" while\(", compiled.as_text()))


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_api_compiles_mosaic_for_tpu_and_interprets_on_cpu(path):
    """`moe_experts(implementation="pallas_tpu")`: lowered for TPU devices (from this CPU host) the program holds
    the 2 Mosaic kernels of the path and no interpreter (as many loops as the kernels called directly with
    interpret=False); run on CPU it equals the kernels in interpret mode."""
    name = "iq4_q4k_iq2s_T3"
    c = case_data(name)
    slots = c["ids"].size
    ws = [QuantizedExperts.from_planes(c[m]) for m in ("gate", "up", "down")]
    max_slots = slots if path == "decode" else slots - 1

    def via_api(x, ids, w, g, u, d):
        return api.moe_experts(
            x, ids, w, g, u, d, LIMIT, implementation="pallas_tpu", decode_max_slots=max_slots
        )

    kernel = KD.moe_decode if path == "decode" else KP.moe_prefill

    def direct(interpret):
        return lambda x, ids, w, g, u, d: kernel(
            x, ids, w, g.planes, u.planes, d.planes, LIMIT, interpret=interpret
        )

    args = (c["x"], c["ids"], c["w"], *ws)
    compiled = tpu.compile_for(via_api, *args)
    assert tpu.mosaic_kernels(compiled) == 2
    assert _while_loops(compiled) == _while_loops(tpu.compile_for(direct(False), *args))
    on_cpu = jax.jit(via_api, compiler_options=_FAST_COMPILE)(*args)
    want = jax.jit(direct(True), compiler_options=_FAST_COMPILE)(*args)
    np.testing.assert_array_equal(np.asarray(on_cpu), np.asarray(want))


def test_reference_experts_compile_for_tpu_in_bf16():
    """The reference path's grouped matmul (`jax.lax.ragged_dot`, itself a Mosaic kernel on TPU) with bf16
    activations and weights compiles for TPU (bf16 operands at DEFAULT precision, f32 accumulation)."""
    c = case_data("iq3r_bf16_iq4_T8")
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    ws = [bf16(np.swapaxes(w, 1, 2)) for w in c["oracle"]]  # [E, in, out]

    def ref(x, ids, w, g, u, d):
        return api.moe_experts(x, ids, w, g, u, d, LIMIT, implementation="reference")

    compiled = tpu.compile_for(ref, bf16(c["x"]), c["ids"], c["w"], *ws)
    assert tpu.mosaic_kernels(compiled) >= 1
    print(f"reference bf16 on v5e: {tpu.mosaic_kernels(compiled)} Mosaic kernels")


# -------------------------------------------------------------------------------- reduced real-width model
def _shard_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize for a in leaves)


def test_release_width_model_decode_compiles_for_v5e_8():
    """Release widths (hidden 4096, 288 experts of 4096 x 2048, configs/glm53_flash.py) cut to a KDA+MoE and a
    DSA+MoE layer, routed experts in the UD-IQ3_XXS mix as GGUF planes (IQ2_S / IQ3_S gate/up, IQ4_XS down
    for a 2-layer model) run by the Pallas kernels, bf16, the release's serving caches (int8 MLA latent with a
    per-token scale, pooled indexer keys, both split by sequence over the 8 chips), TP rules on a 1x8 mesh of
    v5e:2x4: the decode step of 1 stream (cache of 1024 tokens) compiles, with 2 Mosaic kernels per MoE layer
    (gate+up, down) and the DSA layer's cache step under shard_map (the two-stage top-k's all-gathers).

    Per device (libtpu 0.0.42.1): arguments 1210.5 MB (the weight and cache shards + tile padding), output
    0.7 MB (0.6 MB aliased to the donated cache), temporaries 10.9 MB, code 7.1 MB.
    """
    d = glm53_flash.model_config().to_dict()
    d.update(
        num_hidden_layers=2,
        layer_types=["kda", "dsa"],
        mlp_layer_types=["moe"] * 2,
        indexer_types=["full"] * 2,
    )
    cfg = model_config_from_dict(d)
    # the release's deviations placed by hand (scaled to 2 layers, the mix is IQ2_S / IQ3_S alone)
    quant = QuantConfig(experts="ud_iq3_xxs,0.down=IQ4_XS,1.gate=IQ3_S,1.up=IQ3_S,1.down=IQ4_XS", layout="planes")
    mesh = tpu.topology_mesh("v5e:2x4", (1, 8), ("data", "model"))

    def build():
        with nnx.var_defaults(ref=True):  # the RNG counter as a Ref: fast abstract init
            rngs = nnx.Rngs(0)
        return Glm53Model(cfg, rngs=rngs, dtype=jnp.bfloat16, quant=quant, kernels={"moe": "pallas_tpu"}, with_mtp=False)

    model = S.abstract_sharded_model(build, mesh, "tp")
    formats = [
        tuple(
            getattr(layer.mlp.experts, m).get_value().format_name
            for m in ("gate_proj", "up_proj", "down_proj")
        )
        for layer in model.layers
    ]
    assert formats == [("IQ2_S", "IQ2_S", "IQ4_XS"), ("IQ3_S", "IQ3_S", "IQ4_XS")]
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, 1024))
    dsa = cache.layers[1]
    assert dsa.latent.dtype == jnp.int8 and dsa.latent_scale.shape == (1, 1024)
    cache = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        cache,
        S.cache_shardings(cache, mesh, "tp"),
    )
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    def step(state, cache, tokens):
        return nnx.merge(graphdef, state)(tokens, cache=cache)

    compiled = tpu.compile_for(step, state, cache, tokens, donate_argnums=1)
    mem = tpu.memory_stats(compiled)
    report = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in mem.items())
    print(f"release-width 2-layer decode on v5e-8 (per device): {report}")
    assert tpu.mosaic_kernels(compiled) == 2 * 2, report
    placed = S.cache_shardings(cache, mesh, "tp").layers[1]
    assert placed.latent.shard_shape(dsa.latent.shape) == (1, 1024 // 8, 512)  # 1/8 of the positions per chip
    assert placed.pooled.shard_shape(dsa.pooled.shape) == (1, 1024 // 4 // 8, 128)
    assert collectives(compiled.as_text())["all-gather"] >= 2, report  # the candidates of the two-stage top-k
    pad = mem["argument"] - _shard_bytes((state, cache, tokens))  # TPU tile padding of the small arrays
    assert 0 <= pad < 1 << 20, report
    assert mem["temp"] < 64 << 20, report
