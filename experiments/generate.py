"""Generate text or token ids.

  python -m experiments.generate --prompt="def fibonacci(n):" --max_new=48          # the shipped model
  python -m experiments.generate --prompt="Why is the sky blue?" --chat --max_new=64
  python -m experiments.generate --prompt="import os" --speculative                 # MTP drafts vs plain greedy
  python -m experiments.generate --config=configs/tiny.py --prompt_ids=1,2,3 --max_new=16 --temperature=0.8 --top_p=0.9
  python -m experiments.generate --weights=HF_DIR --prompt="Why is the sky blue?" --chat --max_new=64

Without --weights and --config it runs the trained model shipped with glm53 (`glm53.assets`, exactly as
``--weights=glm53/assets/mini``); --config alone runs that config's seeded random model (noise, for tests).
Decoding runs on the serving engine (glm53.serving.offline: one slot, prefill in chunks of 256/64/16/4/1 tokens,
sampling on device), the decode loop `experiments.serve` runs too. Prints what runs (first line), the new token
ids (and text when a tokenizer is present; without one, text is bytes) and decode tokens/s. --chat renders --prompt as a user message with the tokenizer's chat template (printed).
--speculative decodes greedily with MTP drafts, then also plain greedy in the same run: it prints the draft
acceptance rate, whether both give the same tokens (they must), and the decode speedup (tokens/s of compiled
runs, median of --repeats runs each, compilation excluded). The model and its caches run on the config's device
mesh (``--config.mesh.shape=(1,8) --config.mesh.rules=ep``); --weights without --config: the default mesh (every
device on "model", tensor parallel); with both, --config gives the mesh and quant sections.
"""


from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from glm53 import assets, build, tokenizer
from glm53.config import model_config_from_dict
from glm53.runtime.sampling import SamplingParams, check_prompts
from glm53.serving import offline

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_WEIGHTS = flags.DEFINE_string(
    "weights", None,
    "HF safetensors folder (config, weights, tokenizer), Orbax or GGUF (neither this nor --config: the shipped "
    "glm53-mini, glm53/assets/mini)",
)  # fmt: skip
_PROMPT = flags.DEFINE_string("prompt", None, "prompt text")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "prompt as comma-separated token ids")
_CHAT = flags.DEFINE_bool("chat", False, "render --prompt as a user message with the chat template")
_MAX_NEW = flags.DEFINE_integer("max_new", 32, "tokens to generate (0: none)")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass, in (0, 1]")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top-k filter (0 = off)")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_SPEC = flags.DEFINE_bool(
    "speculative", False,
    "greedy decoding with MTP drafts; also runs plain greedy: acceptance rate, same tokens, decode speedup",
)  # fmt: skip
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "--speculative: timed runs of each decoder after the compiling one (median speedup)"
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(build.DTYPES), "parameter dtype when loading --weights")
_MTP = flags.DEFINE_enum(
    "mtp", "auto", list(build.MTP_CHOICES), "build the MTP block (auto: if the weights have it)"
)
_VERIFY = flags.DEFINE_bool("verify", True, "check the CRC-32 of every tensor of an Orbax checkpoint")
_MOE_IMPL = cli.define_moe_impl_flag()


RULE = "-" * 40


def sampling_params(eos_ids=()) -> SamplingParams:
    """The sampling flags as SamplingParams; UsageError naming the flag outside its domain."""
    try:
        return SamplingParams(temperature=_TEMP.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                              max_new=_MAX_NEW.value, eos_ids=tuple(eos_ids), seed=_SEED.value)  # fmt: skip
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def speculative_vs_greedy(model, ids: list[int], max_new: int, eos_ids, repeats: int, **engine_kw):
    """(speculative result, plain greedy result, speedup line) for one prompt, each on its own one-slot engine.

    Both first run once (compiling; these are the results returned). Then `repeats` interleaved timed runs of
    each, all compiled: the speedup is the median over pairs of (speculative / greedy) decode tokens/s (new
    tokens over the time after prefill), so machine load that drifts between pairs cancels.
    """
    sp = SamplingParams(max_new=max_new, eos_ids=tuple(eos_ids))
    engines = [offline.engine_for(model, [ids], max_new, speculative=s, **engine_kw) for s in (True, False)]
    spec, greedy = (offline.generate(e, [ids], sp) for e in engines)
    n = len(spec.tokens[0])
    if n < 2 or len(greedy.tokens[0]) < 2:
        return spec, greedy, f"speedup: not measured ({n} new token(s); needs at least 2)"
    s_tps, g_tps, ratios = [], [], []
    for _ in range(repeats):
        s = offline.generate(engines[0], [ids], sp).decode_tokens_per_s
        g = offline.generate(engines[1], [ids], sp).decode_tokens_per_s
        s_tps.append(s)
        g_tps.append(g)
        ratios.append(s / g)
    line = (f"speedup {_median(ratios):.2f}x: speculative {_median(s_tps):.1f} tok/s vs plain greedy "
            f"{_median(g_tps):.1f} tok/s (decode, compiled; median of {repeats} run(s) each, {n} new tokens)")  # fmt: skip
    return spec, greedy, line


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
        raise app.UsageError("give exactly one of --prompt or --prompt_ids")
    if _SPEC.value and _MTP.value == "off":
        raise app.UsageError("--speculative drafts with the MTP block: not with --mtp=off")
    if _SPEC.value and (_TEMP.value, _TOP_P.value, _TOP_K.value) != (0.0, 1.0, 0):
        raise app.UsageError("--speculative is greedy: leave --temperature, --top_p and --top_k unset")
    if _REPEATS.value < 1:
        raise app.UsageError(f"--repeats={_REPEATS.value}: must be >= 1")
    sampling_params()
    ids = None
    if _PROMPT_IDS.value is not None:
        try:
            ids = [int(t) for t in _PROMPT_IDS.value]
        except ValueError:
            raise app.UsageError(f"--prompt_ids: not a list of integers: {_PROMPT_IDS.value}") from None
    weights, label = assets.resolve(_WEIGHTS.value, _CONFIG.value)
    cfg = build.weights_config(weights) if weights else model_config_from_dict(_CONFIG.value.model)
    tok = tokenizer.load_tokenizer(weights, vocab_size=cfg.vocab_size)
    chat = None
    if ids is None:
        if _CHAT.value:
            chat = tok.apply_chat_template([{"role": "user", "content": _PROMPT.value}], tokenize=False)
            ids = tok.encode(chat, add_special_tokens=False)
        else:
            ids = tok.encode(_PROMPT.value)
    flag = "--prompt_ids" if _PROMPT_IDS.value is not None else "--prompt"
    try:
        check_prompts([ids], cfg.vocab_size, cfg.max_position_embeddings, _MAX_NEW.value)
    except ValueError as e:
        raise app.UsageError(f"{flag} / --max_new: {e}") from None
    kernels = cli.kernel_config(_CONFIG.value, _MOE_IMPL)  # the config's kernels section, or --moe_impl
    run = build.sharded_model(
        _CONFIG.value, weights=weights, dtype=build.parse_dtype(_DTYPE.value),
        with_mtp=build.MTP_CHOICES[_MTP.value], verify=_VERIFY.value, kernels=kernels,
    )  # fmt: skip
    logging.debug("model config: %s", run.cfg)
    print(build.describe_run(run, config_name=cli.config_name("config"), seed=_CONFIG.value and _CONFIG.value.seed,
                             weights=weights, label=label))  # fmt: skip
    if isinstance(tok, tokenizer.ByteTokenizer):
        print("tokenizer: none (token ids are bytes)")
    mesh = dict(mesh=run.mesh, rules=run.rules)
    if _SPEC.value:
        if run.model.mtp is None:
            raise app.UsageError("--speculative needs the MTP block, and the weights have none")
        res, greedy, speed = speculative_vs_greedy(
            run.model, ids, _MAX_NEW.value, cfg.eos_token_ids, _REPEATS.value, **mesh
        )
    else:
        res = offline.generate(run.model, [ids], sampling_params(cfg.eos_token_ids), **mesh)
    new = res.tokens[0]
    if chat is not None:
        print("chat:", repr(chat))
    print("prompt ids:", ids)
    print("new ids:", new)
    print("text (as printed, between the rules):")
    print(RULE, tok.decode(new), RULE, sep="\n")
    mode = "speculative decoding, its first (compiling) run: " if _SPEC.value else ""
    line = (f"{mode}prefill {len(ids)} tokens in {res.prefill_s:.3f}s (compilation included); decode {len(new)} "
            f"tokens in {res.decode_s:.3f}s (compilation included)")  # fmt: skip
    if res.steady_steps:
        line += f"; steady decode {res.steady_tokens_per_s:.1f} tok/s per stream (compilation excluded: after the first step)"
    print(line)
    if _SPEC.value:
        print(f"MTP drafts accepted: {res.accepted}/{res.drafted} ({res.acceptance_rate:.1%})")
        print(offline.identity_line(new, greedy.tokens[0]))
        print(speed)


if __name__ == "__main__":
    cli.run(main)
