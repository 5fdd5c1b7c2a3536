"""Tiny GLM-5.3 configs for CPU tests and demos. Select a variant as ``configs/tiny.py:NAME``.

Variants:
  default  hidden 64, 6 layers (DSA at 3), 8 experts top-2, index_topk 8 (the sparse path fires past ~12 tokens)
  parity   hidden 64, 8 layers (DSA at 3, 7), 16 experts top-4, 32 indexer heads, swiglu_limit 2 (clamp fires)
  gguf     hidden 256, 8 layers, 16 experts of width 256 (i-quant blocks fit the expert rows), top-4
  small    hidden 1024, 8 layers (DSA at 3, 7), 32 experts -- the "small" benchmark model
  sharded  hidden 64, 5 layers (DSA at 3, MoE at 3, 4), 8 KDA / MLA / indexer heads, expert width 64: every
           split axis divides 8 devices, 8 expert inputs per device (tests/test_sharding.py)

  python -m experiments.generate --config=configs/tiny.py:default --prompt="hello" --max_new=16

The ``mesh`` section (glm53.parallel.MeshConfig) picks the device mesh and rule set, e.g.
``--config.mesh.shape="(2, 4)" --config.mesh.rules=ep``; the ``kernels`` section
(glm53.config.kernels.KernelConfig) the implementation of each kernel op, e.g. ``--config.kernels.moe=reference``.
"""

import ml_collections

from glm53.config.kernels import KernelConfig

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=6,
    num_nextn_predict_layers=1,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    swiglu_limit=10.0,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    num_attention_heads=2,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
    index_kpool=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    eos_token_ids=[0],
    pad_token_id=0,
    scan_layers=False,  # runtime layout (docs/scan.md): --config.model.scan_layers=True scans repeating layers
)

VARIANTS = {
    "default": {},
    "parity": dict(
        num_hidden_layers=8,
        n_routed_experts=16,
        num_experts_per_tok=4,
        index_n_heads=32,
        swiglu_limit=2.0,
    ),
    "gguf": dict(
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=512,
        moe_intermediate_size=256,
        n_routed_experts=16,
        num_experts_per_tok=4,
        linear_num_heads=4,
        linear_head_dim=32,
        num_attention_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_n_heads=32,
        index_head_dim=32,
        index_topk=16,
    ),
    "sharded": dict(
        num_hidden_layers=5,
        moe_intermediate_size=64,
        linear_num_heads=8,
        linear_head_dim=8,
        num_attention_heads=8,
        index_n_heads=8,
    ),
    "small": dict(
        vocab_size=4096,
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=2048,
        moe_intermediate_size=256,
        n_routed_experts=32,
        num_experts_per_tok=4,
        linear_num_heads=8,
        linear_head_dim=64,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=64,
    ),
}


def model_config(name: str = "default") -> ml_collections.ConfigDict:
    if name not in VARIANTS:
        raise ValueError(f"configs/tiny.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}")
    d = dict(_BASE)
    d.update(VARIANTS[name])
    n = d["num_hidden_layers"]
    d["layer_types"] = ["dsa" if i % 4 == 3 else "kda" for i in range(n)]
    d["mlp_layer_types"] = ["dense"] * 3 + ["moe"] * (n - 3)
    d["indexer_types"] = ["full"] * n
    return ml_collections.ConfigDict(d)


def quant_config() -> ml_collections.ConfigDict:
    """Routed-expert storage (glm53.config.QuantConfig). Quantized experts need expert matrices whose inputs are
    a multiple of the block size (256 for K- and i-quants): use the `gguf` or `small` variant, e.g.
    ``--config=configs/tiny.py:gguf --config.quant.experts=ud_iq3_xxs`` or ``--config.quant.experts=q4_k``."""
    return ml_collections.ConfigDict(
        dict(experts="none", layout="planes", decode_max_slots=64)
    )


def kernels_config() -> ml_collections.ConfigDict:
    """The implementation of each kernel op (glm53.config.kernels.KernelConfig): its defaults, every op "auto"
    (the backend's best); listed so that ``--config.kernels.OP=NAME`` can set one."""
    return ml_collections.ConfigDict(KernelConfig().to_dict())


def mesh_config() -> ml_collections.ConfigDict:
    """Device mesh and sharding rules (glm53.parallel.MeshConfig): every device on "model", tensor parallel."""
    return ml_collections.ConfigDict(dict(axes=("data", "model"), shape=(1, -1), rules="tp"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict()
    cfg.model = model_config(arg or "default")
    cfg.quant = quant_config()
    cfg.kernels = kernels_config()
    cfg.mesh = mesh_config()
    cfg.seed = 0
    cfg.param_dtype = "float32"
    return cfg
