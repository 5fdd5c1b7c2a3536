"""GLM-5.3-Flash as released (zai-org/GLM-5.3-Flash), every value of docs/architecture.md §2.

Usage:
  python -m experiments.memory_budget --config=configs/glm53_flash.py
Override any field from the command line, e.g. ``--config.model.index_topk=1024``.
"""

import ml_collections

from glm53.config.kernels import KernelConfig


def model_config() -> ml_collections.ConfigDict:
    n = 45
    return ml_collections.ConfigDict(
        dict(
            vocab_size=154880,
            hidden_size=4096,
            num_hidden_layers=n,
            num_nextn_predict_layers=1,
            layer_types=["dsa" if i % 4 == 3 else "kda" for i in range(n)],
            mlp_layer_types=["dense"] * 3 + ["moe"] * (n - 3),
            indexer_types=["full"] * n,
            rms_norm_eps=1e-5,
            max_position_embeddings=1048576,
            tie_word_embeddings=False,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            n_routed_experts=288,
            num_experts_per_tok=8,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            swiglu_limit=10.0,
            linear_num_heads=64,
            linear_head_dim=128,
            linear_conv_kernel_dim=4,
            linear_lower_bound=-5.0,
            num_attention_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=256,
            v_head_dim=256,
            index_n_heads=32,
            index_head_dim=128,
            index_topk=2048,
            index_kpool=4,  # the checkpoint's value; transformers' class default (16) is wrong for this model
            index_kpool_always_select_tail=True,
            index_norm_eps=1e-6,
            latent_cache_dtype="int8",  # the serving layout: int8 MLA latent + one f32 scale per token
            scan_layers=True,  # repeating layers as one lax.scan each (docs/scan.md)
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            eos_token_ids=[154820, 154827, 154829],
            pad_token_id=154820,
            vision=dict(
                depth=24,
                hidden_size=1024,
                num_heads=16,
                intermediate_size=4096,
                in_channels=3,
                patch_size=14,
                temporal_patch_size=2,
                spatial_merge_size=2,
                out_hidden_size=4096,
                projection_intermediate_size=10240,
                attention_bias=True,
            ),
        )
    )


def quant_config() -> ml_collections.ConfigDict:
    """Routed experts as in Unsloth's UD-IQ3_XXS GGUF (glm53.config.QuantConfig); e.g. ``--config.quant.layout=
    reencoded`` for the gather-free IQ2_S / IQ3_S layouts, ``--config.quant.experts=q4_k`` for another format."""
    return ml_collections.ConfigDict(
        dict(experts="ud_iq3_xxs", layout="planes", decode_max_slots=512)
    )


def mesh_config() -> ml_collections.ConfigDict:
    """Device mesh and sharding rules (glm53.parallel.MeshConfig): the prior art's 8-way tensor parallelism
    (every device on "model"); ``--config.mesh.rules=ep`` for expert parallelism."""
    return ml_collections.ConfigDict(dict(axes=("data", "model"), shape=(1, -1), rules="tp"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    cfg = ml_collections.ConfigDict()
    cfg.model = model_config()
    cfg.quant = quant_config()
    cfg.kernels = ml_collections.ConfigDict(KernelConfig().to_dict())  # every op "auto", the backend's best
    cfg.mesh = mesh_config()
    cfg.seed = 0
    cfg.param_dtype = "bfloat16"
    return cfg
