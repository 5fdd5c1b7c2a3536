"""Generate text or token ids.

  python -m experiments.generate --config=configs/tiny.py --prompt="hello" --max_new=16
  python -m experiments.generate --config=configs/tiny.py --prompt_ids=1,2,3 --max_new=16 --temperature=0.8 --top_p=0.9
  python -m experiments.generate --weights=HF_DIR --prompt="Why is the sky blue?" --chat --max_new=64
  python -m experiments.generate --config=configs/tiny.py --prompt_ids=1,2,3 --speculative   # MTP drafts

Prints the new token ids (and text when a tokenizer is present) and decode tokens/s. The model and its caches run
on the config's device mesh (``--config.mesh.shape=(1,8) --config.mesh.rules=ep``); --weights without --config:
the default mesh (every device on "model", tensor parallel).
"""

from absl import app, flags, logging
from ml_collections import config_flags

from glm53 import build, generate, tokenizer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_WEIGHTS = flags.DEFINE_string("weights", None, "HF safetensors folder (config, weights, tokenizer)")
_PROMPT = flags.DEFINE_string("prompt", None, "prompt text")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "prompt as comma-separated token ids")
_CHAT = flags.DEFINE_bool("chat", False, "render --prompt as a user message with the chat template")
_MAX_NEW = flags.DEFINE_integer("max_new", 32, "tokens to generate")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top-k filter (0 = off)")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_SPEC = flags.DEFINE_bool(
    "speculative", False, "greedy decoding with MTP drafts (reports the acceptance rate)"
)
_DTYPE = flags.DEFINE_string("dtype", "float32", "parameter dtype when loading --weights")


def main(argv):
    del argv
    if (_WEIGHTS.value is None) == (_CONFIG.value is None):
        raise app.UsageError("give exactly one of --weights or --config")
    if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
        raise app.UsageError("give exactly one of --prompt or --prompt_ids")
    run = build.sharded_model(_CONFIG.value, weights=_WEIGHTS.value, dtype=build.parse_dtype(_DTYPE.value))
    cfg = run.cfg
    tok = tokenizer.load_tokenizer(_WEIGHTS.value, vocab_size=cfg.vocab_size)
    logging.info("model config: %s", cfg)
    print(f"mesh {dict(run.mesh.shape)}, rules {run.rules.name}")
    if _PROMPT_IDS.value is not None:
        try:
            ids = [int(t) for t in _PROMPT_IDS.value]
        except ValueError:
            raise app.UsageError(f"--prompt_ids: not a list of integers: {_PROMPT_IDS.value}") from None
    elif _CHAT.value:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": _PROMPT.value}], add_generation_prompt=True
        )
    else:
        ids = tok.encode(_PROMPT.value)
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise app.UsageError(f"prompt token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    gen = generate.Generator(run.model, mesh=run.mesh, rules=run.rules)
    if _SPEC.value:
        res = gen.generate_speculative(ids, _MAX_NEW.value, eos_ids=cfg.eos_token_ids)
    else:
        sp = generate.SamplingParams(
            temperature=_TEMP.value, top_p=_TOP_P.value, top_k=_TOP_K.value, max_new=_MAX_NEW.value,
            eos_ids=cfg.eos_token_ids, seed=_SEED.value,
        )  # fmt: skip
        res = gen.generate([ids], sp)
    new = res.tokens[0]
    print("prompt ids:", ids)
    print("new ids:", new)
    print("text:", repr(tok.decode(new)))
    line = f"prefill {len(ids)} tokens in {res.prefill_s:.3f}s (incl. compile); decode {len(new)} tokens in {res.decode_s:.3f}s"
    if res.steady_steps:
        line += f"; steady decode {res.steady_tokens_per_s:.1f} tok/s per stream (after the first, compiling step)"
    print(line)
    if _SPEC.value:
        print(f"MTP drafts accepted: {res.accepted}/{res.drafted} ({res.acceptance_rate:.1%})")


if __name__ == "__main__":
    app.run(main)
