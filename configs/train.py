"""Training configs: ``--config=configs/train.py:NAME`` for ``python -m experiments.train``.

Variants:
  tiny   the tiny default architecture (configs/tiny.py) with a 512-token BPE on 40 stdlib files; a few steps,
         for tests and smoke runs
  small  a first real run on the whole standard library: 4096-token BPE, hidden 256, 8 layers (DSA at 3, 7),
         32 experts top-4 of width 256, a shared expert, an MTP layer
  mini   the next shipped model (glm53/assets/mini still holds mini_v1's run until this one is trained), the release
         in miniature: 4 layers (KDA in 0-2, DSA in 3: the
         release's 3:1), a dense MLP in layer 0 and MoE (32 routed experts of width 256, top-4, a shared expert) in
         layers 1-3 and the MTP block, hidden 256, 4096-token BPE; trained on the standard library and the
         pure-Python files of the packages ``pip install -e .`` brings, the packages click, jinja2, markupsafe and
         requests held out whole; 8 x 512 tokens per step (the indexer keeps 16 of 128 pools)
  mini_v1 the shipped model (2026-12-02; its card's command says ``:mini``, the recipe's name then): 8 layers, dense MLPs in 0-6, MoE in 7 only; the standard library
         alone, 560 steps of 8 x 256 tokens

Sections: ``model`` (glm53.config.ModelConfig fields; vocab_size must equal the trained tokenizer's),
``kernels`` (glm53.config.kernels.KernelConfig: the routed experts run "blocked", kernels/moe/blocked.py, a
dropless, static-shape, differentiable grouped matmul; the reference's ragged_dot costs about every expert on
every row on XLA:CPU, 8x slower forward + backward at 2048 tokens x top-4 of 32 experts; the other ops "auto"),
``data`` (glm53.data.DataConfig), ``optim`` (glm53.train.step.OptimConfig), ``loss``
(glm53.train.loss.LossConfig), ``mesh`` (glm53.parallel.MeshConfig, as configs/tiny.py: the batch on "data", the
tp / ep rules on "model"; a shape without -1 holding fewer devices uses the first ones, e.g.
``--config.mesh.shape="(1, 1)"`` for one device), and the run: batch_size, seq_len, seed, eval_every, eval_batches, save_every,
keep, log_every, fast_compile.
"""

import ml_collections

from configs import tiny


def _schedules(d: ml_collections.ConfigDict, dense: int = 3) -> None:
    n = d.num_hidden_layers
    d.layer_types = ["dsa" if i % 4 == 3 else "kda" for i in range(n)]
    d.mlp_layer_types = ["dense"] * min(dense, n - 1) + ["moe"] * (n - min(dense, n - 1))
    d.indexer_types = ["full"] * n


VARIANTS = {
    "tiny": dict(
        model=dict(vocab_size=512, num_hidden_layers=4),
        data=dict(vocab_size=512, max_files=40),
        optim=dict(lr=3e-3, warmup_steps=2, total_steps=8),
        run=dict(batch_size=2, seq_len=32, eval_every=4, eval_batches=2, save_every=4, keep=2, log_every=1,
                 fast_compile=True),
    ),
    "small": dict(
        model=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                   moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, linear_num_heads=4,
                   linear_head_dim=64, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
                   qk_nope_head_dim=64, v_head_dim=64, index_n_heads=8, index_head_dim=32, index_topk=64),
        data=dict(vocab_size=4096),
        optim=dict(lr=2e-3, warmup_steps=100, total_steps=2000),
        run=dict(batch_size=8, seq_len=256, eval_every=200, eval_batches=16, save_every=200, keep=3, log_every=10,
                 fast_compile=False),
    ),
    "mini": dict(
        model=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                   moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, linear_num_heads=4,
                   linear_head_dim=64, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
                   qk_nope_head_dim=64, v_head_dim=64, index_n_heads=8, index_head_dim=32, index_topk=64),
        dense_layers=1,
        data=dict(vocab_size=4096, requirements_of="glm53", heldout=["click", "jinja2", "markupsafe", "requests"]),
        optim=dict(lr=3e-3, warmup_steps=100, total_steps=3000, bias_gamma=3e-3),
        run=dict(batch_size=8, seq_len=512, eval_every=250, eval_batches=8, save_every=50, keep=2, log_every=10,
                 fast_compile=False),
    ),
    "mini_v1": dict(
        model=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                   moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, linear_num_heads=4,
                   linear_head_dim=64, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
                   qk_nope_head_dim=64, v_head_dim=64, index_n_heads=8, index_head_dim=32, index_topk=64),
        dense_layers=7,
        data=dict(vocab_size=4096),
        optim=dict(lr=3e-3, warmup_steps=40, total_steps=560, bias_gamma=1e-2),
        run=dict(batch_size=8, seq_len=256, eval_every=80, eval_batches=8, save_every=80, keep=2, log_every=10,
                 fast_compile=False),
    ),
}  # fmt: skip


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "tiny"
    if name not in VARIANTS:
        raise ValueError(f"configs/train.py: unknown variant {name!r}; choose one of {sorted(VARIANTS)}")
    v = VARIANTS[name]
    cfg = ml_collections.ConfigDict()
    cfg.model = tiny.model_config("default")
    cfg.model.update(v["model"])
    _schedules(cfg.model, v.get("dense_layers", 3))
    cfg.model.eos_token_ids = [
        0,
        7,
        9,
    ]  # <|endoftext|>, <|user|>, <|observation|> (glm53.data.bpe.STOP_TOKENS)
    cfg.model.pad_token_id = 0
    cfg.data = ml_collections.ConfigDict(dict(root="", exclude=["site-packages", "dist-packages", "__pycache__"],
                                              fractions=[0.9, 0.05, 0.05], salt="", vocab_size=4096,
                                              min_frequency=2, max_files=0, requirements_of="",
                                              heldout=[]))  # fmt: skip
    cfg.data.update(v["data"])
    cfg.optim = ml_collections.ConfigDict(dict(lr=3e-3, warmup_steps=100, total_steps=1000, end_lr_ratio=0.1,
                                               b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0,
                                               bias_gamma=1e-3, compute_dtype="float32"))  # fmt: skip
    cfg.optim.update(v["optim"])
    cfg.loss = ml_collections.ConfigDict(dict(mtp_weight=0.3, balance_weight=1e-4))
    cfg.kernels = tiny.kernels_config()
    cfg.kernels.moe = "blocked"  # what training runs (module docstring)
    cfg.mesh = tiny.mesh_config()
    cfg.seed = 0
    cfg.update(v["run"])
    return cfg
