"""HF checkpoint loading: transformers' save_pretrained folders (release and fused names, sharded, bf16), an FP8
folder written here with torch, error collection, corrupt files and int8 storage.

References: the tensors in the saved files (read back with safetensors' torch loader) mapped by an explicit
per-parameter statement of the layout in `expected_params`, torch's own FP8 dequantization, transformers' logits.
"""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from glm53 import build
from glm53.checkpoint import (
    CheckpointError,
    SafetensorsFile,
    gguf_export,
    load_hf_checkpoint,
    load_hf_weights,
)
from glm53.checkpoint import gguf as gguf_ckpt
from glm53.checkpoint.hf_rules import Mapped, classify
from glm53.config import ModelConfig, as_hf_text_config
from glm53.model import Glm53Model
from glm53.quant.int8 import Int8Weight

P = "model.language_model."
SMALL = dict(num_hidden_layers=4, num_attention_heads=2, index_n_heads=4, index_head_dim=16, index_topk=8,
             linear_num_heads=2, num_experts_per_tok=2, n_routed_experts=8, eos_token_ids=(1,), pad_token_id=0)  # fmt: skip
# layers 0-2: KDA + dense MLP; layer 3: DSA + MoE; layer 4: MTP.
TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
                   q_lora_rank=48, qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=16, **SMALL)  # fmt: skip
# Dims above and not multiples of 128, so FP8 blocks are several and ragged.
FP8CFG = ModelConfig(vocab_size=300, hidden_size=160, intermediate_size=288, moe_intermediate_size=136,
                     kv_lora_rank=40, q_lora_rank=144, qk_nope_head_dim=24, v_head_dim=24, linear_head_dim=80,
                     **SMALL)  # fmt: skip
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)


# ------------------------------------------------------------------------------------------------ references
def torch_model(cfg: ModelConfig, seed: int) -> Glm5NextForConditionalGeneration:
    """transformers' model of cfg with every parameter perturbed (constant inits included)."""
    torch.manual_seed(seed)
    hf_cfg = Glm5NextConfig(text_config=as_hf_text_config(cfg), vision_config=dict(VISION, out_hidden_size=cfg.hidden_size),
                            tie_word_embeddings=False)  # fmt: skip
    m = Glm5NextForConditionalGeneration(hf_cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.config._attn_implementation = "eager"
    return m.eval()


def mtp_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP block (layer num_hidden_layers) in release names (transformers has no MTP module)."""
    g = torch.Generator().manual_seed(seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    ref = torch_model(cfg, seed + 1).state_dict()
    src = f"{P}layers.3."  # a DSA + MoE layer supplies the attention and MoE shapes
    out = {}
    for k, t in ref.items():
        if k.startswith(src) and "_hc." not in k:
            out[k] = t
    out = release_names(out)
    out = {k.replace(src, f"{P}layers.{cfg.num_hidden_layers}."): t for k, t in out.items()}
    n = f"{P}layers.{cfg.num_hidden_layers}."
    out[n + "eh_proj.weight"] = 0.05 * torch.randn(d, 2 * d, generator=g)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[n + name + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    out[n + "embed_tokens.weight"] = torch.randn(v, d, generator=g)  # copies that the loader ignores
    out[n + "shared_head.head.weight"] = torch.randn(v, d, generator=g)
    return {k: t.contiguous().clone() for k, t in out.items()}


def release_names(sd: dict) -> dict:
    """Unfuses transformers' in-memory expert / conv / forget-gate names into the release's (for MTP only)."""
    out = {}
    for k, t in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :f]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, f:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[k] = t
    return out


def read_folder(folder) -> dict[str, np.ndarray]:
    """Every tensor of a folder's safetensors files, as f32 numpy (torch loader, independent of ours)."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k).float().numpy()
    return out


def expected_params(sd: dict[str, np.ndarray], cfg: ModelConfig, mtp: bool = True) -> dict[tuple, np.ndarray]:
    """Our parameter values from a release-named state dict, per parameter (docs/architecture.md §10)."""
    e = {("embed", "embedding"): sd[P + "embed_tokens.weight"], ("norm", "weight"): sd[P + "norm.weight"],
         ("lm_head", "kernel"): sd["lm_head.weight"].T}  # fmt: skip
    for i in range(cfg.num_hidden_layers + (1 if mtp else 0)):
        pre = f"{P}layers.{i}."
        base = ("layers", i) if i < cfg.num_hidden_layers else ("mtp",)
        put = lambda path, v: e.__setitem__(base + tuple(path.split(".")), v)  # noqa: B023
        for n in ("input_layernorm", "post_attention_layernorm"):
            put(f"{n}.weight", sd[pre + n + ".weight"])
        if i < cfg.num_hidden_layers:
            for s in ("attn", "ffn"):
                put(f"{s}_hc.fn", sd[pre + f"hc_{s}_fn"].T)
                put(f"{s}_hc.base", sd[pre + f"hc_{s}_base"])
                put(f"{s}_hc.scale", sd[pre + f"hc_{s}_scale"])
        else:
            put("eh_proj.kernel", sd[pre + "eh_proj.weight"].T)
            for n in ("enorm", "hnorm"):
                put(f"{n}.weight", sd[pre + n + ".weight"])
            put("shared_head_norm.weight", sd[pre + "shared_head.norm.weight"])
        a = pre + "self_attn."
        if i < cfg.num_hidden_layers and cfg.layer_types[i] == "kda":
            for n in (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "b_proj",
                "g_a_proj",
                "g_b_proj",
                "f_a_proj",
                "f_b_proj",
            ):
                put(f"self_attn.{n}.kernel", sd[a + n + ".weight"].T)
            for x in "qkv":
                put(f"self_attn.{x}_conv.weight", sd[a + f"{x}_conv1d.weight"][:, 0, :].T)
            for n in ("dt_bias", "A_log"):
                put(f"self_attn.{n}", sd[a + n])
            put("self_attn.o_norm.weight", sd[a + "o_norm.weight"])
        else:
            for n in ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"):
                put(f"self_attn.{n}.kernel", sd[a + n + ".weight"].T)
            put("self_attn.kv_a_proj.kernel", sd[a + "kv_a_proj_with_mqa.weight"].T)
            for n in ("q_a_layernorm", "kv_a_layernorm"):
                put(f"self_attn.{n}.weight", sd[a + n + ".weight"])
            ix = a + "indexer."
            for n in ("wq_b", "wk", "weights_proj"):
                put(f"self_attn.indexer.{n}.kernel", sd[ix + n + ".weight"].T)
            put("self_attn.indexer.k_norm.weight", sd[ix + "k_norm.weight"])
            put("self_attn.indexer.k_norm.bias", sd[ix + "k_norm.bias"])
            put("self_attn.indexer.compress_gate", sd[ix + "index_kpool_compress_gate"].T)
            put("self_attn.indexer.compress_ape", sd[ix + "index_kpool_compress_ape"])
        m = pre + "mlp."
        if i < cfg.num_hidden_layers and cfg.mlp_layer_types[i] == "dense":
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(f"mlp.{n}.kernel", sd[m + n + ".weight"].T)
        else:
            put("mlp.router.kernel", sd[m + "gate.weight"].T)
            put("mlp.router.e_score_correction_bias", sd[m + "gate.e_score_correction_bias"])
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(f"mlp.shared_experts.{n}.kernel", sd[m + f"shared_experts.{n}.weight"].T)
                put(f"mlp.experts.{n}", np.stack([sd[m + f"experts.{x}.{n}.weight"].T
                                                  for x in range(cfg.n_routed_experts)]))  # fmt: skip
    return {tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in k): v for k, v in e.items()}


_logits = nnx.jit(lambda model, ids: model(ids)[0])


def model_params(model) -> dict[tuple, object]:
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_params_equal(model, expected, rtol=0.0, atol=0.0):
    got = model_params(model)
    assert set(got) == set(expected), sorted(set(got) ^ set(expected), key=str)
    for path, want in expected.items():
        np.testing.assert_allclose(
            np.asarray(got[path], np.float32), want, rtol=rtol, atol=atol, err_msg=str(path)
        )


def write_shards(folder, tensors: dict[str, torch.Tensor], n_files: int, config: dict):
    """Writes tensors round-robin over n_files (sorted keys: a weight and its scale land in different files,
    one layer's experts in all of them) with an index, plus config.json."""
    os.makedirs(folder, exist_ok=True)
    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: tensors[k].contiguous() for k in keys[i::n_files]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The torch model, its release-named folder (+ MTP shard) and its tensors."""
    m = torch_model(TINY, 0)
    folder = tmp_path_factory.mktemp("tiny")
    m.save_pretrained(folder, max_shard_size="100KB")  # many shards; experts of a layer spread over several
    mtp = mtp_tensors(TINY, 5)
    save_file(mtp, os.path.join(folder, "mtp.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return m, folder, read_folder(folder)


@pytest.fixture(scope="module")
def loaded(tiny):
    _, folder, _ = tiny
    return load_hf_checkpoint(folder, TINY, dtype=jnp.float32)


# ------------------------------------------------------------------------------------------------ tests
def test_rule_table_covers_every_parameter(tiny):
    """Every release key maps to exactly the parameters of the abstract model, each once (MTP included)."""
    _, _, sd = tiny
    abstract = nnx.eval_shape(lambda: Glm53Model(TINY, rngs=nnx.Rngs(0)))
    want = set(model_params(abstract))
    got, ignored = [], []
    for k, v in sd.items():
        if k.endswith("_scale_inv"):
            continue
        c = classify(k, TINY.num_hidden_layers, 1)
        if isinstance(c, Mapped):
            got.extend(p.path for p in c.apply(v))
        else:
            ignored.append(k)
    by_path = {}
    for p in got:
        by_path[p] = by_path.get(p, 0) + 1
    assert set(by_path) == want
    experts = {p: n for p, n in by_path.items() if p[-2] == "experts"}
    assert set(experts.values()) == {TINY.n_routed_experts} and all(
        n == 1 for p, n in by_path.items() if p not in experts
    )
    assert all(".visual." in k or "embed_tokens" in k or "shared_head.head" in k for k in ignored)


def test_key_prefixes_and_ignored_keys():
    n = TINY.num_hidden_layers
    for key in (
        "model.language_model.layers.2.self_attn.q_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "layers.2.self_attn.q_proj.weight",
        "language_model.model.layers.2.self_attn.q_proj.weight",
    ):
        c = classify(key, n, 1)
        assert isinstance(c, Mapped) and c.apply(np.zeros((32, 64)))[0].path == ("layers", 2, "self_attn", "q_proj",
                                                                                 "kernel"), key  # fmt: skip
    for key in ("lm_head.weight", "language_model.lm_head.weight"):
        assert classify(key, n, 1).apply(np.zeros((128, 64)))[0].path == ("lm_head", "kernel")
    assert classify(f"model.layers.{n}.eh_proj.weight", n, 1).apply(np.zeros((64, 128)))[0].path == (
        "mtp", "eh_proj", "kernel")  # fmt: skip
    assert "without one" in classify(f"model.layers.{n}.eh_proj.weight", n, 0).reason
    assert "copy" in classify(f"model.layers.{n}.shared_head.head.weight", n, 1).reason
    assert "neither" in classify(f"model.layers.{n + 1}.eh_proj.weight", n, 1).reason
    assert "no rule" in classify("model.layers.1.eh_proj.weight", n, 1).reason  # MTP-only name in the trunk
    assert "vision" in classify("model.visual.blocks.0.attn.qkv.weight", n, 1).reason


def test_release_names_sharded_equal_torch(tiny, loaded):
    _, folder, sd = tiny
    model, report = loaded
    assert_params_equal(model, expected_params(sd, TINY))
    assert len(report.files) > 5 and report.ignored["vision tower (not part of the text port)"] > 0
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    files = {
        wm[f"{P}layers.3.mlp.experts.{e}.{n}.weight"] for e in range(8) for n in ("gate_proj", "down_proj")
    }
    assert len(files) > 1  # the experts of one layer really were spread over several shards


def test_logits_match_transformers(tiny, loaded):
    m, _, _ = tiny
    model, _ = loaded
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        want = m(torch.tensor(ids)).logits.numpy()
    got = _logits(model, jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)


def test_fused_transformers_names_equal_torch(tiny, tmp_path):
    m, _, sd = tiny
    m.save_pretrained(tmp_path, save_original_format=False)
    names = set(read_folder(tmp_path))
    assert (
        f"{P}layers.3.mlp.experts.gate_up_proj" in names and f"{P}layers.0.self_attn.conv1d.weight" in names
    )
    assert f"{P}layers.0.attn_hc.fn" in names and f"{P}layers.0.self_attn.forget_gate.A_log" in names
    model, _ = load_hf_checkpoint(tmp_path, TINY, dtype=jnp.float32, with_mtp=False)
    assert_params_equal(model, expected_params(sd, TINY, mtp=False))


def test_bf16_folder_and_mtp_handling(tiny, tmp_path):
    m, _, _ = tiny
    m.to(torch.bfloat16).save_pretrained(tmp_path)
    m.to(torch.float32)
    sd = read_folder(tmp_path)  # bf16 values upcast exactly
    model, _ = load_hf_checkpoint(tmp_path, TINY, dtype=jnp.bfloat16, with_mtp=False)
    params = model_params(model)
    assert np.asarray(params[("lm_head", "kernel")]).dtype == ml_dtypes.bfloat16
    assert (
        np.asarray(params[("layers", 3, "mlp", "router", "kernel")]).dtype == np.float32
    )  # the model keeps f32
    assert_params_equal(model, expected_params(sd, TINY, mtp=False))
    # No MTP block in transformers' save: by default (auto) the model is built without one; requiring it is one
    # CheckpointError; a model built with one reports every MTP parameter missing, with the remedy.
    auto, _ = load_hf_checkpoint(tmp_path, TINY, dtype=jnp.bfloat16)
    assert auto.mtp is None
    assert_params_equal(auto, expected_params(sd, TINY, mtp=False))
    with pytest.raises(CheckpointError, match="no MTP block") as err:
        load_hf_checkpoint(tmp_path, TINY, dtype=jnp.bfloat16, with_mtp=True)
    assert len(err.value.problems) == 1 and str(tmp_path) in str(err.value)
    abstract = nnx.eval_shape(lambda: Glm53Model(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(tmp_path, abstract, TINY)
    missing = [p for p in err.value.problems if p.startswith("missing: mtp.")]
    assert len(missing) == len(err.value.problems) > 20
    assert "--mtp=auto" in missing[0]


def test_save_pretrained_folder_without_mtp_loads_everywhere(tiny, tmp_path):
    """score / generate (`build.load_model`) and the GGUF converter take a transformers folder (no MTP block):
    auto leaves the block out, on is a CheckpointError, off leaves it out of a GGUF that has one."""
    m, _, sd = tiny
    hf = tmp_path / "hf"
    m.save_pretrained(hf)
    cfg, model = build.load_model(str(hf), dtype=jnp.float32)
    assert model.mtp is None
    with pytest.raises(CheckpointError, match="no MTP block"):
        build.load_model(str(hf), with_mtp=True)
    gguf_path = str(tmp_path / "m.gguf")
    gguf_export.convert_hf_to_gguf(str(hf), gguf_path)
    _, from_gguf = build.load_model(gguf_path, dtype=jnp.float32)
    assert from_gguf.mtp is None
    assert (
        set(model_params(from_gguf)) == set(model_params(model)) == set(expected_params(sd, TINY, mtp=False))
    )
    with pytest.raises(CheckpointError, match="no MTP block"):
        gguf_ckpt.load_gguf_model(gguf_path, with_mtp=True)


# ------------------------------------------------------------------------------------------------ FP8
NOT_CONVERT = ["lm_head", "model.language_model.embed_tokens", "mlp.gate", "b_proj", "indexer.weights_proj"]


def _quantize_fp8(w: torch.Tensor, block=128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per 128x128 block (scale = amax / 448), ragged edge blocks included."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    pad = torch.zeros(nr * block, nc * block)
    pad[:rows, :cols] = w
    blocks = pad.reshape(nr, block, nc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [nr, nc]
    q = (
        (blocks / scale[:, None, :, None])
        .to(torch.float8_e4m3fn)
        .reshape(nr * block, nc * block)[:rows, :cols]
    )
    return q.contiguous(), scale.float()


def _torch_dequant(q: torch.Tensor, scale: torch.Tensor, block=128) -> np.ndarray:
    rows, cols = q.shape
    s = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (q.float() * s).numpy()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """An FP8 release-style folder (per-expert names, MTP, 3 shards, weights and scales in different shards) and
    the release-named tensors a loader should produce (dequantized by torch)."""
    m = torch_model(FP8CFG, 1)
    src = tmp_path_factory.mktemp("fp8src")
    m.save_pretrained(src)
    tensors = {k: torch.from_numpy(v) for k, v in read_folder(src).items() if ".visual." not in k}
    tensors.update(mtp_tensors(FP8CFG, 2))
    out, ref = {}, {}
    for k, t in tensors.items():
        module = k[: -len(".weight")]
        quantize = (k.endswith(".weight") and t.ndim == 2 and "norm" not in k and "embed_tokens" not in k
                    and not any(module.endswith(x) for x in NOT_CONVERT))  # fmt: skip
        if quantize:
            q, s = _quantize_fp8(t)
            out[k], out[k + "_scale_inv"] = q, s
            ref[k] = _torch_dequant(q, s)
        else:
            t = t.to(torch.bfloat16) if t.ndim >= 2 else t  # modules_to_not_convert arrive in bf16
            out[k] = t
            ref[k] = t.float().numpy()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": NOT_CONVERT}  # fmt: skip
    folder = tmp_path_factory.mktemp("fp8")
    write_shards(folder, out, 3, config)
    return folder, out, ref


def test_fp8_folder_equals_torch_dequantization(fp8):
    folder, out, ref = fp8
    # The MTP block's copy of the head is FP8 too, but ignored (with its scale) like its embedding copy.
    n_fp8 = sum(1 for k, t in out.items() if t.dtype == torch.float8_e4m3fn and "shared_head.head" not in k)
    assert n_fp8 > 40 and any(
        s.shape[0] > 1 and s.shape[1] > 1 for k, s in out.items() if k.endswith("_scale_inv")
    )
    model, report = load_hf_checkpoint(folder, FP8CFG, dtype=jnp.float32)
    assert report.fp8_dequantized == n_fp8 and len(report.files) == 3
    assert report.ignored == {"MTP copy of the trunk embedding / lm_head (the trunk's are used)": 3}
    assert_params_equal(model, expected_params(ref, FP8CFG))  # bitwise: one f32 product each


def test_fp8_problems_reported(fp8, tmp_path):
    folder, out, _ = fp8
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    bad = dict(out)
    w = f"{P}layers.3.mlp.experts.5.up_proj.weight"
    del bad[w + "_scale_inv"]  # FP8 weight without its scale
    lm = "lm_head.weight"
    bad[lm], bad[lm + "_scale_inv"] = _quantize_fp8(out[lm].float())  # a not-convert module stored as FP8
    s = f"{P}layers.0.self_attn.q_proj.weight_scale_inv"
    bad[s] = bad[s][:, :1].contiguous()  # wrong scale shape
    write_shards(tmp_path, bad, 2, config)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path, FP8CFG, dtype=jnp.float32)
    probs = err.value.problems
    assert any(p.startswith(f"fp8: {w} ") and "without a weight_scale_inv" in p for p in probs)
    assert any(p.startswith(f"dtype: {lm} ") and "modules_to_not_convert" in p for p in probs)
    assert any(
        p.startswith(f"shape: {s[: -len('_scale_inv')]} ") and "weight_scale_inv shape" in p for p in probs
    )
    # Consequences are reported too: the parameters those tensors should have filled are missing.
    assert any(
        p.startswith("missing: layers.3.mlp.experts.up_proj") and "experts 5 missing" in p for p in probs
    )
    assert any(p.startswith("missing: lm_head.kernel") for p in probs)
    assert any(p.startswith("missing: layers.0.self_attn.q_proj.kernel") for p in probs)
    assert len(probs) == 6


# ------------------------------------------------------------------------------------------------ errors
def test_all_problems_in_one_error(tiny, tmp_path):
    """Missing, unexpected, wrong shape, unsupported dtype, incomplete experts, truncated shard: one error."""
    _, _, sd = tiny
    t = {k: torch.from_numpy(v.copy()) for k, v in sd.items() if ".visual." not in k}
    del t[f"{P}layers.1.self_attn.g_b_proj.weight"]
    del t[f"{P}layers.3.mlp.experts.6.down_proj.weight"]
    t[f"{P}layers.0.self_attn.bogus.weight"] = torch.zeros(2, 2)
    t[f"{P}layers.0.self_attn.q_proj.weight"] = t[f"{P}layers.0.self_attn.q_proj.weight"].T.contiguous()
    t[f"{P}layers.2.self_attn.A_log"] = torch.tensor([1, 2], dtype=torch.int32)
    t[f"{P}layers.0.self_attn.q_a_proj.weight"] = torch.zeros(48, 64)  # DSA weight in a KDA layer
    convs = [t[f"{P}layers.1.self_attn.{x}_conv1d.weight"] for x in "qkv"]
    t[f"{P}layers.1.self_attn.conv1d.weight"] = torch.cat(convs)  # fused copy of the separate convs
    cut = {k: t.pop(k) for k in [f"{P}layers.{i}.input_layernorm.weight" for i in range(3)]}
    write_shards(tmp_path, t, 3, {})
    # A fourth shard, its last tensor cut short.
    last = os.path.join(tmp_path, "model-cut.safetensors")
    save_file(cut, last)
    with open(os.path.join(tmp_path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(cut, "model-cut.safetensors"))
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 100)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path, TINY, dtype=jnp.float32)
    probs = err.value.problems
    text = str(err.value)

    def has(prefix, *parts):
        return any(p.startswith(prefix) and all(x in p for x in parts) for p in probs)

    assert has("missing: layers.1.self_attn.g_b_proj.kernel", "[16, 32]")
    assert has("missing: layers.3.mlp.experts.down_proj", "experts 6 missing")
    assert has(f"unexpected: {P}layers.0.self_attn.bogus.weight", "no rule")
    assert has(f"unexpected: {P}layers.0.self_attn.q_a_proj.weight", "'layers.0.self_attn.q_a_proj.kernel'")
    assert has(f"shape: {P}layers.0.self_attn.q_proj.weight", "(64, 32)", "model expects (64, 32)")
    assert has(f"dtype: {P}layers.2.self_attn.A_log", "unsupported dtype I32")
    # The cut shard is rejected whole, as the safetensors library rejects it: one problem names the file and
    # its first tensor past the cut, and every parameter the shard held is missing.
    (lost,) = [p for p in probs if p.startswith("file: ")]
    assert (
        "model-cut.safetensors" in lost
        and "truncated" in lost
        and f"tensor '{P}layers.2.input_layernorm" in lost
    )
    assert all(has(f"missing: layers.{i}.input_layernorm.weight") for i in range(3))
    # missing = the two deleted tensors + the two rejected ones (shape, dtype) + the cut shard's.
    assert sum(p.startswith("missing: ") for p in probs) == len(cut) + 4
    assert (
        sum(has("duplicate: ", f"'layers.1.self_attn.{x}_conv.weight' was already loaded") for x in "qkv")
        == 3
    )
    assert len({p.split(":")[0] for p in probs}) == 6 and text.startswith(f"HF checkpoint {tmp_path}")


def test_corrupt_files_name_file_and_tensor(tmp_path):
    good = tmp_path / "good"
    save_file({"model.language_model.norm.weight": torch.ones(64)}, str(tmp_path / "x.safetensors"))
    raw = (tmp_path / "x.safetensors").read_bytes()
    os.makedirs(good)
    cases = {
        "truncated": raw[:-8],
        "bad_header": raw[:8] + b"{not json" + raw[17:],
        "header_too_long": (10**9).to_bytes(8, "little") + raw[8:],
        "tiny": b"abc",
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(CheckpointError, match=str(p)) as err:
            SafetensorsFile(p).read("model.language_model.norm.weight")
        if name == "truncated":
            assert "tensor 'model.language_model.norm.weight'" in str(err.value) and "truncated" in str(
                err.value
            )
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_hf_checkpoint(good, TINY)


def test_safetensors_verdict_is_the_librarys(tmp_path):
    """Two tensors aliasing the same bytes, or a file cut inside a tensor nobody reads: the safetensors
    library rejects the file, and so do we (naming the file, and the tensor where there is one)."""
    import safetensors

    def raw(header: dict, data: bytes) -> bytes:
        h = json.dumps(header).encode()
        return len(h).to_bytes(8, "little") + h + data

    f32 = lambda begin: {"dtype": "F32", "shape": [2], "data_offsets": [begin, begin + 8]}
    data = np.arange(4, dtype=np.float32).tobytes()
    cases = {
        "aliased": (raw({"a": f32(0), "b": f32(0)}, data[:8]), "tensor '"),
        "gap": (raw({"a": f32(0), "b": f32(12)}, data + data[:4]), "tensor 'b'"),
        "cut_in_unread_tensor": (raw({"a": f32(0), "b": f32(8)}, data[:12]), "tensor 'b'"),
        "trailing_bytes": (raw({"a": f32(0), "b": f32(8)}, data + b"\0"), "not a valid safetensors file"),
    }
    for name, (content, names) in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(content)
        with pytest.raises(safetensors.SafetensorError):
            safe_open(str(p), framework="numpy")
        with pytest.raises(CheckpointError, match=str(p)) as err:
            SafetensorsFile(p)
        assert names in str(err.value), str(err.value)
    # The same tensors, well formed (in any header order): read as the library reads them, bf16 and fp8 too.
    p = tmp_path / "ok.safetensors"
    bf16 = {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}
    fp8 = {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [20, 21]}
    p.write_bytes(raw({"b": f32(8), "a": f32(0), "h": bf16, "q": fp8}, data + data[:5]))
    f = SafetensorsFile(p)
    lib = dict(safetensors.deserialize(p.read_bytes()))
    for k in "abhq":
        got = f.read(k)
        assert got.dtype.name == {"a": "float32", "b": "float32", "h": "bfloat16", "q": "float8_e4m3fn"}[k]
        assert got.tobytes() == bytes(lib[k]["data"]) and list(got.shape) == lib[k]["shape"]


# ------------------------------------------------------------------------------------------------ int8
def test_int8_storage(tiny):
    m, folder, sd = tiny
    model8, report = load_hf_checkpoint(folder, TINY, dtype=jnp.float32, int8=True, int8_min_size=2048)
    want = expected_params(sd, TINY)
    q = {p: v for p, v in model_params(model8).items() if isinstance(v, Int8Weight)}
    assert report.int8_params == len(q) > 20
    assert ("lm_head", "kernel") in q and ("layers", 3, "self_attn", "kv_b_proj", "kernel") in q
    assert not any("router" in p or "experts" in p or "embed" in p for p in q)
    for p, v in q.items():
        w = want[p]
        step = np.abs(w).max(axis=0) / 127.0  # per output column
        assert np.asarray(v.values).dtype == np.int8
        assert np.all(np.abs(np.asarray(v.dequantize()) - w) <= step / 2 + 1e-7), p
    # Linear's int8 path (x @ values * scale) against an f64 product with the dequantized kernel.
    x = np.random.default_rng(2).normal(size=(3, 64))
    head = q[("lm_head", "kernel")]
    got = np.asarray(model8.lm_head(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, x @ np.asarray(head.dequantize(), np.float64), rtol=1e-5, atol=1e-5)
    # The whole model runs with int8 kernels (kv_b_proj is read directly by DSA) and stays near transformers.
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, (1, 10))
    with torch.no_grad():
        ref = m(torch.tensor(ids)).logits.numpy()
    out = _logits(model8, jnp.asarray(ids, jnp.int32))
    rel = np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref)
    assert 1e-5 < rel < 0.05, rel
