"""Generate text or token ids.

  python -m experiments.generate --config=configs/tiny.py --prompt="hello" --max_new=16
  python -m experiments.generate --config=configs/tiny.py --prompt_ids=1,2,3 --max_new=16 --temperature=0.8 --top_p=0.9
  python -m experiments.generate --weights=HF_DIR --prompt="Why is the sky blue?" --chat --max_new=64
  python -m experiments.generate --config=configs/tiny.py --prompt_ids=1,2,3 --speculative   # MTP drafts

Prints what runs (weights, or config + seed of a random model: noise), the new token ids (and text when a
tokenizer is present; without one, text is bytes) and decode tokens/s. The model and its caches run on the
config's device mesh (``--config.mesh.shape=(1,8) --config.mesh.rules=ep``); --weights without --config: the
default mesh (every device on "model", tensor parallel); with both, --config gives the mesh and quant sections.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from glm53 import build, generate, tokenizer
from glm53.config import model_config_from_dict

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_WEIGHTS = flags.DEFINE_string(
    "weights", None, "HF safetensors folder (config, weights, tokenizer), Orbax or GGUF"
)
_PROMPT = flags.DEFINE_string("prompt", None, "prompt text")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "prompt as comma-separated token ids")
_CHAT = flags.DEFINE_bool("chat", False, "render --prompt as a user message with the chat template")
_MAX_NEW = flags.DEFINE_integer("max_new", 32, "tokens to generate (0: none)")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass, in (0, 1]")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top-k filter (0 = off)")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_SPEC = flags.DEFINE_bool(
    "speculative", False, "greedy decoding with MTP drafts (reports the acceptance rate)"
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(build.DTYPES), "parameter dtype when loading --weights")
_MTP = flags.DEFINE_enum(
    "mtp", "auto", list(build.MTP_CHOICES), "build the MTP block (auto: if the weights have it)"
)
_VERIFY = flags.DEFINE_bool("verify", True, "check the CRC-32 of every tensor of an Orbax checkpoint")


def sampling_params(eos_ids=()) -> generate.SamplingParams:
    """The sampling flags as SamplingParams; UsageError naming the flag outside its domain."""
    try:
        return generate.SamplingParams(temperature=_TEMP.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                                       max_new=_MAX_NEW.value, eos_ids=tuple(eos_ids), seed=_SEED.value)  # fmt: skip
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WEIGHTS.value is None and _CONFIG.value is None:
        raise app.UsageError("give --weights or --config (or both: --config then gives the mesh and quant)")
    if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
        raise app.UsageError("give exactly one of --prompt or --prompt_ids")
    if _SPEC.value and _MTP.value == "off":
        raise app.UsageError("--speculative drafts with the MTP block: not with --mtp=off")
    if _SPEC.value and (_TEMP.value, _TOP_P.value, _TOP_K.value) != (0.0, 1.0, 0):
        raise app.UsageError("--speculative is greedy: leave --temperature, --top_p and --top_k unset")
    sampling_params()
    ids = None
    if _PROMPT_IDS.value is not None:
        try:
            ids = [int(t) for t in _PROMPT_IDS.value]
        except ValueError:
            raise app.UsageError(f"--prompt_ids: not a list of integers: {_PROMPT_IDS.value}") from None
    cfg = (
        build.weights_config(_WEIGHTS.value)
        if _WEIGHTS.value
        else model_config_from_dict(_CONFIG.value.model)
    )
    tok = tokenizer.load_tokenizer(_WEIGHTS.value, vocab_size=cfg.vocab_size)
    if ids is None:
        if _CHAT.value:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": _PROMPT.value}], add_generation_prompt=True
            )
        else:
            ids = tok.encode(_PROMPT.value)
    flag = "--prompt_ids" if _PROMPT_IDS.value is not None else "--prompt"
    try:
        generate.check_prompts([ids], cfg.vocab_size, cfg.max_position_embeddings, _MAX_NEW.value)
    except ValueError as e:
        raise app.UsageError(f"{flag} / --max_new: {e}") from None
    run = build.sharded_model(
        _CONFIG.value, weights=_WEIGHTS.value, dtype=build.parse_dtype(_DTYPE.value),
        with_mtp=build.MTP_CHOICES[_MTP.value], verify=_VERIFY.value,
    )  # fmt: skip
    logging.debug("model config: %s", run.cfg)
    print(build.describe_run(run, config_name=cli.config_name("config"), seed=_CONFIG.value and _CONFIG.value.seed,
                             weights=_WEIGHTS.value))  # fmt: skip
    if isinstance(tok, tokenizer.ByteTokenizer):
        print("tokenizer: none (token ids are bytes)")
    gen = generate.Generator(run.model, mesh=run.mesh, rules=run.rules)
    if _SPEC.value:
        if not gen.has_mtp:
            raise app.UsageError("--speculative needs the MTP block, and the weights have none")
        res = gen.generate_speculative(ids, _MAX_NEW.value, eos_ids=cfg.eos_token_ids)
    else:
        res = gen.generate([ids], sampling_params(cfg.eos_token_ids))
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
    cli.run(main)
