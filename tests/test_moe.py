"""MoE / MLP: glm53.layers.{moe,mlp} and kernels/moe.

References: transformers `Glm5NextTextTopkRouter`, `Glm5NextTextMoE`, `Glm5NextTextMLP` (fp32, randomized
weights, swiglu_limit 2.0 so the clamps fire) and an f64 numpy loop over (token, slot) for `moe_experts`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.glm5_next import modeling_glm5_next as hf

from glm53 import dims
from glm53.config import ModelConfig, as_hf_text_config
from glm53.layers.mlp import MLP
from glm53.layers.moe import MoE, Router
from glm53.layers.param import logical_axes
from kernels.moe import api, expert_list

LIMIT = 2.0
CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    swiglu_limit=LIMIT,
    pad_token_id=0,
    eos_token_ids=(1,),
)
D, F, E, K = CFG.hidden_size, CFG.moe_intermediate_size, CFG.n_routed_experts, CFG.num_experts_per_tok


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_config(cfg: ModelConfig) -> transformers.Glm5NextTextConfig:
    c = transformers.Glm5NextTextConfig(**as_hf_text_config(cfg))
    c._experts_implementation = "eager"  # the per-expert loop in Glm5NextTextExperts.forward
    return c


def t2j(t: torch.Tensor, transpose: tuple[int, ...] | None = None) -> jnp.ndarray:
    a = t.detach().float().numpy()
    return jnp.asarray(a if transpose is None else a.transpose(transpose))


def copy_mlp(ours: MLP, theirs: hf.Glm5NextTextMLP) -> None:
    """HF Linear weight [out, in] -> our kernel [in, out]."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(ours, name).kernel[...] = t2j(getattr(theirs, name).weight, (1, 0))


def copy_router(ours: Router, theirs: hf.Glm5NextTextTopkRouter) -> None:
    ours.kernel[...] = t2j(theirs.weight, (1, 0))
    ours.e_score_correction_bias[...] = t2j(theirs.e_score_correction_bias)


def copy_moe(ours: MoE, theirs: hf.Glm5NextTextMoE) -> None:
    """HF fused experts gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F] -> ours [E,D,F] / [E,F,D]."""
    gu = theirs.experts.gate_up_proj
    f = gu.shape[1] // 2
    ours.experts.gate_proj[...] = t2j(gu[:, :f], (0, 2, 1))
    ours.experts.up_proj[...] = t2j(gu[:, f:], (0, 2, 1))
    ours.experts.down_proj[...] = t2j(theirs.experts.down_proj, (0, 2, 1))
    copy_router(ours.router, theirs.gate)
    copy_mlp(ours.shared_experts, theirs.shared_experts)


def randomize_router(r: hf.Glm5NextTextTopkRouter, g: torch.Generator) -> None:
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g) * 0.3)
        r.e_score_correction_bias.copy_(
            (torch.rand(r.e_score_correction_bias.shape, generator=g) - 0.5) * 0.4
        )


def selection_margin(choice: np.ndarray, n_group: int, topk_group: int, k: int) -> float:
    """Smallest gap (over tokens) at a routing decision boundary: between the topk_group-th and next group
    score (sum of a group's top-2) and between the k-th and next biased score among kept groups."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    gs = np.sort(np.sort(grouped, -1)[..., -2:].sum(-1), -1)[:, ::-1]  # [T, G] descending
    margin = np.inf if topk_group == n_group else np.min(gs[:, topk_group - 1] - gs[:, topk_group])
    keep = np.argsort(-np.sort(grouped, -1)[..., -2:].sum(-1), -1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), bool)
    np.put_along_axis(mask, keep, True, -1)
    c = np.where(np.repeat(mask, e // n_group, -1), choice, -np.inf)
    cs = np.sort(c, -1)[:, ::-1]
    return float(min(margin, np.min(cs[:, k - 1] - cs[:, k])))


def _sorted_by_id(ids, w):
    ids, w = np.asarray(ids), np.asarray(w, np.float64)
    o = np.argsort(ids, -1)
    return np.take_along_axis(ids, o, -1), np.take_along_axis(w, o, -1)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (1, 1, False)])
def test_router_matches_transformers(n_group, topk_group, norm):
    cfg = CFG.replace(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    g = torch.Generator().manual_seed(10 + n_group)
    theirs = hf.Glm5NextTextTopkRouter(hf_config(cfg))
    randomize_router(theirs, g)
    x = torch.randn(48, D, generator=g)
    with torch.no_grad():
        logits_t, w_t, ids_t = theirs(x)
    ours = Router(cfg, rngs=nnx.Rngs(0))
    copy_router(ours, theirs)
    ids, w = jax.jit(lambda x: ours(x))(jnp.asarray(x.numpy()))
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32 and ids.shape == (48, K)

    scores = 1.0 / (1.0 + np.exp(-logits_t.double().numpy()))
    bias = theirs.e_score_correction_bias.double().numpy()
    margin = selection_margin(scores + bias, n_group, topk_group, K)
    # the bias must matter: selection by unbiased scores differs for some tokens
    unbiased = np.sort(np.argsort(-scores, -1)[:, :K], -1)
    changed = np.mean(np.any(unbiased != np.sort(ids_t.numpy(), -1), -1))
    # with n_group > topk_group, the group restriction must matter too
    ungrouped = np.sort(np.argsort(-(scores + bias), -1)[:, :K], -1)
    by_group = np.mean(np.any(ungrouped != np.sort(ids_t.numpy(), -1), -1))
    ids_o, w_o = _sorted_by_id(ids, w)
    ids_r, w_r = _sorted_by_id(ids_t.numpy(), w_t.numpy())
    print(
        f"groups {n_group}/{topk_group} norm={norm}: min selection margin {margin:.2e}, tokens whose "
        f"selection the bias / the group limit changed {changed:.2f} / {by_group:.2f}, "
        f"weight rel err {rel(w_o, w_r):.2e}"
    )
    assert margin > 1e-4, "near-tie in routing: pick another seed"
    assert changed > 0
    assert (by_group > 0) == (topk_group < n_group)
    np.testing.assert_array_equal(ids_o, ids_r)
    assert rel(w_o, w_r) <= 1e-6


def _count_clamped(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    return int(np.sum(a > LIMIT)), int(np.sum(np.abs(b) > LIMIT))


@pytest.fixture(scope="module")
def moe_pair():
    """transformers MoE with every parameter randomized, and ours with the same weights."""
    g = torch.Generator().manual_seed(20)
    theirs = hf.Glm5NextTextMoE(hf_config(CFG))
    with torch.no_grad():
        theirs.experts.gate_up_proj.copy_(torch.randn(theirs.experts.gate_up_proj.shape, generator=g) * 0.3)
        theirs.experts.down_proj.copy_(torch.randn(theirs.experts.down_proj.shape, generator=g) * 0.2)
        for lin in (
            theirs.shared_experts.gate_proj,
            theirs.shared_experts.up_proj,
            theirs.shared_experts.down_proj,
        ):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.3)
    randomize_router(theirs.gate, g)
    x = torch.randn(2, 12, D, generator=g)
    ours = MoE(CFG, rngs=nnx.Rngs(0))
    copy_moe(ours, theirs)
    return theirs, ours, x


@pytest.mark.parametrize("implementation", ["reference", "dense_einsum"])
def test_moe_matches_transformers(moe_pair, implementation):
    theirs, ours, x = moe_pair
    with torch.no_grad():
        want = theirs(x).numpy()
        logits_t, w_t, ids_t = theirs.gate(x)
        # pre-clamp SwiGLU inputs of every routed (token, expert) pair and of the shared expert
        xt = x.reshape(-1, D)
        gu = torch.einsum("td,tkfd->tkf", xt, theirs.experts.gate_up_proj[ids_t])
        sh = theirs.shared_experts
        n_gate, n_up = _count_clamped(gu[..., :F].numpy(), gu[..., F:].numpy())
        s_gate, s_up = _count_clamped(sh.gate_proj(xt).numpy(), sh.up_proj(xt).numpy())
    ours.experts.implementation = implementation
    y, (ids, w) = nnx.jit(lambda m, x: m(x, return_routing=True))(ours, jnp.asarray(x.numpy()))
    scores = 1.0 / (1.0 + np.exp(-logits_t.double().numpy()))
    margin = selection_margin(scores + theirs.gate.e_score_correction_bias.double().numpy(), 1, 1, K)
    print(
        f"{implementation}: MoE rel err {rel(y, want):.2e}; clamped routed gate/up {n_gate}/{n_up} of "
        f"{gu[..., :F].numel()}, shared {s_gate}/{s_up}; min selection margin {margin:.2e}"
    )
    assert n_gate > 0 and n_up > 0 and s_gate > 0 and s_up > 0, "swiglu clamp never fired"
    assert margin > 1e-4
    assert y.shape == x.shape and ids.shape == (2, 12, K)
    ids_o, w_o = _sorted_by_id(np.asarray(ids).reshape(-1, K), np.asarray(w).reshape(-1, K))
    ids_r, w_r = _sorted_by_id(ids_t.numpy(), w_t.numpy())
    np.testing.assert_array_equal(ids_o, ids_r)
    assert rel(y, want) <= 1e-5


def test_mlp_matches_transformers():
    g = torch.Generator().manual_seed(30)
    theirs = hf.Glm5NextTextMLP(hf_config(CFG))
    with torch.no_grad():
        for lin in (theirs.gate_proj, theirs.up_proj, theirs.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.3)
    x = torch.randn(3, 7, D, generator=g)
    with torch.no_grad():
        want = theirs(x).numpy()
        n_gate, n_up = _count_clamped(theirs.gate_proj(x).numpy(), theirs.up_proj(x).numpy())
    ours = MLP(CFG, rngs=nnx.Rngs(0))
    copy_mlp(ours, theirs)
    got = ours(jnp.asarray(x.numpy()))
    print(f"MLP rel err {rel(got, want):.2e}; clamped gate/up {n_gate}/{n_up} of {want.size // D * 96}")
    assert n_gate > 0 and n_up > 0
    assert ours.gate_proj.kernel.shape == (D, CFG.intermediate_size)
    assert logical_axes(ours.down_proj.kernel) == (dims.MLP, dims.EMBED)
    assert rel(got, want) <= 1e-5


def _np_moe(x, ids, w, wg, wu, wd, limit):
    """f64 loop over (token, slot); id == E is an empty slot."""
    y = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e == wg.shape[0]:
                continue
            a, b = x[t] @ wg[e], x[t] @ wu[e]
            h = a.clip(max=limit) / (1.0 + np.exp(-a.clip(max=limit))) * b.clip(-limit, limit)
            y[t] += w[t, j] * (h @ wd[e])
    return y


@pytest.fixture(scope="module")
def expert_case():
    rng = np.random.default_rng(40)
    t, k, e = 9, 3, 16  # at most 27 slots over 16 experts: several experts get no token
    x = rng.normal(size=(t, D))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    ids[2, 1] = e  # an empty slot
    ids[5, 0] = ids[5, 2] = 3  # the same expert twice for one token (summed)
    w = rng.uniform(0.1, 1.0, size=(t, k))
    wg, wu = rng.normal(size=(e, D, F)) * 0.3, rng.normal(size=(e, D, F)) * 0.3
    wd = rng.normal(size=(e, F, D)) * 0.2
    return x, ids, w, wg, wu, wd


def test_moe_experts_vs_f64_loop(expert_case):
    x, ids, w, wg, wu, wd = expert_case
    want = _np_moe(x, ids, w, wg, wu, wd, LIMIT)
    f = lambda a: jnp.asarray(a, jnp.float32)
    got = {}
    for impl in ("reference", "dense_einsum", "blocked", "xla_quant_decode", "xla_quant_prefill", "xla_cpu_decode",
                 "xla_cpu_prefill"):  # fmt: skip
        fn = jax.jit(lambda *a, impl=impl: api.moe_experts(*a, LIMIT, implementation=impl))
        got[impl] = fn(f(x), jnp.asarray(ids), f(w), f(wg), f(wu), f(wd))
    # the CPU decode form on separate expert arrays (kernels/moe/expert_list.py, what the engine decodes with)
    split = [expert_list.split_experts(f(a)) for a in (wg, wu, wd)]
    fn = jax.jit(lambda *a: api.moe_experts(*a, LIMIT, implementation="xla_cpu_decode"))
    got["xla_cpu_decode(ExpertList)"] = fn(f(x), jnp.asarray(ids), f(w), *split)
    errs = {k: rel(v, want) for k, v in got.items()}
    used = len(set(ids.ravel().tolist()) - {16})
    print(
        f"moe_experts vs f64 loop: {errs}; ref vs dense {rel(got['reference'], got['dense_einsum']):.2e}; "
        f"experts used {used}/16"
    )
    assert used < 16
    assert max(errs.values()) <= 1e-5
    # bf16 activations and weights: the sorted and dense paths (both f32-accumulated) agree to bf16 rounding
    b = lambda a: jnp.asarray(a, jnp.bfloat16)
    yb = {i: api.moe_experts(b(x), jnp.asarray(ids), f(w), b(wg), b(wu), b(wd), LIMIT, implementation=i)
          for i in ("reference", "dense_einsum")}  # fmt: skip
    assert yb["reference"].dtype == jnp.bfloat16
    print(
        f"bf16 ref vs dense rel {rel(yb['reference'], yb['dense_einsum']):.2e}, vs f64 {rel(yb['reference'], want):.2e}"
    )
    assert rel(yb["reference"], yb["dense_einsum"]) <= 2e-2 and rel(yb["reference"], want) <= 5e-2


@pytest.mark.parametrize("block_rows", (1, 4, 64))
def test_blocked_values_and_gradients(expert_case, block_rows):
    """The training implementation (kernels.moe.blocked) at block sizes below, across and above the group sizes,
    and with every slot routed to one expert: values vs the f64 loop, gradients (x, routing weights, the three
    expert tensors) vs the gradients of the every-expert-on-every-token formulation (dense_einsum)."""
    from kernels.moe import blocked

    x, ids, w, wg, wu, wd = expert_case
    f = lambda a: jnp.asarray(a, jnp.float32)
    one = np.full_like(ids, 7)
    one[2, 1] = 16  # ... plus an empty slot
    for case in (ids, one):
        want = _np_moe(x, case, w, wg, wu, wd, LIMIT)
        got = blocked.moe_experts_blocked(f(x), jnp.asarray(case), f(w), f(wg), f(wu), f(wd), LIMIT,
                                          block_rows=block_rows)  # fmt: skip
        assert rel(got, want) <= 1e-5

        def loss(impl, *a, case=case):
            y = api.moe_experts(a[0], jnp.asarray(case), *a[1:], LIMIT, implementation=impl)
            return jnp.sum(jnp.sin(y))

        args = (f(x), f(w), f(wg), f(wu), f(wd))
        with jax.default_matmul_precision("highest"):
            g_b = jax.grad(lambda *a: loss("blocked", *a), argnums=range(5))(*args)
            g_d = jax.grad(lambda *a: loss("dense_einsum", *a), argnums=range(5))(*args)
        errs = [rel(a, b) for a, b in zip(g_b, g_d)]
        print(f"blocked block_rows={block_rows}: value rel {rel(got, want):.2e}, grad rel {max(errs):.2e}")
        assert max(errs) <= 1e-5
    n_blocks = blocked.block_layout(jnp.asarray(ids), 16, block_rows)[3]
    assert n_blocks == -(-ids.size // block_rows) + 16


def test_blocked_default_block_rows():
    """A quarter of the mean rows per expert, a power of two in [8, 128]."""
    from kernels.moe import blocked

    assert blocked.default_block_rows(4096 * 4, 32) == 128  # the mini's training step
    assert blocked.default_block_rows(1024 * 4, 32) == 32
    assert blocked.default_block_rows(3000, 32) == 16  # 23.4 -> 16
    assert blocked.default_block_rows(48, 16) == 8 and blocked.default_block_rows(1, 288) == 8
    assert blocked.default_block_rows(10**6, 8) == 128


def test_moe_experts_few_slots_vs_f64_loop(expert_case):
    """T*K < E (decode): the reference gathers each slot's expert instead of ragged_dot; rows 2 and 5 hold the
    empty slot and the repeated expert."""
    from kernels.moe import reference

    x, ids, w, wg, wu, wd = expert_case
    x, ids, w = x[[2, 5]], ids[[2, 5]], w[[2, 5]]
    want = _np_moe(x, ids, w, wg, wu, wd, LIMIT)
    f = lambda a: jnp.asarray(a, jnp.float32)
    args = (f(x), jnp.asarray(ids), f(w), f(wg), f(wu), f(wd), LIMIT)
    got = jax.jit(lambda *a: api.moe_experts(*a, LIMIT))(*args[:-1])
    gathered = reference.moe_experts_gathered(*args)
    print(f"few slots: reference rel {rel(got, want):.2e}, gathered rel {rel(gathered, want):.2e}")
    assert ids.size < wg.shape[0]
    assert rel(got, want) <= 1e-5 and rel(gathered, want) <= 1e-5


def test_moe_experts_bad_inputs(expert_case):
    x, ids, w, wg, wu, wd = (jnp.asarray(a) for a in expert_case)
    with pytest.raises(ValueError, match="unknown implementation 'pallas_x'"):
        api.moe_experts(x, ids, w, wg, wu, wd, LIMIT, implementation="pallas_x")
    with pytest.raises(ValueError, match="w_down"):
        api.moe_experts(x, ids, w, wg, wu, wg, LIMIT)
    with pytest.raises(ValueError, match="topk_w_tk"):
        api.moe_experts(x, ids, w[:, :2], wg, wu, wd, LIMIT)
    with pytest.raises(ValueError, match="topk_ids_tk must be integer"):
        api.moe_experts(x, w, w, wg, wu, wd, LIMIT)
    with pytest.raises(ValueError, match="x_td"):
        api.moe_experts(x[None], ids, w, wg, wu, wd, LIMIT)


def test_moe_params_shapes_and_axes():
    m = MoE(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert m.router.kernel.shape == (D, E) and m.router.kernel.dtype == jnp.float32
    assert m.router.e_score_correction_bias.dtype == jnp.float32
    assert m.experts.gate_proj.shape == (E, D, F) and m.experts.gate_proj.dtype == jnp.bfloat16
    assert m.experts.down_proj.shape == (E, F, D)
    assert logical_axes(m.experts.up_proj) == (dims.EXPERT, dims.EMBED, dims.EXPERT_MLP)
    assert logical_axes(m.router.kernel) == (dims.EMBED, dims.EXPERT)
    assert m.shared_experts.up_proj.kernel.shape == (D, F)
    assert logical_axes(m.shared_experts.up_proj.kernel) == (dims.EMBED, dims.EXPERT_MLP)
