"""Loading GLM-5.3 from GGUF (complete files and the HF + GGUF-experts hybrid), checked against transformers,
gguf-py and llama.cpp.

A randomized tiny transformers model (configs/tiny.py:gguf: hidden 256, expert width 256 so i-quant blocks fit
the expert rows, plus a random MTP block) is saved as an HF folder and written to an F32 GGUF by glm53's writer;
the writer's output is diffed against llama.cpp's own converter. The routed experts are then re-quantized with
llama.cpp's quantizer to a UD-IQ3_XXS-like mix and two other mixes. Oracles:
  * transformers (fp32) on the HF weights, for the F32 GGUF;
  * exact oracle: transformers with every expert weight replaced by gguf-py's dequantization of the GGUF tensor;
  * llama.cpp's logits (llama-cpp-python, F32 KV cache) on the same file: ~1e-5 on the F32 GGUF; with quantized
    experts it rounds activations to 8 bits inside quantized dot products, so there it is a looser reference.
Run with -s to see the numbers.
"""

import collections
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf_fixtures import (
    compare,
    exact_oracle,
    gguf_py_experts,
    indexer_margins,
    llama_logits,
    make_hf_folder,
    rewrite_gguf,
    run_llama_cpp_converter,
    tensor_types,
)
from hf_reference import hf_logits

from configs import tiny
from glm53.checkpoint import gguf as gguf_ckpt
from glm53.checkpoint import gguf_export as gguf_write
from glm53.checkpoint import gguf_rules as rules
from glm53.checkpoint.hf import load_hf_checkpoint, load_hf_weights
from glm53.config import QuantConfig, model_config_from_dict
from glm53.errors import CheckpointError
from glm53.io.gguf import open_gguf
from glm53.layers.param import is_routed_expert
from glm53.model import Glm53Model
from glm53.quant.qweight import QuantizedExperts

CFG = model_config_from_dict(tiny.model_config("gguf"))
TOKENS = [int(t) for t in np.random.default_rng(0).integers(1, CFG.vocab_size, 48)]  # 12 pools: sparse path
# The F32 comparison's prompt (12 pools; 4 selected: queries t >= 19 take the sparse path in both DSA layers). Its
# indexer selections are tie-free: every selection margin is >= MIN_MARGIN (measured 2.8e-3), so f32 rounding
# (~1e-5) cannot flip a pool choice between implementations. (TOKENS has a 2.2e-4 near-tie at t=24, layer 3.)
F32_TOKENS = [int(t) for t in np.random.default_rng(3).integers(1, CFG.vocab_size, 48)]
MIN_MARGIN = 1e-3
UD_DEVIATED = "UD-IQ3_XXS,3.down=IQ4_XS,7.gate=IQ3_S,7.up=IQ3_S,7.down=IQ4_XS"
MIXES = {
    # Unsloth's UD-IQ3_XXS scaled to 5 MoE layers (3..7: IQ2_S gate/up, IQ3_S down) with the release's deviations
    # placed by hand (IQ4_XS down in 3 and 7, IQ3_S gate/up in 7: at 5 layers the scaled table has none) + the MTP
    # block (8) in K-quants, as the release has them there.
    "UD-IQ3_XXS": f"{UD_DEVIATED},8.gate=Q4_K,8.up=Q4_K,8.down=Q5_K",
    "Q4_K": "Q4_K",
    "mixed": "gate=IQ3_XXS,up=Q3_K,down=Q6_K,4.gate=Q8_0,4.down=Q2_K,6.up=IQ4_NL,7.down=IQ3_S",
}


@dataclasses.dataclass
class World:
    dir: str
    hf: str  # HF folder
    f32: str  # glm53-written F32 GGUF
    torch_model: object
    ref: np.ndarray  # transformers logits on F32_TOKENS


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    d = str(tmp_path_factory.mktemp("gguf_model"))
    hf = os.path.join(d, "hf")
    m = make_hf_folder(hf, CFG, seed=0)
    f32 = os.path.join(d, "model-f32.gguf")
    gguf_write.convert_hf_to_gguf(hf, f32)
    return World(d, hf, f32, m, hf_logits(m, [F32_TOKENS])[0].numpy())


@pytest.fixture(scope="module")
def run():
    """logits(model, tokens): one jitted forward per model structure (compiled once for all same-shaped models)."""
    fns = {}

    def logits(model, tokens=TOKENS):
        graphdef, state = nnx.split(model)
        if graphdef not in fns:
            fns[graphdef] = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
        return np.asarray(fns[graphdef](state, jnp.asarray([tokens], jnp.int32))[0])

    return logits


@pytest.fixture(scope="module")
def quantized(world) -> dict[str, str]:
    out = {}
    for name, mix in MIXES.items():
        out[name] = os.path.join(world.dir, f"model-{name}.gguf")
        gguf_write.quantize_experts(world.f32, out[name], mix)
    return out


def load(path):
    cfg, model, _ = gguf_ckpt.load_gguf_checkpoint(path, dtype=jnp.float32)
    return cfg, model


def flat_params(model) -> dict[tuple, np.ndarray]:
    _, state = nnx.split(model)
    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def show(title, **stats):
    print(f"\n{title}")
    for k, s in stats.items():
        print(
            f"  {k:<16} max|d| {s['max']:.3e}  mean|d| {s['mean']:.3e}  rel {s['rel']:.2e}  top1 {s['top1']:.3f}"
        )


# ------------------------------------------------------------------------------------------------ the writer
def test_expert_mix_specs():
    ud = gguf_write.parse_mix("UD-IQ3_XXS")  # the release's 42 MoE layers: IQ2_S x82, IQ3_S x41, IQ4_XS x3
    counts = collections.Counter(ud.format(b, m) for b in range(3, 45) for m in ("gate", "up", "down"))
    assert counts == {"IQ2_S": 82, "IQ3_S": 41, "IQ4_XS": 3}
    assert [ud.format(b, m) for b, m in [(11, "down"), (12, "down"), (44, "down"), (44, "gate")]] == [
        "IQ4_XS", "IQ4_XS", "IQ4_XS", "IQ3_S"]  # fmt: skip
    mix = gguf_write.parse_mix("gate=iq3_xxs,up=Q3_K,down=Q6_K,4.gate=Q8_0")
    assert (mix.format(4, "gate"), mix.format(5, "gate"), mix.format(4, "up")) == ("Q8_0", "IQ3_XXS", "Q3_K")
    assert gguf_write.parse_mix("Q4_K") == gguf_write.ExpertMix("Q4_K", "Q4_K", "Q4_K")
    for bad, match in [
        ("gate=Q4_K,up=Q4_K", "no type for \\['down'\\]"),
        ("Q9_K", "unknown quantization format"),
        ("gate=Q4_K,up=Q4_K,down=Q4_K,x.down=Q4_K", "cannot parse"),
        ("FP8_E4M3", "not a GGUF type"),
    ]:
        with pytest.raises(ValueError, match=match):
            gguf_write.parse_mix(bad)


def test_writer_matches_llama_cpp_converter(world):
    """glm53's writer and llama.cpp's convert_hf_to_gguf.py give the same metadata, tensors, types and bytes
    (ssm_a = -exp(A_log) may differ by an ulp: torch vs numpy exp)."""
    conv = os.path.join(world.dir, "converter-f32.gguf")
    run_llama_cpp_converter(world.hf, conv)
    a, b = open_gguf(world.f32), open_gguf(conv)
    skip = {"general.name", "general.size_label"}
    assert set(a.metadata) - skip == set(b.metadata) - skip
    for k in set(a.metadata) - skip:
        va, vb = a.metadata[k], b.metadata[k]
        assert (va.type, va.item_type, a.get(k)) == (vb.type, vb.item_type, b.get(k)), k
    assert set(a.tensors) == set(b.tensors)
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        assert (ta.dims, ta.ggml_type) == (tb.dims, tb.ggml_type), name
        xa, xb = a.read_tensor_data(name), b.read_tensor_data(name)
        if name.endswith("ssm_a"):
            np.testing.assert_allclose(xa, xb, rtol=3e-7, atol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(xa, xb, err_msg=name)
    print(f"\nwriter == converter: {len(a.metadata)} keys, {len(a.tensors)} tensors")


# ------------------------------------------------------------------------------------------------ F32 GGUF
def test_f32_gguf_config_and_params_equal_hf_loader(world):
    """Every parameter read from the F32 GGUF (names, ssm_a, k_b / v_b, conv, hc, experts, MTP) equals the HF
    loader's (itself checked against torch); the config read from GGUF metadata equals the HF config."""
    cfg, model = load(world.f32)
    assert cfg == CFG.replace(eos_token_ids=())  # the tokenizer-less GGUF carries no eos ids
    assert model.mtp is not None
    hf_model, _ = load_hf_checkpoint(world.hf, CFG, dtype=jnp.float32)
    got, want = flat_params(model), flat_params(hf_model)
    assert set(got) == set(want)
    for p, w in want.items():
        atol = 3e-7 if p[-1] == "A_log" else 0  # log(-(-exp(A_log))): exp(A_log) is kept to an f32 ulp
        np.testing.assert_allclose(got[p], w, rtol=0, atol=atol, err_msg=str(p))
    # Without the MTP block its tensors are ignored (blk.8: 29 tensors).
    _, trunk, report = gguf_ckpt.load_gguf_checkpoint(world.f32, dtype=jnp.float32, with_mtp=False)
    assert trunk.mtp is None and report.ignored == {"MTP block (the model is built without one)": 29}


def test_f32_gguf_logits_match_transformers_and_llama_cpp(world, run):
    """Over all 48 positions of a prompt on which the sparse path is active and the indexer choices are tie-free:
    glm53 == transformers to 1e-4 relative, and == llama.cpp (F32 KV cache) to ~1e-5 with 100% top-1."""
    _, model = load(world.f32)
    margins = indexer_margins(model, F32_TOKENS)
    assert len(margins) == 2 * (len(F32_TOKENS) - 19)  # 2 DSA layers x the queries with > 4 candidate pools
    assert margins.min() >= MIN_MARGIN, f"indexer near-tie in the test prompt: margin {margins.min():.2e}"
    ours = run(model, F32_TOKENS)
    ll = llama_logits(world.f32, F32_TOKENS)
    ours_hf, ours_ll, hf_ll = compare(ours, world.ref), compare(ours, ll), compare(world.ref, ll)
    show("F32 GGUF", **{"ours-transformers": ours_hf, "ours-llama.cpp": ours_ll, "transformers-llama": hf_ll})
    print(f"  indexer margins: min {margins.min():.2e} over {len(margins)} sparse (layer, query) pairs")
    assert ours_hf["rel"] <= 1e-4
    # Observed: ours-llama.cpp max 2.8e-5 (rel 5e-6, mean 3e-6), the same as transformers-llama.cpp: f32
    # summation-order noise on logits of magnitude ~5. A misread tensor or a flipped pool gives >= 1e-2.
    assert ours_ll["max"] <= 5e-5 and ours_ll["rel"] <= 1e-5 and ours_ll["mean"] <= 1e-5, ours_ll
    assert ours_ll["top1"] == 1.0 and hf_ll["top1"] == 1.0


# ------------------------------------------------------------------------------------------------ quantized experts
@pytest.mark.parametrize("mix", list(MIXES))
def test_quantized_experts_match_exact_oracle_and_llama_cpp(world, quantized, run, mix):
    path = quantized[mix]
    types = tensor_types(path)
    spec = gguf_write.parse_mix(MIXES[mix], moe_layers=[3, 4, 5, 6, 7])
    for name, t in types.items():  # the file holds what the mix asked for, read by gguf-py
        m = gguf_write.EXPERT_NAME.fullmatch(name)
        assert t == (spec.format(int(m["block"]), m["matrix"]) if m else "F32"), name
    _, model = load(path)
    ours = run(model)
    oracle = hf_logits(exact_oracle(world.torch_model, path), [TOKENS])[0].numpy()
    ll = llama_logits(path, TOKENS)
    ours_or, ours_ll, or_ll = compare(ours, oracle), compare(ours, ll), compare(oracle, ll)
    expert_types = sorted({t for n, t in types.items() if "_exps" in n})
    show(f"{mix} experts ({', '.join(expert_types)})",
         **{"ours-oracle": ours_or, "ours-llama.cpp": ours_ll, "oracle-llama.cpp": or_ll})  # fmt: skip
    assert ours_or["rel"] <= 1e-4
    # llama.cpp rounds activations to 8 bits in quantized dot products: a looser, independent reference. It
    # must still be near the exact computation (a misread expert layout gives O(1) differences everywhere).
    assert or_ll["mean"] < 0.2 and or_ll["top1"] >= 0.8
    # glm53 is no farther from llama.cpp than the exact oracle (slack: ours vs oracle differ by ~1e-5; the
    # llama.cpp distances are ~0.1, so 5% is far above float noise and far below any real difference).
    assert ours_ll["max"] <= 1.05 * or_ll["max"] + 1e-6
    assert ours_ll["mean"] <= 1.05 * or_ll["mean"] + 1e-6
    assert ours_ll["top1"] >= or_ll["top1"] - 1 / len(TOKENS)  # one near-tie may flip between ours and oracle


def test_expert_tensors_seam(quantized):
    """expert_tensors gives each (layer, matrix)'s GGUF format, shape and raw blocks; equal to gguf-py's view."""
    path = quantized["UD-IQ3_XXS"]
    reader = {t.name: t for t in GGUFReader(path).tensors}
    ref = gguf_py_experts(path)
    with gguf_ckpt.open_gguf_model(path) as g:
        experts = gguf_ckpt.expert_tensors(g, CFG)
        moe = [i for i, t in enumerate(CFG.mlp_layer_types) if t == "moe"]
        assert len(experts) == 3 * (len(moe) + 1)
        assert {(e.layer, e.matrix) for e in experts.values()} == {
            (i, m) for i in moe + ["mtp"] for m in ("gate", "up", "down")
        }
        for e in experts.values():
            block = CFG.num_hidden_layers if e.layer == "mtp" else e.layer
            t = reader[e.name]
            assert e.name == f"blk.{block}.ffn_{e.matrix}_exps.weight"
            assert e.format.name == t.tensor_type.name
            assert e.shape == tuple(int(x) for x in reversed(t.shape))  # [E, out, in]
            np.testing.assert_array_equal(e.read().reshape(-1), np.asarray(t.data).reshape(-1))
            np.testing.assert_array_equal(e.read(3, 5).reshape(-1), np.asarray(t.data)[3:5].reshape(-1))
            np.testing.assert_array_equal(e.dequantize(), ref[block, e.matrix].transpose(0, 2, 1))


def test_experts_kept_quantized(world, quantized):
    """With a QuantConfig the routed experts stay GGUF blocks (QuantizedExperts planes): their bytes are the
    file's (read by gguf-py); a file whose types differ from the config's is refused, naming each tensor."""
    path = quantized["UD-IQ3_XXS"]
    quant = QuantConfig(experts=UD_DEVIATED)  # the same table; the MTP block stays dense
    _, model, _ = gguf_ckpt.load_gguf_checkpoint(path, dtype=jnp.float32, quant=quant)
    raw = {t.name: np.asarray(t.data).reshape(-1) for t in GGUFReader(path).tensors}
    for i in range(3, 8):
        for m in ("gate", "up", "down"):
            q = getattr(model.layers[i].mlp.experts, f"{m}_proj").get_value()
            assert isinstance(q, QuantizedExperts), (i, m)
            np.testing.assert_array_equal(
                np.asarray(q.to_gguf_bytes()).reshape(-1), raw[f"blk.{i}.ffn_{m}_exps.weight"]
            )
    dense = gguf_py_experts(path)[8, "gate"].transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(model.mtp.mlp.experts.gate_proj.get_value()), dense)
    with pytest.raises(CheckpointError) as e:
        gguf_ckpt.load_gguf_checkpoint(quantized["Q4_K"], dtype=jnp.float32, quant=quant)
    assert len(
        e.value.problems
    ) == 15 and "blk.7.ffn_gate_exps.weight: Q4_K, but the model keeps this tensor as IQ3_S" in str(e.value)


# ------------------------------------------------------------------------------------------------ other files
@pytest.mark.parametrize("dense_type", ["Q8_0", "BF16"])
def test_dense_tensors_of_other_types(world, tmp_path, dense_type):
    """Non-expert matrices stored as Q8_0 / BF16 decode like gguf-py's dequantization (layouts: the F32 test)."""
    hf_model, _ = load_hf_checkpoint(world.hf, CFG, dtype=jnp.float32)
    path = str(tmp_path / f"dense-{dense_type}.gguf")
    gguf_write.write_gguf(path, CFG, gguf_write.model_params(hf_model), dense_type=dense_type)
    ref = {t.name: gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
           for t in GGUFReader(path).tensors}  # fmt: skip
    assert {t for t in tensor_types(path).values()} == {"F32", dense_type}
    _, model = load(path)
    for p, v in flat_params(model).items():
        t = rules.target_for(p, v.shape, CFG)
        want = rules.from_gguf(t.kind, [ref[n] for n in t.names])
        np.testing.assert_array_equal(v, want, err_msg=str(p))


def test_hybrid_hf_non_experts_plus_gguf_experts(world, quantized):
    """load_hybrid == HF loader for non-experts and == the complete-GGUF path for the experts."""
    path = quantized["UD-IQ3_XXS"]
    cfg, model = gguf_ckpt.load_hybrid(world.hf, path, dtype=jnp.float32)
    assert dataclasses.replace(cfg, vision=None) == CFG  # the HF config (it also describes the vision tower)
    hybrid, full = flat_params(model), flat_params(load(path)[1])
    hf = flat_params(load_hf_checkpoint(world.hf, CFG, dtype=jnp.float32)[0])
    assert set(hybrid) == set(full) == set(hf)
    for p, v in hybrid.items():
        np.testing.assert_array_equal(v, full[p] if is_routed_expert(p) else hf[p], err_msg=str(p))
    # The HF folder's per-expert tensors (16 experts x 3 matrices x 6 MoE blocks) are not even read.
    abstract = nnx.eval_shape(lambda: Glm53Model(CFG, rngs=nnx.Rngs(0)))
    _, report = load_hf_weights(world.hf, abstract, CFG, skip=is_routed_expert)
    assert report.ignored["parameters filled from elsewhere (skip)"] == 16 * 3 * 6
    assert report.tensors_read == len(hf) - 3 * 6  # one key per non-expert parameter


def test_glm5next_architecture_spelling(world, tmp_path):
    """Mainline llama.cpp's `glm5next` (keys glm5next.*) loads the same as `glm5-next`."""
    path = str(tmp_path / "glm5next.gguf")
    rewrite_gguf(
        world.f32, path, metadata={"general.architecture": "glm5next"}, rename=("glm5-next.", "glm5next.")
    )
    cfg, model = load(path)
    assert cfg == CFG.replace(eos_token_ids=())
    got, want = flat_params(model), flat_params(load(world.f32)[1])
    for p, v in want.items():
        np.testing.assert_array_equal(got[p], v, err_msg=str(p))


# ------------------------------------------------------------------------------------------------ errors
def test_tensor_problems_reported_together(world, tmp_path):
    path = str(tmp_path / "bad.gguf")
    rewrite_gguf(world.f32, path, drop={"blk.3.attn_k_b.weight"},
                 replace={"blk.0.ssm_f_a.weight": np.zeros((16, 256)), "blk.4.ssm_a": np.ones(4)},
                 add={"blk.0.mystery.weight": np.zeros(8)})  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert path in msg and len(e.value.problems) == 4, msg
    for name in ("blk.3.attn_k_b.weight", "blk.0.ssm_f_a.weight", "blk.4.ssm_a", "blk.0.mystery.weight"):
        assert name in msg, (name, msg)
    kinds = sorted(p.split(":")[0] for p in e.value.problems)
    assert kinds == ["missing", "shape", "unexpected", "value"], e.value.problems


def test_metadata_problems_name_the_keys(world, tmp_path):
    path = str(tmp_path / "arch.gguf")
    rewrite_gguf(world.f32, path, metadata={"general.architecture": "llama"})
    with pytest.raises(CheckpointError, match="general.architecture is 'llama'"):
        load(path)
    path = str(tmp_path / "keys.gguf")
    rewrite_gguf(world.f32, path, drop_keys={"glm5-next.kda.head_dim", "glm5-next.attention.indexer.kpool"},
                 metadata={"glm5-next.swiglu_clamp_exp": [10.0] * 8 + [7.0]})  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        load(path)
    for key in ("glm5-next.kda.head_dim", "glm5-next.attention.indexer.kpool", "glm5-next.swiglu_clamp_exp"):
        assert key in str(e.value), (key, str(e.value))


def test_hybrid_problems_name_the_tensors(world, quantized, tmp_path):
    path = str(tmp_path / "experts.gguf")
    rewrite_gguf(quantized["Q4_K"], path, drop={"blk.8.ffn_down_exps.weight"},
                 replace={"blk.4.ffn_up_exps.weight": np.zeros((8, 256, 256))},
                 add={"blk.9.ffn_gate_exps.weight": np.zeros((16, 256, 256))})  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        gguf_ckpt.load_hybrid(world.hf, path, dtype=jnp.float32)
    msg = str(e.value)
    for name in ("blk.8.ffn_down_exps.weight", "blk.4.ffn_up_exps.weight", "blk.9.ffn_gate_exps.weight"):
        assert name in msg, (name, msg)
    assert len(e.value.problems) == 3, msg


# ------------------------------------------------------------------------------------------------ entry point
def test_score_cli_with_gguf_and_hybrid(tmp_path):
    """experiments.score --weights=FILE.gguf and --weights=HF_DIR --experts=FILE.gguf on a tiny model (Q8_0
    experts): both equal the exact oracle."""
    from absl import flags

    from experiments import score

    cfg = model_config_from_dict(tiny.model_config("default")).replace(num_nextn_predict_layers=0)
    hf = str(tmp_path / "hf")
    m = make_hf_folder(hf, cfg, seed=3)
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    gguf_write.convert_hf_to_gguf(hf, f32)
    gguf_write.quantize_experts(f32, q8, "Q8_0")
    seqs = [[int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 20)]]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(seqs))
    oracle = hf_logits(exact_oracle(m, q8), seqs)[0].numpy()
    outs = {}
    for name, args in {"gguf": [f"--weights={q8}"], "hybrid": [f"--weights={hf}", f"--experts={q8}"]}.items():
        out = str(tmp_path / f"{name}.npz")
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["score", *args, f"--tokens={tokens}", f"--out={out}"])
        score.main(["score"])
        outs[name] = np.load(out)["logits_0"]
        assert compare(outs[name], oracle)["rel"] <= 1e-4, name
    flags.FLAGS.unparse_flags()
    np.testing.assert_allclose(outs["gguf"], outs["hybrid"], rtol=0, atol=1e-5)
