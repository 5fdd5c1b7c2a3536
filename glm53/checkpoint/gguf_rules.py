"""glm53 parameter path <-> llama.cpp GGUF tensor name, the layout transform each way, and the GGUF metadata
keys of a GLM-5.3 model (architecture `glm5-next`, later mainline `glm5next`): docs/architecture.md §10.

Used by the GGUF loader (GGUF -> params, `from_gguf`) and the GGUF writer (params -> GGUF, `to_gguf`), so the
two directions cannot drift apart. Shapes below are numpy order (GGUF `ne` reversed).

Layouts (ours -> GGUF):
  * LINEAR   kernel [in, out]        -> [out, in] (HF layout; ggml {in, out})
  * SAME     vectors, embedding [V, D], KPool ape [kpool, c] as they are
  * CONV     short-conv weight [K, C] -> [1, C, 1, K] (ggml {K, 1, C, 1}; [C, 1, K] is accepted on load)
  * EXPERTS  [E, in, out]            -> [E, out, in] (ggml {in, out, E}: each row one output channel)
  * SSM_A    A_log [H]               -> -exp(A_log)  (llama.cpp stores the decay rate itself)
  * KV_B     kv_b_proj [L, H*(n+v)]  -> attn_k_b [H, L, n] (K part transposed) + attn_v_b [H, v, L]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from glm53.config import ConfigError, ModelConfig
from glm53.layers.param import Path

ARCHITECTURES = ("glm5-next", "glm5next")
DEFAULT_ARCH = "glm5-next"

SAME, LINEAR, CONV, EXPERTS, SSM_A, KV_B = "same", "linear", "conv", "experts", "ssm_a", "kv_b"

# Our path relative to a decoder layer (or the MTP block) -> (GGUF names relative to ``blk.N.``, layout).
LAYER_TENSORS: dict[str, tuple[tuple[str, ...], str]] = {
    "attn_hc.fn": (("hc_attn_fn.weight",), LINEAR),
    "attn_hc.base": (("hc_attn_base.weight",), SAME),
    "attn_hc.scale": (("hc_attn_scale.weight",), SAME),
    "ffn_hc.fn": (("hc_ffn_fn.weight",), LINEAR),
    "ffn_hc.base": (("hc_ffn_base.weight",), SAME),
    "ffn_hc.scale": (("hc_ffn_scale.weight",), SAME),
    "input_layernorm.weight": (("attn_norm.weight",), SAME),
    "post_attention_layernorm.weight": (("ffn_norm.weight",), SAME),
    # KDA.
    "self_attn.q_proj.kernel": (("attn_q.weight",), LINEAR),
    "self_attn.k_proj.kernel": (("attn_k.weight",), LINEAR),
    "self_attn.v_proj.kernel": (("attn_v.weight",), LINEAR),
    "self_attn.q_conv.weight": (("ssm_conv1d_q.weight",), CONV),
    "self_attn.k_conv.weight": (("ssm_conv1d_k.weight",), CONV),
    "self_attn.v_conv.weight": (("ssm_conv1d_v.weight",), CONV),
    "self_attn.f_a_proj.kernel": (("ssm_f_a.weight",), LINEAR),
    "self_attn.f_b_proj.kernel": (("ssm_f_b.weight",), LINEAR),
    "self_attn.b_proj.kernel": (("ssm_beta.weight",), LINEAR),
    "self_attn.A_log": (("ssm_a",), SSM_A),
    "self_attn.dt_bias": (("ssm_dt.bias",), SAME),
    "self_attn.g_a_proj.kernel": (("ssm_g_a.weight",), LINEAR),
    "self_attn.g_b_proj.kernel": (("ssm_g_b.weight",), LINEAR),
    "self_attn.o_norm.weight": (("ssm_norm.weight",), SAME),
    "self_attn.o_proj.kernel": (("attn_output.weight",), LINEAR),  # KDA and DSA alike
    # DSA (NoPE MLA) and its indexer.
    "self_attn.q_a_proj.kernel": (("attn_q_a.weight",), LINEAR),
    "self_attn.q_a_layernorm.weight": (("attn_q_a_norm.weight",), SAME),
    "self_attn.q_b_proj.kernel": (("attn_q_b.weight",), LINEAR),
    "self_attn.kv_a_proj.kernel": (("attn_kv_a_mqa.weight",), LINEAR),
    "self_attn.kv_a_layernorm.weight": (("attn_kv_a_norm.weight",), SAME),
    "self_attn.kv_b_proj.kernel": (("attn_k_b.weight", "attn_v_b.weight"), KV_B),
    "self_attn.indexer.wq_b.kernel": (("indexer.attn_q_b.weight",), LINEAR),
    "self_attn.indexer.wk.kernel": (("indexer.attn_k.weight",), LINEAR),
    "self_attn.indexer.k_norm.weight": (("indexer.k_norm.weight",), SAME),
    "self_attn.indexer.k_norm.bias": (("indexer.k_norm.bias",), SAME),
    "self_attn.indexer.weights_proj.kernel": (("indexer.proj.weight",), LINEAR),
    "self_attn.indexer.compress_gate": (("indexer_compressor_gate.weight",), LINEAR),
    "self_attn.indexer.compress_ape": (("indexer_compressor_ape.weight",), SAME),
    # Dense FFN, router, shared expert, routed experts.
    "mlp.gate_proj.kernel": (("ffn_gate.weight",), LINEAR),
    "mlp.up_proj.kernel": (("ffn_up.weight",), LINEAR),
    "mlp.down_proj.kernel": (("ffn_down.weight",), LINEAR),
    "mlp.router.kernel": (("ffn_gate_inp.weight",), LINEAR),
    "mlp.router.e_score_correction_bias": (("exp_probs_b.bias",), SAME),
    "mlp.shared_experts.gate_proj.kernel": (("ffn_gate_shexp.weight",), LINEAR),
    "mlp.shared_experts.up_proj.kernel": (("ffn_up_shexp.weight",), LINEAR),
    "mlp.shared_experts.down_proj.kernel": (("ffn_down_shexp.weight",), LINEAR),
    "mlp.experts.gate_proj": (("ffn_gate_exps.weight",), EXPERTS),
    "mlp.experts.up_proj": (("ffn_up_exps.weight",), EXPERTS),
    "mlp.experts.down_proj": (("ffn_down_exps.weight",), EXPERTS),
    # MTP fusion (the MTP block only).
    "eh_proj.kernel": (("nextn.eh_proj.weight",), LINEAR),
    "enorm.weight": (("nextn.enorm.weight",), SAME),
    "hnorm.weight": (("nextn.hnorm.weight",), SAME),
    "shared_head_norm.weight": (("nextn.shared_head_norm.weight",), SAME),
}

MODEL_TENSORS: dict[str, tuple[tuple[str, ...], str]] = {
    "embed.embedding": (("token_embd.weight",), SAME),
    "norm.weight": (("output_norm.weight",), SAME),
    "lm_head.kernel": (("output.weight",), LINEAR),
}

# MTP copies of the trunk's embedding / head (llama.cpp: not required); the model shares the trunk's.
MTP_IGNORED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")

# Tensors the converter keeps in F32 whatever the output type (small gating / mHC parameters).
_EXACT_F32 = ("hc_attn_", "hc_ffn_", "indexer_compressor_", "ssm_a", "ssm_dt", "exp_probs_b")


@dataclasses.dataclass(frozen=True)
class Target:
    """One parameter and the GGUF tensor(s) holding it (numpy-order `shapes`, one per name)."""

    path: Path
    names: tuple[str, ...]
    kind: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def is_expert(self) -> bool:
        return self.kind == EXPERTS

    @property
    def matrix(self) -> str:
        """The matrix of a routed-expert target: "gate", "up" or "down"."""
        return str(self.path[-1]).removesuffix("_proj")


def block_prefix(path: Path, cfg: ModelConfig) -> tuple[str, str] | None:
    """(GGUF name prefix, path relative to the block) of a parameter path; None for model-level params."""
    if path[0] == "layers":
        return f"blk.{path[1]}.", ".".join(str(p) for p in path[2:])
    if path[0] == "mtp":
        return f"blk.{cfg.num_hidden_layers}.", ".".join(str(p) for p in path[1:])
    return None


def target_for(path: Path, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    """The GGUF name(s) and layout of the parameter at `path` (our `shape`); KeyError if it has none."""
    bp = block_prefix(path, cfg)
    if bp is None:
        prefix, rel = "", ".".join(str(p) for p in path)
        names, kind = MODEL_TENSORS[rel]
    else:
        prefix, rel = bp
        names, kind = LAYER_TENSORS[rel]
    return Target(path, tuple(prefix + n for n in names), kind, gguf_shapes(kind, tuple(shape), cfg))


def gguf_shapes(kind: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The numpy-order GGUF shape(s) of a parameter of our `shape` stored with layout `kind`."""
    if kind in (SAME, SSM_A):
        return (shape,)
    if kind == LINEAR:
        return (shape[::-1],)
    if kind == CONV:
        k, c = shape
        return ((1, c, 1, k),)
    if kind == EXPERTS:
        e, a, b = shape
        return ((e, b, a),)
    if kind == KV_B:
        h, n, v, lat = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        return ((h, lat, n), (h, v, lat))
    raise ValueError(f"unknown layout {kind!r}")


def shape_ok(kind: str, got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether a stored GGUF shape is acceptable for the expected one (CONV also takes [C, 1, K])."""
    if tuple(got) == tuple(want):
        return True
    return kind == CONV and tuple(got) == (want[1], 1, want[3])


def from_gguf(kind: str, arrays: list[np.ndarray]) -> np.ndarray:
    """GGUF tensor value(s) (numpy order, float) -> our layout."""
    a = arrays[0]
    if kind == SAME:
        return a
    if kind == LINEAR:
        return a.T
    if kind == CONV:
        return a.reshape(-1, a.shape[-1]).T  # [1, C, 1, K] or [C, 1, K] -> [K, C]
    if kind == EXPERTS:
        return a.transpose(0, 2, 1)
    if kind == SSM_A:
        if not np.all(a < 0):
            raise ValueError(
                f"ssm_a must be negative (it stores -exp(A_log)), got values in [{a.min()}, {a.max()}]"
            )
        return np.log(-a.astype(np.float64)).astype(np.float32)
    if kind == KV_B:
        k_b, v_b = arrays  # [H, L, n], [H, v, L]
        w = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, n+v, L] (HF kv_b_proj rows per head)
        return w.reshape(-1, w.shape[-1]).T
    raise ValueError(f"unknown layout {kind!r}")


def to_gguf(kind: str, value: np.ndarray, cfg: ModelConfig) -> list[np.ndarray]:
    """Our parameter value -> the GGUF tensor value(s), numpy order, as the llama.cpp converter writes them."""
    a = np.asarray(value)
    if kind == SAME:
        return [a]
    if kind == LINEAR:
        return [np.ascontiguousarray(a.T)]
    if kind == CONV:
        k, c = a.shape
        return [np.ascontiguousarray(a.T).reshape(1, c, 1, k)]
    if kind == EXPERTS:
        return [np.ascontiguousarray(a.transpose(0, 2, 1))]
    if kind == SSM_A:
        return [-np.exp(a.astype(np.float32))]
    if kind == KV_B:
        h, n = cfg.num_attention_heads, cfg.qk_nope_head_dim
        w = a.T.reshape(h, -1, a.shape[0])  # [H, n+v, L]
        return [np.ascontiguousarray(w[:, :n].transpose(0, 2, 1)), np.ascontiguousarray(w[:, n:])]
    raise ValueError(f"unknown layout {kind!r}")


def keep_f32(name: str, ndim: int) -> bool:
    """Tensors the converter always stores as F32: vectors and the small gating / mHC parameters."""
    return ndim <= 1 or any(k in name for k in _EXACT_F32)


# ------------------------------------------------------------------------------------------------- metadata
U32, F32, BOOL, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                            GGUFValueType.STRING, GGUFValueType.ARRAY)  # fmt: skip


def leading_dense(cfg: ModelConfig) -> int:
    """How many leading layers are dense; GGUF can only express dense-then-MoE schedules."""
    k = sum(1 for t in cfg.mlp_layer_types if t == "dense")
    if cfg.mlp_layer_types != ("dense",) * k + ("moe",) * (cfg.num_hidden_layers - k):
        raise ConfigError(
            f"config field 'mlp_layer_types': GGUF needs dense layers first, got {cfg.mlp_layer_types}"
        )
    return k


def metadata_from_config(cfg: ModelConfig, *, with_mtp: bool) -> list[tuple[str, Any, GGUFValueType]]:
    """The GGUF key/values of `cfg` (keys without the ``ARCH.`` prefix), as llama.cpp's converter writes them."""
    if cfg.linear_num_heads != cfg.num_attention_heads:
        raise ConfigError(f"config field 'linear_num_heads': GGUF has one head count; {cfg.linear_num_heads} KDA "
                          f"heads != {cfg.num_attention_heads} MLA heads")  # fmt: skip
    nextn = cfg.num_nextn_predict_layers if with_mtp else 0
    blocks = cfg.num_hidden_layers + nextn
    kv_heads = [0 if t == "kda" else 1 for t in cfg.layer_types] + [1] * nextn
    kv = [
        ("block_count", blocks, U32),
        ("context_length", cfg.max_position_embeddings, U32),
        ("embedding_length", cfg.hidden_size, U32),
        ("feed_forward_length", cfg.intermediate_size, U32),
        ("attention.head_count", cfg.num_attention_heads, U32),
        ("attention.head_count_kv", kv_heads, ARR),
        ("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, F32),
        ("expert_count", cfg.n_routed_experts, U32),
        ("expert_used_count", cfg.num_experts_per_tok, U32),
        ("expert_group_count", cfg.n_group, U32),
        ("expert_group_used_count", cfg.topk_group, U32),
        ("vocab_size", cfg.vocab_size, U32),
        ("attention.layer_norm_epsilon", cfg.index_norm_eps, F32),
    ]
    if nextn:
        kv.append(("nextn_predict_layers", nextn, U32))
    kv += [
        ("ssm.conv_kernel", cfg.linear_conv_kernel_dim, U32),
        ("kda.head_dim", cfg.linear_head_dim, U32),
        ("kda.gate_lower_bound", cfg.linear_lower_bound, F32),
        ("attention.q_lora_rank", cfg.q_lora_rank, U32),
        ("attention.kv_lora_rank", cfg.kv_lora_rank, U32),
        ("rope.dimension_count", 0, U32),
        ("attention.key_length", cfg.kv_lora_rank, U32),
        ("attention.value_length", cfg.kv_lora_rank, U32),
        ("attention.key_length_mla", cfg.qk_nope_head_dim, U32),
        ("attention.value_length_mla", cfg.v_head_dim, U32),
        ("attention.indexer.head_count", cfg.index_n_heads, U32),
        ("attention.indexer.key_length", cfg.index_head_dim, U32),
        ("attention.indexer.top_k", cfg.index_topk, U32),
        ("attention.indexer.kpool", cfg.index_kpool, U32),
        ("attention.indexer.kpool_select_tail", cfg.index_kpool_always_select_tail, BOOL),
        ("attention.indexer.types", [t == "full" for t in cfg.indexer_types], ARR),
        ("hyper_connection.count", cfg.hc_mult, U32),
        ("hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters, U32),
        ("hyper_connection.epsilon", cfg.hc_eps, F32),
        ("leading_dense_block_count", leading_dense(cfg), U32),
        ("expert_feed_forward_length", cfg.moe_intermediate_size, U32),
        ("expert_shared_count", cfg.n_shared_experts, U32),
        ("expert_weights_scale", cfg.routed_scaling_factor, F32),
        ("expert_weights_norm", cfg.norm_topk_prob, BOOL),
        ("swiglu_clamp_exp", [float(cfg.swiglu_limit)] * blocks, ARR),
        ("swiglu_clamp_shexp", [float(cfg.swiglu_limit)] * blocks, ARR),
    ]
    return kv


_RELEASE_EOS = ModelConfig.__dataclass_fields__["eos_token_ids"].default
_RELEASE_PAD = ModelConfig.__dataclass_fields__["pad_token_id"].default
GATING_SIGMOID = 2  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


class _Meta:
    """Typed reads of ``ARCH.*`` keys that record every problem instead of raising at the first."""

    def __init__(self, get: Callable[[str], Any], arch: str):
        self.get, self.prefix, self.problems = get, arch + ".", []

    def key(self, k: str) -> str:
        return k if k.startswith(("general.", "tokenizer.")) else self.prefix + k

    def raw(self, k: str, required: bool):
        v = self.get(self.key(k))
        if v is None and required:
            self.problems.append(f"{self.key(k)}: missing")
        return v

    def int(self, k: str, required: bool = True, default: int | None = None) -> int | None:
        v = self.raw(k, required)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            self.problems.append(f"{self.key(k)}: expected an integer, got {v!r}")
            return default
        return int(v)

    def float(self, k: str, required: bool = True, default: float | None = None) -> float | None:
        v = self.raw(k, required)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
            self.problems.append(f"{self.key(k)}: expected a number, got {v!r}")
            return default
        return float(str(np.float32(v)))  # GGUF stores f32: 1e-05, not 9.999999747378752e-06

    def bool(self, k: str, default: bool) -> bool:
        v = self.raw(k, False)
        if v is None:
            return default
        if not isinstance(v, (bool, np.bool_)):
            self.problems.append(f"{self.key(k)}: expected a bool, got {v!r}")
            return default
        return bool(v)

    def per_layer(self, k: str, n: int, required: bool) -> list | None:
        """A scalar (broadcast) or an array with at least n entries; the first n."""
        v = self.raw(k, required)
        if v is None:
            return None
        if not isinstance(v, list):
            return [v] * n
        if len(v) < n:
            self.problems.append(f"{self.key(k)}: has {len(v)} entries, expected at least {n}")
            return None
        return v[:n]


def config_from_metadata(get: Callable[[str], Any], *, name: str, n_vocab: int | None = None) -> ModelConfig:
    """A ModelConfig from GGUF metadata (`get(key)` returns the value as plain Python, None when absent).

    n_vocab: fallback vocabulary size (e.g. from token_embd.weight) when ``ARCH.vocab_size`` is absent. Raises
    ConfigError listing every missing or inconsistent key.
    """
    arch = get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{name}: general.architecture is {arch!r}; expected one of {list(ARCHITECTURES)}")
    m = _Meta(get, arch)
    blocks = m.int("block_count")
    nextn = m.int("nextn_predict_layers", required=False, default=0)
    n = None if blocks is None else blocks - nextn
    kw: dict[str, Any] = {}
    if n is not None and n <= 0:
        m.problems.append(
            f"{m.key('block_count')}: {blocks} blocks leave no trunk layers after {nextn} MTP layers"
        )
        n = None
    direct = [("hidden_size", "embedding_length"), ("intermediate_size", "feed_forward_length"),
              ("num_attention_heads", "attention.head_count"), ("q_lora_rank", "attention.q_lora_rank"),
              ("kv_lora_rank", "attention.kv_lora_rank"), ("v_head_dim", "attention.value_length_mla"),
              ("index_n_heads", "attention.indexer.head_count"), ("index_head_dim", "attention.indexer.key_length"),
              ("index_topk", "attention.indexer.top_k"), ("linear_head_dim", "kda.head_dim"),
              ("linear_conv_kernel_dim", "ssm.conv_kernel"), ("hc_mult", "hyper_connection.count"),
              ("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations"), ("n_routed_experts", "expert_count"),
              ("num_experts_per_tok", "expert_used_count"), ("moe_intermediate_size", "expert_feed_forward_length"),
              ("n_shared_experts", "expert_shared_count")]  # fmt: skip
    for field, key in direct:
        v = m.int(key)
        if v is not None:
            kw[field] = v
    for field, key, dflt in [("n_group", "expert_group_count", 1), ("topk_group", "expert_group_used_count", 1),
                             ("max_position_embeddings", "context_length", None)]:  # fmt: skip
        v = m.int(key, required=False)
        if v is not None:
            kw[field] = v
        elif dflt is not None:
            kw[field] = dflt
    if "num_attention_heads" in kw:
        kw["linear_num_heads"] = kw["num_attention_heads"]  # llama.cpp: one head count for KDA and MLA
    rope = m.int("rope.dimension_count", required=False, default=0)
    if rope:
        m.problems.append(f"{m.key('rope.dimension_count')}: {rope}, but GLM-5.3 is NoPE (expected 0)")
    k_mla = m.int("attention.key_length_mla")
    if k_mla is not None:
        kw["qk_nope_head_dim"] = k_mla - rope
    kpool = m.int("attention.indexer.kpool", required=False)
    if kpool is None:  # ggml PR #27752 spelling (docs/architecture.md §11.7)
        kpool = m.int("attention.indexer.block_size", required=False)
    if kpool is None:
        m.problems.append(
            f"{m.key('attention.indexer.kpool')}: missing (nor {m.key('attention.indexer.block_size')})"
        )
    else:
        kw["index_kpool"] = kpool
    kw["index_kpool_always_select_tail"] = m.bool("attention.indexer.kpool_select_tail", True)
    for field, key, required, dflt in [("rms_norm_eps", "attention.layer_norm_rms_epsilon", True, None),
                                       ("index_norm_eps", "attention.layer_norm_epsilon", False, 1e-6),
                                       ("linear_lower_bound", "kda.gate_lower_bound", True, None),
                                       ("hc_eps", "hyper_connection.epsilon", True, None),
                                       ("routed_scaling_factor", "expert_weights_scale", False, 1.0)]:  # fmt: skip
        v = m.float(key, required=required, default=dflt)
        if v is not None:
            kw[field] = v
    kw["norm_topk_prob"] = m.bool("expert_weights_norm", False)
    gating = m.int("expert_gating_func", required=False, default=GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        m.problems.append(
            f"{m.key('expert_gating_func')}: {gating}, but only sigmoid ({GATING_SIGMOID}) is supported"
        )
    if n is not None:
        kw["num_hidden_layers"], kw["num_nextn_predict_layers"] = n, nextn
        kv_heads = m.per_layer("attention.head_count_kv", n, required=True)
        if kv_heads is not None:
            kw["layer_types"] = tuple("kda" if int(h) == 0 else "dsa" for h in kv_heads)
        dense = m.int("leading_dense_block_count", required=False, default=0)
        if not 0 <= dense <= n:
            m.problems.append(f"{m.key('leading_dense_block_count')}: {dense} is not in [0, {n}]")
        else:
            kw["mlp_layer_types"] = ("dense",) * dense + ("moe",) * (n - dense)
        types = m.per_layer("attention.indexer.types", n, required=False)
        kw["indexer_types"] = (
            ("full",) * n if types is None else tuple("full" if t else "shared" for t in types)
        )
        limits = set()
        for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            vals = m.per_layer(key, blocks, required=True)
            if vals is not None:
                limits |= {float(x) for x in vals[: n + min(nextn, 1)]}
        if len(limits) > 1 or limits & {0.0}:
            m.problems.append(f"{m.key('swiglu_clamp_exp')} / {m.key('swiglu_clamp_shexp')}: glm53 needs one "
                              f"positive SwiGLU limit for every layer, got {sorted(limits)}")  # fmt: skip
        elif limits:
            kw["swiglu_limit"] = limits.pop()
    vocab = m.int("vocab_size", required=False, default=n_vocab)
    if vocab is None:
        m.problems.append(f"{m.key('vocab_size')}: missing (and no token_embd.weight to take it from)")
    else:
        kw["vocab_size"] = vocab
        eos = [m.int(f"tokenizer.ggml.{k}_token_id", required=False) for k in ("eos", "eot", "eom")]
        eos = tuple(dict.fromkeys(t for t in eos if t is not None))
        kw["eos_token_ids"] = eos or tuple(t for t in _RELEASE_EOS if t < vocab)
        pad = m.int("tokenizer.ggml.padding_token_id", required=False)
        kw["pad_token_id"] = pad if pad is not None else (_RELEASE_PAD if _RELEASE_PAD < vocab else 0)
    if m.problems:
        raise ConfigError(f"{name}: GGUF metadata problems:\n  " + "\n  ".join(m.problems))
    try:
        return ModelConfig(**kw)
    except ConfigError as e:
        raise ConfigError(f"{name}: GGUF metadata gives an invalid config: {e}") from None
