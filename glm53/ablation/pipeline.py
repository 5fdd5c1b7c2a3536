"""The ablation sweep behind ``python -m experiments.ablate`` (see experiments/ablate.py for the outputs).

`run(config, out)`: everything is checked first (variants against the base model's config, llama-cpp-python and
ggml, the tokens, an existing results.json); then the base model is loaded once, its logits computed (glm53, and
llama.cpp on ``base.gguf``), and each variant not yet in results.json is written as ``<variant>.gguf`` (llama.cpp's
quantizer on the routed experts, with the imatrix for ``+imatrix``), measured in weight space, scored by glm53
with the experts kept quantized (and the variant's latent cache layout, ``+latent_*``) and by llama.cpp, and
appended to results.json (written atomically after each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from glm53 import assets, build, dims, scoring
from glm53.ablation import imatrix as imx
from glm53.ablation import llama, report, stats
from glm53.ablation.variants import Variant, expert_bytes, moe_layers, parse_variants
from glm53.checkpoint import gguf_rules as rules
from glm53.checkpoint.gguf import decode_tensor, open_gguf_model
from glm53.checkpoint.gguf_export import EXPERT_NAME, model_params, write_gguf
from glm53.config import ModelConfig, QuantConfig
from glm53.config.fields import field_error, from_dict
from glm53.config.kernels import KernelConfig
from glm53.data import bpe
from glm53.data.corpus import Corpus
from glm53.data.prepare import DataConfig, corpus_of, split_files
from glm53.errors import ConfigError
from glm53.files import atomic_write, write_json
from glm53.progress import Progress
from glm53.quant import ggml
from glm53.quant.int8 import quantize_int8
from glm53.quant.mixes import MATRICES
from glm53.train import per_layer

RESULTS, TOKENS, BASE_GGUF, IMATRIX = "results.json", "tokens.json", "base.gguf", "imatrix.gguf"
BASE_LOGITS = "base_logits.npz"


@dataclasses.dataclass(frozen=True)
class AblateConfig:
    """The experiment config of configs/ablate.py (every field is documented there)."""

    weights: str = ""
    variants: str = "F32,Q8_0,Q4_K,IQ3_S,IQ2_S,UD-IQ3_XXS"
    n_ctx: int = 256
    n_chunks: int = 16
    split: str = "test"
    tokens: str = ""
    imatrix: str = ""
    imatrix_split: str = "validation"
    imatrix_chunks: int = 16
    layout: str = "planes"
    kernels: KernelConfig = KernelConfig()
    llama_cpp: bool = True
    threads: int = 0

    def __post_init__(self):
        for f in ("n_ctx", "n_chunks", "imatrix_chunks", "threads"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if f == "threads" else 1):
                raise field_error(f"config.{f}", f"must be a positive integer, got {v!r}")
        if self.n_ctx < 4:
            raise field_error(
                "config.n_ctx", f"must be at least 4 (the second half is scored), got {self.n_ctx}"
            )
        QuantConfig(layout=self.layout)  # checks the name


def ablate_config(d) -> AblateConfig:
    return from_dict(AblateConfig, d, "ablate config", nested={"kernels": KernelConfig})


# ------------------------------------------------------------------------------------------------ inputs
def base_weights(c: AblateConfig) -> tuple[str, str]:
    """(weights path, label): config.weights or the shipped model."""
    if c.weights:
        if not os.path.exists(c.weights):
            raise field_error("config.weights", f"{c.weights} does not exist")
        return c.weights, c.weights
    folder = assets.require_default_model()
    return folder, assets.describe(folder)


def read_tokens(path: str, cfg: ModelConfig) -> list[list[int]]:
    """config.tokens: a JSON list of equal-length token-id lists (at least 4 tokens each)."""
    try:
        with open(path) as f:
            seqs = json.load(f)
        scoring.check_sequences(seqs, cfg.vocab_size, cfg.max_position_embeddings)
    except (OSError, ValueError) as e:
        raise field_error("config.tokens", f"{path}: {e}") from None
    if len({len(s) for s in seqs}) != 1 or len(seqs[0]) < 4:
        raise field_error("config.tokens", f"{path}: every chunk must have the same length (>= 4), got "
                          f"{sorted({len(s) for s in seqs})}")  # fmt: skip
    return seqs


def split_sources(model_dir: str, split: str) -> tuple[Corpus, tuple[str, ...]]:
    """(corpus, the files of `split`) of the corpus the model at `model_dir` was trained on: its card.json's data
    config (root, exclusions, fractions, salt), else glm53's defaults (this Python's standard library, 0.9 / 0.05 /
    0.05)."""
    data = DataConfig()
    card = os.path.join(model_dir, "card.json") if os.path.isdir(model_dir) else ""
    if os.path.isfile(card):
        with open(card) as f:
            data = from_dict(
                DataConfig, json.load(f).get("data", {}).get("config", {}), "card.json data config"
            )
    corpus = corpus_of(data)
    return corpus, split_files(corpus, data)[split]


def corpus_chunks(model_dir: str, split: str, n_ctx: int, n_chunks: int) -> list[list[int]]:
    """`n_chunks` chunks of `n_ctx` tokens of a split of the corpus the model was trained on (its card.json's
    data config, else glm53's defaults), documents joined by the end-of-text token, as in training."""
    tok_path = os.path.join(model_dir, "tokenizer.json") if os.path.isdir(model_dir) else ""
    if not os.path.isfile(tok_path):
        raise field_error("config.tokens", f"the base weights {model_dir} have no tokenizer.json: give "
                          "config.tokens=FILE (a JSON list of token-id lists)")  # fmt: skip
    tok = Tokenizer.from_file(tok_path)
    eos = tok.token_to_id(bpe.EOS)
    corpus, files = split_sources(model_dir, split)
    ids: list[int] = []
    for rel in files:
        ids += tok.encode(corpus.read(rel), add_special_tokens=False).ids + [eos]
        if len(ids) >= n_ctx * n_chunks:
            break
    if len(ids) < n_ctx * n_chunks:
        raise field_error("config.n_chunks", f"split {split!r} has only {len(ids)} tokens, fewer than "
                          f"{n_chunks} x {n_ctx}")  # fmt: skip
    return [ids[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunks)]


def read_results(path: str, header: dict) -> dict:
    """The results.json of an earlier run of the same setup (header keys equal), or a new one."""
    if not os.path.exists(path):
        return dict(header, variants=[])
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e}); remove it or choose another --out") from None
    diff = [k for k in header if old.get(k) != header[k]]
    if diff:
        raise ConfigError(f"{path} was made with another setup ({diff[0]}: {old.get(diff[0])!r} vs "
                          f"{header[diff[0]]!r}); choose another --out")  # fmt: skip
    return old


# ------------------------------------------------------------------------------------------------ scoring
def glm53_logits(model, chunks: list[list[int]]) -> np.ndarray:
    """float32 [C, S, V]: the model's logits at the scored positions of each chunk."""
    sl = stats.scored_positions(len(chunks[0]))
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        return logits[0, sl]

    return np.stack([np.asarray(fwd(state, jnp.asarray([c], jnp.int32)), np.float32) for c in chunks])


def llama_logits(path: str, chunks: list[list[int]], threads: int) -> np.ndarray:
    sl = stats.scored_positions(len(chunks[0]))
    with llama.LlamaLogits(path, len(chunks[0]), threads or None) as m:
        return np.stack([m.logits(c)[sl] for c in chunks])


def summary(logits: np.ndarray, base: np.ndarray, chunks: list[list[int]]) -> dict:
    t = np.asarray(chunks)
    sl = stats.scored_positions(t.shape[1])
    targets = t[:, sl.start + 1 :].reshape(-1)
    v = logits.shape[-1]
    return stats.summarize(stats.token_stats(logits.reshape(-1, v), base.reshape(-1, v), targets))


# ------------------------------------------------------------------------------------------------ variants
def int8_non_experts(model) -> int:
    """Replaces every non-expert Linear kernel (2-D per layer, not the router, which the model keeps f32) by its
    int8 per-output-channel round trip (`glm53.quant.int8`); returns how many (per layer: a kernel stacked over a
    scanned group's repeats, leading axis `dims.LAYERS`, is rounded and counted per repeat, as unrolled)."""
    state = nnx.state(model, nnx.Param)
    n = 0
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        names = [str(p) for p in path]
        axes = var.get_metadata().get("logical_axes") or ()
        stacked = int(bool(axes) and axes[0] == dims.LAYERS)
        if names[-1] == "kernel" and "router" not in names and getattr(v, "ndim", 0) == 2 + stacked:
            mats = np.asarray(v) if stacked else np.asarray(v)[None]
            q = np.stack([quantize_int8(m).dequantize() for m in mats])
            var.set_value(jnp.asarray(q if stacked else q[0], v.dtype))
            n += len(mats)
    nnx.update(model, state)
    return n


def layer_params(model) -> dict:
    """`model_params` (our paths, host f32) named per trunk layer whatever the grouping: a scanned model's stacked
    values are sliced per layer (`glm53.train.per_layer.expand_state`), so `write_gguf` and `weight_errors`
    see the paths of the unrolled model."""
    if not any(g.scanned for g in model.groups):
        return model_params(model)
    flat = per_layer.expand_state(nnx.state(model), model.groups)
    return {p: np.asarray(v, np.float32) for p, v in flat.items()}


def weight_errors(path: str, params, cfg: ModelConfig) -> tuple[dict, dict]:
    """Relative Frobenius error of the GGUF's routed experts against the base: per role over the trunk's MoE
    layers, and {layer: {role: error}}."""
    ref = {}
    for p, value in params.items():
        t = rules.target_for(p, tuple(np.shape(value)), cfg)
        if t.is_expert:
            for name, a in zip(t.names, rules.to_gguf(t.kind, value, cfg)):
                ref[name] = a
    err = {m: [0.0, 0.0] for m in MATRICES}
    per_layer: dict[str, dict[str, float]] = {}
    trunk = set(moe_layers(cfg))
    with open_gguf_model(path) as g:
        for info in g:
            m = EXPERT_NAME.fullmatch(info.name)
            if m is None or int(m["block"]) not in trunk:
                continue
            a = np.asarray(ref[info.name], np.float64)
            d = float(np.sum((np.asarray(decode_tensor(g, info), np.float64) - a) ** 2))
            s = float(np.sum(a * a))
            err[m["matrix"]][0] += d
            err[m["matrix"]][1] += s
            per_layer.setdefault(m["block"], {})[m["matrix"]] = math.sqrt(d / s) if s else 0.0
    return {k: math.sqrt(d / s) if s else 0.0 for k, (d, s) in err.items()}, per_layer


def run(c: AblateConfig, out: str, *, log=print) -> dict:
    """The sweep (module docstring); returns results.json's content."""
    weights, label = base_weights(c)
    cfg = build.weights_config(weights)
    variants = parse_variants(c.variants, cfg)
    if c.llama_cpp:
        try:
            llama.check_available()
        except RuntimeError as e:
            raise field_error("config.llama_cpp", f"{e} (or set config.llama_cpp=False)") from None
    if not ggml.available():
        raise ConfigError(f"ggml's quantizer (llama.cpp's libggml-base) cannot be loaded: {llama.INSTALL}")
    if c.imatrix and not os.path.isfile(c.imatrix):
        raise field_error("config.imatrix", f"{c.imatrix} does not exist")
    chunks = read_tokens(c.tokens, cfg) if c.tokens else corpus_chunks(weights, c.split, c.n_ctx, c.n_chunks)
    n_ctx = len(chunks[0])
    sl = stats.scored_positions(n_ctx)
    header = {
        "base": label,
        "n_ctx": n_ctx,
        "scored_from": sl.start,
        "n_tokens_scored": len(chunks) * (sl.stop - sl.start),
    }
    os.makedirs(out, exist_ok=True)
    results = read_results(os.path.join(out, RESULTS), header)
    if os.path.exists(os.path.join(out, TOKENS)):
        with open(os.path.join(out, TOKENS)) as f:
            if json.load(f) != chunks:
                raise ConfigError(
                    f"{out}/{TOKENS} holds other tokens than this setup scores; choose another --out"
                )
    done = {v["name"] for v in results["variants"]}
    todo = [v for v in variants if v.name not in done]
    write_json(os.path.join(out, TOKENS), chunks, indent=None)
    write_json(os.path.join(out, RESULTS), results)
    log(f"base: {label}; {len(chunks)} chunks of {n_ctx} tokens, {header['n_tokens_scored']} scored; "
        f"{len(variants)} variants, {len(variants) - len(todo)} already in {RESULTS}")  # fmt: skip
    if todo:
        _sweep(c, out, weights, cfg, chunks, todo, results, log)
    report.write(out, results)
    return results


def _base_logits(c, out, cfg, params, base_model, chunks) -> tuple[np.ndarray, np.ndarray | None]:
    """The base's logits from glm53 and (config.llama_cpp) from llama.cpp on base.gguf; kept in
    base_logits.npz (written atomically) so that a rerun of the same setup does not recompute them."""
    path = os.path.join(out, BASE_LOGITS)
    if os.path.exists(path):
        with np.load(path) as z:
            if "glm53" in z and (not c.llama_cpp or "llama_cpp" in z):
                return z["glm53"], z["llama_cpp"] if c.llama_cpp else None
    arrays = {"glm53": glm53_logits(base_model, chunks)}
    if c.llama_cpp:
        write_gguf(os.path.join(out, BASE_GGUF), cfg, params, dense_type="F32", experts="F32")
        arrays["llama_cpp"] = llama_logits(os.path.join(out, BASE_GGUF), chunks, c.threads)
    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)
    return arrays["glm53"], arrays.get("llama_cpp")


def _sweep(c, out, weights, cfg, chunks, todo: list[Variant], results: dict, log) -> None:
    t0 = time.time()
    # the base, the statistics' reference, runs the reference expert kernel (its other ops as the config says)
    base_kernels = c.kernels.replace(moe="reference")
    _, base_model = build.load_model(weights, dtype=jnp.float32, with_mtp=False, kernels=base_kernels)
    params = layer_params(base_model)
    base, base_ll = _base_logits(c, out, cfg, params, base_model, chunks)
    if base_ll is not None:
        results["llama_cpp_base_max_abs_logit_diff"] = float(np.max(np.abs(base_ll - base)))
    imp = None
    if any(v.imatrix for v in todo):
        imp, results["imatrix"] = variant_imatrix(
            base_model, weights, out, path=c.imatrix, split=c.imatrix_split, n_ctx=c.n_ctx,
            n_chunks=c.imatrix_chunks, chunks=chunks if c.tokens else None,
        )  # fmt: skip
    log(f"base model, logits and base.gguf: {time.time() - t0:.1f} s")
    # a tqdm bar over the variants on a terminal; elsewhere each variant's result line is its progress
    with Progress(len(todo), desc="ablate", unit="variant", lines=False) as bar:
        for v in todo:
            bar.set_postfix(v.name)
            t1 = time.time()
            results["variants"].append(_variant(c, out, cfg, params, chunks, v, base, base_ll, imp))
            results["variants"][-1]["seconds"] = round(time.time() - t1, 1)
            write_json(os.path.join(out, RESULTS), results)
            r = results["variants"][-1]
            bar.write(f"{v.name}: {r['bpw']:.3f} bpw, KLD {r['kld']['mean']:.3e}, same top-1 "
                      f"{100 * r['same_top1']:.2f}%, PPL ratio {r['ppl'] / r['ppl_base']:.5f} ({r['seconds']} s)",
                      log)  # fmt: skip
            bar.update(1)


def variant_imatrix(
    base_model, weights: str, out: str, *, path: str = "", split: str = "validation", n_ctx: int = 256,
    n_chunks: int = 16, chunks: list[list[int]] | None = None,
) -> tuple[dict, str]:
    """(importance per expert tensor, what results.json names it) for the +imatrix variants: the imatrix GGUF at
    `path`, else llama.cpp's importance matrix of `base_model` computed on `chunks` (None: `n_chunks` chunks of
    `n_ctx` tokens of the weights' `split`, `corpus_chunks`) and written to out/imatrix.gguf."""
    if not path:
        calib = corpus_chunks(weights, split, n_ctx, n_chunks) if chunks is None else chunks
        im = imx.collect(base_model, calib, dataset=f"{split or 'tokens'} split")
        imx.write_imatrix(os.path.join(out, IMATRIX), im)
    return imx.read_imatrix(path or os.path.join(out, IMATRIX)), path or IMATRIX


def variant_model(out: str, cfg: ModelConfig, params, v: Variant, *, layout: str = "planes",
                  kernels: KernelConfig | None = None, imp: dict | None = None) -> tuple[str, object, int]:
    """(out/<variant>.gguf, the model, int8 matrices): the variant built as the sweep builds it. The base's
    `params` (`layer_params`) are written with llama.cpp's quantizer on the routed experts (`imp`: the importance
    of +imatrix variants), the GGUF loaded with the experts kept quantized (QuantConfig(v.mix, layout); `kernels`
    None: every op "auto"), then the variant's latent cache layout (+latent_*) and int8 non-expert round trip
    (+int8) applied."""
    path = os.path.join(out, v.file)
    write_gguf(path, cfg, params, dense_type=v.dense_type, experts=v.mix, imatrix=imp if v.imatrix else None)
    quant = QuantConfig(experts=v.mix, layout=layout)
    kernels = KernelConfig() if kernels is None else kernels
    _, model = build.load_model(path, dtype=jnp.float32, with_mtp=False, quant=quant, kernels=kernels)
    if v.latent != "auto":  # +latent_*: a forward without a cache builds a fresh one of this layout, so scoring
        model.set_latent_cache_dtype(v.latent)  # attends over the stored latent
    return path, model, int8_non_experts(model) if v.int8 else 0


def _variant(c, out, cfg, params, chunks, v: Variant, base, base_ll, imp) -> dict:
    path, model, int8 = variant_model(out, cfg, params, v, layout=c.layout, kernels=c.kernels, imp=imp)
    nbytes, nweights = expert_bytes(v, cfg)
    rel, rel_layers = weight_errors(path, params, cfg)
    ours = glm53_logits(model, chunks)
    del model
    r = {"name": v.name, "gguf": v.file, "bpw": 8 * nbytes / nweights, "expert_bytes": nbytes,
         "weight_rel_frobenius": rel, "weight_rel_frobenius_layers": rel_layers}  # fmt: skip
    if int8:
        r["int8_matrices"] = int8
    if v.latent != "auto":
        r["latent_cache_dtype"] = v.latent
    r.update(summary(ours, base, chunks))
    r["llama_cpp"] = None
    if base_ll is not None and not v.int8 and v.latent == "auto":  # llama.cpp has neither (F32 KV cache)
        theirs = llama_logits(path, chunks, c.threads)
        r["llama_cpp"] = summary(theirs, base_ll, chunks)
        r["llama_cpp_max_abs_logit_diff"] = float(np.max(np.abs(theirs - ours)))
        r["llama_cpp_minus_glm53"] = {
            "kld_mean": r["llama_cpp"]["kld"]["mean"] - r["kld"]["mean"],
            "ln_ppl_ratio": r["llama_cpp"]["ln_ppl_ratio"] - r["ln_ppl_ratio"],
            "same_top1": r["llama_cpp"]["same_top1"] - r["same_top1"],
        }
    return r
