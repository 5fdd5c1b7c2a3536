"""The model card of a trained run: the numbers (card.json) and their README.md.

Every number comes from the run's files or is measured here on the exported weights:

  * data: files / tokens / characters per split (``data/manifest.json``), the tokenizer (``data/tokenizer``);
  * architecture: layer schedule, experts, mHC streams, MTP, parameter counts (the config and the model);
  * training (``metrics.jsonl``): steps, tokens seen (steps x batch x seq_len, padding included), training time = the sum of the logged intervals (tokens / tokens_per_s: the train steps, compile
    included, evaluation and checkpoint saves excluded), elapsed = first to last write of the run's files, the last
    logged train loss and the last validation evaluation;
  * `window_nll`: held-out perplexity as the loop's evaluation counts it: ``seq_len``-token windows (window w =
    tokens [w L, (w + 1) L)), L - 1 next-token predictions per window, full windows only, as many as the token
    budget holds, evenly spaced over the text (`eval_windows`);
  * `unigram`: the same targets under a unigram model of the train split (add-one smoothing), and `self_unigram`:
    under the unigram fitted to those targets themselves (their own token frequencies: the best any unigram does on
    them, the baselines of the held-out packages and of the standard library's test files);
  * the text scored: the test split (files never trained on, from the trained sources), its standard-library part
    (the split's first files: `glm53.data.prepare.split_files`), and the held-out split (whole packages never
    trained on) when the corpus has one;
  * `mtp_acceptance`: greedy speculative decoding with the MTP draft (the serving engine's, one slot:
    `glm53.serving.offline`) on prompts cut from the held-out split; acceptance = accepted drafts / drafts.
"""

from __future__ import annotations

import json
import math
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.config import ModelConfig
from glm53.data.packing import open_tokens
from glm53.model import Glm53Model
from glm53.runtime.sampling import SamplingParams
from glm53.serving import offline

CARD_VERSION = 2


# ------------------------------------------------------------------------------------------------ run files
def training_summary(records: list[dict], *, batch_size: int, seq_len: int) -> dict:
    """Steps, tokens seen, training time and the last losses of a run's metrics records (module docstring)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise ValueError("metrics: no train records")
    seconds, prev = 0.0, 0
    for r in train:
        if r.get("tokens_per_s", 0) > 0:  # steady steps (compilation excluded since the workbench issue)
            seconds += (r["step"] - prev) * r["tokens"] / r["tokens_per_s"]
        seconds += r.get("compile_s", 0.0)  # the first step of each train() call: its compilation, kept in
        prev = r["step"]
    last = train[-1]
    out = dict(steps=int(last["step"]), tokens_seen=int(last["step"]) * batch_size * seq_len,
               train_time_s=seconds, final_train_loss=last["lm_loss"], final_train_total_loss=last["loss"],
               final_mtp_loss=last.get("mtp_loss"), last_lr=last.get("lr"), epochs=last.get("epoch"))  # fmt: skip
    if evals:
        ev = evals[-1]
        out.update(validation_step=int(ev["step"]), validation_loss=ev["loss"], validation_ppl=ev["ppl"],
                   validation_mtp_loss=ev.get("mtp_loss"), validation_tokens=ev.get("tokens"))  # fmt: skip
    return out


def elapsed_s(workdir: str) -> float:
    """From run.json (written when the run starts) to the last write of metrics.jsonl."""
    try:
        return os.path.getmtime(os.path.join(workdir, "metrics.jsonl")) - os.path.getmtime(
            os.path.join(workdir, "run.json")
        )
    except OSError:
        return float("nan")


def data_summary(manifest: dict) -> dict:
    splits = {
        k: dict(files=v["files"], tokens=v["n_tokens"], chars=v["chars"], sources=v.get("sources"))
        for k, v in manifest["splits"].items()
    }
    packages = manifest.get("packages") or {}
    corpus = f"the Python {manifest.get('python', '')} standard library's .py files"
    if packages:
        corpus += (f" and those of the {len(packages)} packages `pip install -e .` brings "
                   f"({(manifest.get('config') or {}).get('requirements_of')!r}'s requirements)")  # fmt: skip
    return dict(corpus=corpus, root=manifest.get("root"), splits=splits, config=manifest.get("config"),
                packages=packages, heldout=(manifest.get("config") or {}).get("heldout") or [])  # fmt: skip


def tokenizer_summary(tokenizer_dir: str, manifest: dict) -> dict:
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {})
    special = [t["content"] for t in tok.get("added_tokens", []) if t.get("special")]
    try:
        with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            chat = bool(json.load(f).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        chat = False
    pre = (tok.get("pre_tokenizer") or {}).get("type", "no")
    return dict(kind=f"{model.get('type', '?')} with a {pre} pre-tokenizer", vocab_size=manifest["vocab_size"], merges=len(model.get("merges", [])), special_tokens=special,
                eos_id=manifest["eos_id"], stop_ids=manifest.get("stop_ids"), trained_on="train split only",
                chat_template=chat)  # fmt: skip


def architecture(cfg: ModelConfig, model: Glm53Model) -> dict:
    """The layer schedule, sizes and parameter counts of `cfg` / `model`."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    total = sum(int(v.get_value().size) for _, v in params)
    mtp = sum(int(v.get_value().size) for p, v in params if p[0] == "mtp")
    experts = sum(int(v.get_value().size) for p, v in params if "experts" in p and "shared_experts" not in p)
    n_moe = sum(t == "moe" for t in cfg.mlp_layer_types) + (1 if mtp else 0)
    active_experts = experts * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
    return dict(
        layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        kda_layers=[i for i, t in enumerate(cfg.layer_types) if t == "kda"],
        dsa_layers=[i for i, t in enumerate(cfg.layer_types) if t == "dsa"],
        dense_mlp_layers=[i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"],
        moe_layers=[i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"],
        routed_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, shared_experts=cfg.n_shared_experts,
        expert_width=cfg.moe_intermediate_size, dense_width=cfg.intermediate_size,
        kda_heads=cfg.linear_num_heads, kda_head_dim=cfg.linear_head_dim, attention_heads=cfg.num_attention_heads,
        index_heads=cfg.index_n_heads, index_topk=cfg.index_topk, index_kpool=cfg.index_kpool,
        mhc_streams=cfg.hc_mult, mtp_layers=cfg.num_nextn_predict_layers if mtp else 0,
        params=total, params_without_mtp=total - mtp, moe_blocks=n_moe,
        params_active_per_token=total - mtp - experts + active_experts if experts else total - mtp,
    )  # fmt: skip


def machine() -> str:
    """This machine in words: CPU model and cores, JAX backend and device kind."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    dev = jax.devices()[0]
    return f"{cpu}, {os.cpu_count()} cores; JAX {jax.__version__} on {len(jax.devices())} x {dev.device_kind} ({dev.platform})"


# ------------------------------------------------------------------------------------------------ evaluation
def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """int32 [W, seq_len]: W = max_tokens // seq_len (>= 1) of the text's full windows (window w = tokens
    [w L, (w + 1) L)), evenly spaced over all of them (all of them when there are no more than W): a split of many
    files or packages is sampled throughout, not only in its first files."""
    if seq_len < 2:
        raise ValueError(f"seq_len: need >= 2, got {seq_len}")
    total = len(tokens) // seq_len
    if total < 1:
        raise ValueError(f"the split holds {len(tokens)} tokens, fewer than one window of seq_len {seq_len}")
    n = min(total, max(max_tokens // seq_len, 1))
    picks = np.round(np.linspace(0, total - 1, n)).astype(np.int64)
    return np.asarray(tokens[: total * seq_len], np.int32).reshape(total, seq_len)[picks]


def window_nll(model: Glm53Model, windows: np.ndarray, *, batch: int = 8) -> dict:
    """Next-token NLL of every window (f32 log-softmax of the model's logits): {tokens, nll (mean), ppl}."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, toks):
        logits, _ = nnx.merge(graphdef, state)(toks)
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.sum(jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1), axis=(1, 2))

    total = 0.0
    for s in range(0, len(windows), batch):
        chunk = windows[s : s + batch]
        pad = batch - len(chunk)  # keep one compiled shape; padded rows are dropped
        full = np.concatenate([chunk, np.repeat(chunk[:1], pad, 0)]) if pad else chunk
        total += float(np.sum(np.asarray(nll_sum(state, jnp.asarray(full)), np.float64)[: len(chunk)]))
    count = windows.shape[0] * (windows.shape[1] - 1)
    return dict(tokens=int(count), nll=total / count, ppl=math.exp(total / count))


def unigram(train_tokens: np.ndarray, windows: np.ndarray, vocab_size: int) -> dict:
    """The windows' next-token targets under the train split's unigram model, add-one smoothed:
    p(t) = (count(t) + 1) / (N + V). {tokens, nll, ppl}."""
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size).astype(np.float64)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    targets = windows[:, 1:].reshape(-1)
    nll = float(-np.mean(logp[targets]))
    return dict(tokens=int(targets.size), nll=nll, ppl=math.exp(nll))


def self_unigram(windows: np.ndarray) -> dict:
    """The windows' next-token targets under the unigram fitted to them: p(t) = count(t) / N. {tokens, nll, ppl}."""
    targets = windows[:, 1:].reshape(-1).astype(np.int64)
    counts = np.bincount(targets).astype(np.float64)
    nll = float(-np.mean(np.log(counts[targets] / targets.size)))
    return dict(tokens=int(targets.size), nll=nll, ppl=math.exp(nll))


def mtp_acceptance(
    model: Glm53Model, tokens: np.ndarray, *, prompts: int = 8, prompt_len: int = 64, max_new: int = 32
) -> dict:
    """Greedy speculative decoding of `prompts` prompts of `prompt_len` tokens cut at evenly spaced offsets of
    `tokens`, `max_new` new tokens each (no stop ids: every prompt runs to `max_new`)."""
    if model.mtp is None or prompts == 0:  # no MTP block, or skipped (experiments.export --prompts=0)
        return dict(prompts=0, accepted=0, drafted=0, acceptance=None)
    span = len(tokens) - prompt_len
    if span < 0:
        raise ValueError(f"the split holds {len(tokens)} tokens, fewer than prompt_len {prompt_len}")
    cut = [[int(t) for t in tokens[start : start + prompt_len]] for start in
           (span * i // max(prompts, 1) for i in range(prompts))]  # fmt: skip
    eng = offline.engine_for(model, cut, max_new, slots=1, speculative=True)  # one slot, its programs reused
    accepted = drafted = 0
    for prompt in cut:
        r = offline.generate(eng, [prompt], SamplingParams(max_new=max_new))
        accepted, drafted = accepted + r.accepted, drafted + r.drafted
    return dict(prompts=prompts, prompt_len=prompt_len, max_new=max_new, accepted=accepted, drafted=drafted,
                acceptance=accepted / drafted if drafted else None,
                tokens_per_verify_step=(drafted + accepted) / drafted if drafted else None)  # fmt: skip


def evaluate(
    model: Glm53Model,
    data_dir: str,
    *,
    seq_len: int,
    max_tokens: int,
    prompts: int = 8,
    prompt_len: int = 64,
    max_new: int = 32,
    batch: int = 8,
) -> dict:
    """Perplexity of the test split, its standard-library part and the held-out packages against the unigram
    baselines, and the MTP acceptance (module docstring)."""
    test, meta = open_tokens(os.path.join(data_dir, "test.bin"))
    train, _ = open_tokens(os.path.join(data_dir, "train.bin"))
    texts = {"test": test}
    manifest_path = os.path.join(data_dir, "manifest.json")
    sources = {}
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        sources = manifest["splits"]["test"].get("sources") or {}
        if "heldout" in manifest["splits"]:
            texts["heldout"], _ = open_tokens(os.path.join(data_dir, "heldout.bin"))
    if sources and set(sources) != {"stdlib"} and sources.get("stdlib", {}).get("tokens", 0) >= seq_len:
        texts["test_stdlib"] = test[: sources["stdlib"]["tokens"]]  # the split's first files (split_files)
    scored = {}
    for name, tokens in texts.items():
        windows = eval_windows(tokens, seq_len, max_tokens)
        scored[name] = dict(model=window_nll(model, windows, batch=batch), self_unigram=self_unigram(windows),
                            unigram=unigram(train, windows, int(meta["vocab_size"])))  # fmt: skip
    return dict(split="test", seq_len=seq_len, test=scored["test"]["model"], unigram=scored["test"]["unigram"],
                texts=scored, mtp=mtp_acceptance(model, test, prompts=prompts, prompt_len=prompt_len,
                                                 max_new=max_new))  # fmt: skip


# ------------------------------------------------------------------------------------------------ README
def fmt(x, spec: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _hms(s: float) -> str:
    if s is None or math.isnan(s):
        return "n/a"
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


TEXTS = {"heldout": "held-out packages (never trained on)", "test": "test split (unseen files)",
         "test_stdlib": "test split, standard library only"}  # fmt: skip


def _eval_table(ev: dict, test: dict, uni: dict) -> list[str]:
    """The evaluation table: NLL per text against the unigram fitted to that text and the train split's."""
    if "texts" not in ev:  # a version-1 card: the test split alone
        return ["| held-out test split | tokens scored | NLL (nats) | perplexity |", "|---|---|---|---|",
                f"| this model | {test['tokens']:,} | {test['nll']:.4f} | {test['ppl']:.2f} |",
                f"| unigram of the train split (add-one) | {uni['tokens']:,} | {uni['nll']:.4f} | {uni['ppl']:.2f} |"]  # fmt: skip
    rows = ["| text | tokens scored | NLL (nats) | perplexity | its own unigram NLL | ratio | train-split unigram NLL |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in sorted(ev["texts"], key=list(TEXTS).index):
        m, su, u = (ev["texts"][name][k] for k in ("model", "self_unigram", "unigram"))
        rows.append(f"| {TEXTS[name]} | {m['tokens']:,} | **{m['nll']:.4f}** | {m['ppl']:.2f} | {su['nll']:.4f} | "
                    f"**{m['nll'] / su['nll']:.3f}** | {u['nll']:.4f} |")  # fmt: skip
    return rows


def render(card: dict) -> str:
    """The README.md (model card) of a card dict (experiments/export.py builds it)."""
    a, d, t, tr, ev = (
        card["architecture"],
        card["data"],
        card["tokenizer"],
        card["training"],
        card["evaluation"],
    )
    test, uni, mtp = ev["test"], ev["unigram"], ev["mtp"]
    rows = "\n".join(
        f"| {k} | {v['files']} | {v['tokens']:,} | {v['chars']:,} |" for k, v in d["splits"].items()
    )
    pkgs = ", ".join(f"{k} {v}" for k, v in (d.get("packages") or {}).items())
    moe = (f"{a['routed_experts']} routed experts of width {a['expert_width']}, top-{a['top_k']}, "
           f"{a['shared_experts']} shared, in layers {a['moe_layers']}") if a["moe_layers"] else "no MoE layers"  # fmt: skip
    acc = fmt(mtp.get("acceptance"), ".3f")
    lines = [
        f"# {card['name']}",
        "",
        f"A small GLM-5.3 (architecture `glm5_next`) trained from scratch with glm53 on {d['corpus']}. It writes "
        "Python-like code; it is a demonstration of the architecture and the training pipeline, not a useful "
        "assistant. Text only: the vision tower in config.json is a placeholder without weights (transformers "
        "initializes it and lists its `model.visual.*` keys as missing); image / video input is unsupported.",
        "",
        "## Files",
        "",
        "- `config.json`, `generation_config.json`: transformers' `Glm5NextForConditionalGeneration` config",
        f"- `model.safetensors`: the model ({card['export']['dtype']}; glm53's float32 parameters stay float32)",
        "- `model-mtp.safetensors`: the MTP block (layer "
        f"{a['layers']}), read by glm53 for speculative decoding; transformers does not load it"
        if a["mtp_layers"]
        else "- no MTP block",
        "- `tokenizer.json`, `tokenizer_config.json`: the tokenizer"
        + (" (with a GLM chat template)" if t.get("chat_template") else ""),
        "- `card.json`: every number below",
        "",
        "## Architecture",
        "",
        f"- {a['layers']} layers, hidden {a['hidden_size']}, vocabulary {a['vocab_size']}",
        f"- attention: KDA (linear) in layers {a['kda_layers']} ({a['kda_heads']} heads of {a['kda_head_dim']}), "
        f"DSA (sparse MLA) in layers {a['dsa_layers']} ({a['attention_heads']} heads; indexer {a['index_heads']} "
        f"heads selecting {a['index_topk'] // a['index_kpool']} pools of {a['index_kpool']} tokens)",
        f"- MLP: dense (width {a['dense_width']}) in layers {a['dense_mlp_layers']}; {moe}",
        f"- mHC: {a['mhc_streams']} residual streams; MTP: {a['mtp_layers']} layer",
        f"- parameters: {a['params']:,} ({a['params_without_mtp']:,} without the MTP block, "
        f"{a['params_active_per_token']:,} active per token)",
        "",
        "## Data and tokenizer",
        "",
        f"Corpus: {d['corpus']}, split by file"
        + (f"; held out whole (split `heldout`): {', '.join(d['heldout'])}." if d.get("heldout") else "."),
        *(["", f"Packages (versions as trained): {pkgs}."] if pkgs else []),
        "",
        "| split | files | tokens | characters |",
        "|---|---|---|---|",
        rows,
        "",
        f"Tokenizer: {t['kind']}, {t['vocab_size']} tokens ({t['merges']} merges, {len(t['special_tokens'])} special "
        f"tokens), trained on the {t['trained_on']}; end of text id {t['eos_id']}, stop ids {t['stop_ids']}.",
        "",
        "## Training",
        "",
        f"- {tr['steps']} steps of {tr['batch_size']} x {tr['seq_len']} tokens: {tr['tokens_seen']:,} tokens seen "
        f"({fmt(tr.get('epochs'), '.2f')} epochs of the train split)",
        f"- optimizer: AdamW, lr {tr['optim']['lr']} (warmup {tr['optim']['warmup_steps']}, cosine), weight decay "
        f"{tr['optim']['weight_decay']}, MTP loss weight {tr['loss']['mtp_weight']}",
        f"- training time {_hms(tr['train_time_s'])} (train steps, compile included; elapsed {_hms(tr['elapsed_s'])} "
        f"with data preparation, evaluation and checkpoints) on {card['machine']}",
        f"- final train loss {fmt(tr['final_train_loss'])} (next token; MTP {fmt(tr.get('final_mtp_loss'))}), "
        f"validation loss {fmt(tr.get('validation_loss'))} (perplexity {fmt(tr.get('validation_ppl'), '.2f')}, "
        f"step {tr.get('validation_step')})",
        "",
        "## Evaluation (the exported weights, read back by glm53's HF loader, float32 compute)",
        "",
        *_eval_table(ev, test, uni),
        "",
        f"Windows of {ev['seq_len']} tokens, {ev['seq_len'] - 1} predictions each, as the training loop's evaluation, "
        "evenly spaced over each text.",
        "",
        (f"MTP draft acceptance (greedy speculative decoding, {mtp.get('prompts')} test-split prompts of "
         f"{mtp.get('prompt_len')} tokens, {mtp.get('max_new')} new tokens each): {acc} "
         f"({mtp.get('accepted')} / {mtp.get('drafted')} drafts; "
         f"{fmt(mtp.get('tokens_per_verify_step'), '.2f')} tokens per trunk step)."
         if mtp.get("prompts") else "MTP draft acceptance: not measured (no MTP block, or --prompts=0)."),
        "",
        "## Reproduce",
        "",
        "```",
        *card["commands"],
        "```",
        "",
        "Load: `glm53.checkpoint.hf.load_hf_model(folder)` (with the MTP block) or "
        "`transformers.Glm5NextForConditionalGeneration.from_pretrained(folder)` (trunk only).",
        "",
    ]
    return "\n".join(lines)
