"""Benchmark the serving engine: tokens/s, time to first token, inter-token latency; MTP and the prefix cache on
and off; the decode step's cost against the distinct experts it touched (glm53.benchmarks.serve).

  python -m experiments.bench_serve                                   # the shipped model, 1 2 4 8 16 streams
  python -m experiments.bench_serve --mtp=both --prefix_cache=both --out=serve.json --png=serve.png
  python -m experiments.bench_serve --config=configs/tiny.py --streams=1,2 --max_new=8 --out=/tmp/b.json
  python -m experiments.bench_serve --config=configs/tiny.py:small --streams=1,2,4,8,16 --prompt_len=16 \
      --shared_prefix=0 --max_new=64               # random weights, a weight-bandwidth-bound decode step
  python -m experiments.bench_serve --slots=16 --narrow=both  # 16 slots whatever N: narrow steps on and off
  python -m experiments.bench_serve --step_costs --streams=1,2,4,8,16   # the decode step alone, per compile option
  python -m experiments.bench_serve --mixed=32 --out=mixed.json   # 32 mixed-length streams: paged vs contiguous

For each stream count N and each setting: an engine of --slots slots (default: N, the smallest batch that holds
them; waiting requests prefilled together, up to --prefill_batch, default the engine's min(slots, 8)) is compiled
and warmed, then N greedy requests (prompts of --prompt_len tokens whose first --shared_prefix
tokens are common to all, --max_new tokens each, no EOS) are submitted at once and run to completion in this
thread. Per row: total and per-stream tokens/s, TTFT and ITL p50 / p99 in ms, decode steps and their mean time,
the prefix cache's saved prefill tokens, MTP's acceptance, and (MTP off) the mean distinct experts per MoE layer
per decode step. --repeats=R runs every setting R times in interleaved rounds (each row: the round with the
median total tokens/s; every round's total printed). The last line is the ratio of the largest N's total tokens/s
to one stream's. --out writes the
rows as JSON, --png plots them (needs matplotlib). --narrow=off runs every decode step over all slots (the
engine's default runs the smallest width 1, 2, 4, ... covering the busy slots: glm53.runtime.programs).
--step_costs times the decode step alone instead (no requests): at each --streams count as slots, under each
set of compile options in STEP_OPTIONS, and the narrow widths of one engine of the largest count, all
interleaved in this process (p10 and median per program: ratios hold on a loaded machine).
--mixed=N serves at a token budget instead (`S.run_mixed`): N greedy streams whose prompt + max_new totals are
log-uniform over --mixed_lengths (default 16..4096 tokens; --mixed_prompt_share of each is prompt; seed
--mixed_seed) submitted at once, twice: on paged caches (N slots sharing --mixed_cache_tokens tokens in pages of
--mixed_page_tokens, max_len = the lengths' hi) and on contiguous caches of the same DSA cache bytes
(--mixed_cache_tokens // hi slots of hi positions: the streams queue). Per mode: the most streams in slots at once, total
tokens/s, TTFT p50 / p99, wall time, peak RSS, finish reasons (streams the pool ended: out of pages), page waits.

Several processes (``--coordinator ...``, e.g. ``python -m experiments.launch --processes=2 --devices_per_process=4
-- python -m experiments.bench_serve --config=configs/tiny.py:sharded ...``): the model on the config's mesh over
every process's devices (`build.sharded_model`), each engine driven by process 0 while the others replay its
program calls (glm53.serving.multihost); decode steps over all slots (no narrow widths), the prefix cache off,
no --step_costs, no distinct-experts replay; process 0 alone prints and writes --out / --png.
"""

from absl import app, flags
from ml_collections import config_flags

from experiments import cli, startup
from glm53 import assets, build, files
from glm53.benchmarks import serve as S
from glm53.config import model_config_from_dict
from glm53.parallel import distributed
from glm53.serving import multihost

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config: its random model", lock_config=True
)
_WEIGHTS = flags.DEFINE_string("weights", None, "weights (default: the shipped glm53-mini)")
_STREAMS = flags.DEFINE_list("streams", ["1", "2", "4", "8", "16"], "concurrent stream counts")
_SLOTS = flags.DEFINE_integer("slots", 0, "engine slots (0: as many as streams)")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "prompt tokens per stream")
_SHARED = flags.DEFINE_integer("shared_prefix", 48, "leading prompt tokens common to every stream")
_MAX_NEW = flags.DEFINE_integer("max_new", 64, "tokens generated per stream")
_MTP = flags.DEFINE_enum(
    "mtp", "off", ["off", "on", "both"], "MTP speculative decoding (needs the MTP block)"
)
_PREFIX = flags.DEFINE_enum("prefix_cache", "off", ["off", "on", "both"], "the engine's prefix cache")
_PREFIX_MB = flags.DEFINE_integer("prefix_cache_mb", 256, "prefix cache budget when on (MiB)")
_EXPERTS = flags.DEFINE_bool("distinct_experts", True, "replay the routing: distinct experts per decode step")
_OUT = flags.DEFINE_string("out", None, "write the rows as JSON here")
_PNG = flags.DEFINE_string("png", None, "plot the rows here (matplotlib)")
_NARROW = flags.DEFINE_enum(
    "narrow", "on", ["off", "on", "both"], "decode steps over the busy slots' width only"
)
_PREFILL_BATCH = flags.DEFINE_integer(
    "prefill_batch", 0, "the most waiting requests prefilled together (0: the engine's default, min(slots, 8))"
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "rounds over all settings (interleaved); each row is the round with its median total tokens/s"
)
_STEP_COSTS = flags.DEFINE_bool("step_costs", False, "time the decode step alone per slots / compile options")
_ROUNDS = flags.DEFINE_integer("rounds", 200, "--step_costs: calls of each program (interleaved)")
_MIXED = flags.DEFINE_integer("mixed", 0, "serve N mixed-length streams, paged vs contiguous caches (0: off)")
_MIXED_TOKENS = flags.DEFINE_integer("mixed_cache_tokens", 16384, "--mixed: DSA cache tokens of both modes")
_MIXED_LENGTHS = flags.DEFINE_list("mixed_lengths", ["16", "4096"], "--mixed: lo,hi of prompt + max_new")
_MIXED_SHARE = flags.DEFINE_float("mixed_prompt_share", 0.75, "--mixed: the prompt's share of each total")
_MIXED_PAGE = flags.DEFINE_integer("mixed_page_tokens", 16, "--mixed: tokens per page (paged mode)")
_MIXED_SEED = flags.DEFINE_integer("mixed_seed", 0, "--mixed: the lengths' seed")
_MOE_IMPL = cli.define_moe_impl_flag()

# --step_costs: name -> compile options on top of the engine's CPU defaults (None: drop that default)
STEP_OPTIONS = {
    "engine default": {},
    "YNNPACK fusions on (XLA's default)": {"xla_cpu_experimental_ynn_fusion_type": None},
    "YNNPACK fusions off": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


def _settings(flag: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[flag]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        streams = [int(s) for s in _STREAMS.value]
    except ValueError:
        raise app.UsageError(f"--streams: not a list of integers: {_STREAMS.value}") from None
    for name, v in (
        ("streams", min(streams, default=0)),
        ("prompt_len", _PROMPT_LEN.value),
        ("max_new", _MAX_NEW.value),
        ("prefix_cache_mb", _PREFIX_MB.value),
    ):
        if v < 1:
            raise app.UsageError(f"--{name}: must be >= 1")
    if not 0 <= _SHARED.value < _PROMPT_LEN.value:
        raise app.UsageError(f"--shared_prefix={_SHARED.value}: must be in [0, --prompt_len)")
    if _REPEATS.value < 1:
        raise app.UsageError(f"--repeats={_REPEATS.value}: must be >= 1")
    if _PREFILL_BATCH.value < 0:
        raise app.UsageError(f"--prefill_batch={_PREFILL_BATCH.value}: must be >= 0")
    if _SLOTS.value and _SLOTS.value < max(streams):
        raise app.UsageError(f"--slots={_SLOTS.value}: fewer than the {max(streams)} streams")
    if _MIXED.value < 0:
        raise app.UsageError(f"--mixed={_MIXED.value}: must be >= 0")
    if _MIXED.value and (_STEP_COSTS.value or distributed.process_count() > 1):
        raise app.UsageError("--mixed: one process, without --step_costs")
    mtp_settings = _settings(_MTP.value)
    with_mtp = True in mtp_settings
    weights, label = assets.resolve(_WEIGHTS.value, _CONFIG.value)
    kernels = cli.kernel_config(_CONFIG.value, _MOE_IMPL)
    several, main_process = distributed.process_count() > 1, distributed.is_main_process()
    say = print if main_process else (lambda *a, **k: None)
    narrow_settings, run = _settings(_NARROW.value), None
    if several:
        # Several processes: the sharded model; process 0 leads every engine, the others replay (module docstring)
        if _STEP_COSTS.value:
            raise app.UsageError("--step_costs: one process only")
        if _PREFIX.value != "off":
            raise app.UsageError(
                "--prefix_cache: must be off with several processes (not replayed across them)"
            )
        run = build.sharded_model(_CONFIG.value, weights=weights, with_mtp=with_mtp, kernels=kernels)
        cfg, model = run.cfg, run.model
        if _NARROW.value != "off":
            say(
                "several processes: decode steps over all slots (no narrow widths on a sharded model)",
                flush=True,
            )
        narrow_settings = [False]
    elif weights is None:
        cfg = model_config_from_dict(_CONFIG.value.model)
        model = build.random_model(cfg, seed=_CONFIG.value.seed, with_mtp=with_mtp, kernels=kernels)
    else:
        cfg, model = build.load_model(weights, with_mtp=with_mtp, kernels=kernels)
        model = build.apply_runtime_fields(model, _CONFIG.value)  # e.g. --config with model.scan_layers
    if with_mtp and model.mtp is None:
        raise app.UsageError("--mtp: this model has no MTP block")
    placed = dict(mesh=run.mesh, rules=run.rules) if run is not None else {}
    say(build.describe_model(model, **placed, config_name=cli.config_name("config"), weights=weights,
                             seed=_CONFIG.value and _CONFIG.value.seed, label=label), flush=True)  # fmt: skip
    if _STEP_COSTS.value:
        return _step_costs(model, streams)
    if _MIXED.value:
        return _mixed(model, cfg.vocab_size, label or weights)
    rows, traces, setups = [], [], []
    for n in streams:
        for mtp in mtp_settings:
            for prefix, narrow in ((p, w) for p in _settings(_PREFIX.value) for w in narrow_settings):
                kw = {"speculative": True} if mtp else {}
                if _PREFILL_BATCH.value:
                    kw["prefill_batch"] = min(_PREFILL_BATCH.value, _SLOTS.value or n)
                if not narrow:
                    kw["decode_widths"] = (_SLOTS.value or n,)
                if prefix:
                    kw["prefix_cache_bytes"] = _PREFIX_MB.value << 20
                if several:
                    kw.update(mesh=run.mesh, rules=run.rules)
                sizes = dict(slots=_SLOTS.value or n, prompt_len=_PROMPT_LEN.value, max_new=_MAX_NEW.value)
                setups.append((n, dict(mtp=mtp, prefix_cache=prefix, narrow=narrow), sizes, kw))
    engines = {}
    for rep in range(_REPEATS.value):  # every setting once per round: the rounds interleave the settings
        for i, (n, tags, sizes, kw) in enumerate(setups):
            if i not in engines or several:  # several processes: one engine at a time (its own lead / follow)
                engines[i] = S.bench_engine(model, **sizes, engine_kwargs=kw)
            eng = engines[i]
            if several and not main_process:
                multihost.follow(eng)  # until process 0 has measured this row
                continue
            if several:
                multihost.lead(eng)
            if eng.prefix:
                eng.prefix.clear()  # each round from a cold prefix cache
            try:
                row, trace = S.run_streams(model, cfg.vocab_size, n, **sizes, shared=_SHARED.value, engine=eng)
            finally:
                if several:
                    multihost.stop(eng)
            row.update(tags)
            rows.append((i, rep, row, trace))
    rows, runs = S.median_rows(rows, len(setups))
    for row, trace in rows:
        if not row["mtp"]:
            traces.append((row, trace))
        n = row["streams"]
        extra = "".join(f"; {k} {row[k]:.2f}" if isinstance(row[k], float) else f"; {k} {row[k]}"
                        for k in ("decode_step_ms", "prefix_hit_tokens", "mtp_acceptance") if k in row)  # fmt: skip
        if _REPEATS.value > 1:
            extra += f"; median of {_REPEATS.value} rounds: " + " / ".join(f"{t:.1f}" for t in runs[n, S.setting(row)])
        print(f"{n:3d} streams, {S.setting(row)}: {row['total_tok_s']:8.1f} tok/s total, "
              f"{row['per_stream_tok_s']:7.1f} per stream; TTFT p50 {row['ttft_p50_ms']:.0f} / p99 "
              f"{row['ttft_p99_ms']:.0f} ms; ITL p50 {row['itl_p50_ms']:.1f} / p99 {row['itl_p99_ms']:.1f} ms; "
              f"{row['decode_steps']} steps{extra}", flush=True)  # fmt: skip
    rows = [r for r, _ in rows]
    if not main_process:
        return
    if _EXPERTS.value and several:
        print("several processes: no distinct-experts replay (one process only)")
    if _EXPERTS.value and not several:  # after the timed runs: instrumenting the routers changes nothing
        for row, trace in traces:
            row.update(S.distinct_experts(model, trace) or {})
            if "distinct_experts_per_layer_step" in row:
                print(f"{row['streams']:3d} streams, {S.setting(row)}: {row['distinct_experts_per_layer_step']:.1f} "
                      f"distinct experts per MoE layer per step ({row['pairs_per_layer_step']:.0f} (token, expert) pairs)"
                      + (f", {row['decode_step_ms']:.2f} ms per step" if "decode_step_ms" in row else ""))  # fmt: skip
    base = [r for r in rows if not r["mtp"] and not r["prefix_cache"] and r["narrow"]] or rows
    one = next((r for r in base if r["streams"] == 1), None)
    if one and len(base) > 1:
        print(f"{base[-1]['streams']} streams: {base[-1]['total_tok_s'] / one['total_tok_s']:.2f}x the total "
              f"tokens/s of 1 stream ({S.setting(base[-1])})")  # fmt: skip
    if _OUT.value:
        files.write_json(_OUT.value, {"model": label or weights, "rows": rows})
        startup.write_run_record(_OUT.value, _CONFIG.value)
    if _PNG.value:
        S.plot(rows, _PNG.value)


def _step_costs(model, streams: list[int]) -> None:
    rows = S.step_costs(model, streams, STEP_OPTIONS, max_len=_PROMPT_LEN.value + _MAX_NEW.value + 2,
                        rounds=_ROUNDS.value, full_slots=max(streams))  # fmt: skip
    p10 = {(r["slots"], r["options"]): r["step_p10_ms"] for r in rows}
    for r in rows:
        one = p10.get((1, r["options"]))
        print(f"{r['slots']:3d} slots, {r['options']}: decode step p10 {r['step_p10_ms']:.2f} ms (median "
              f"{r['step_p50_ms']:.2f})" + (f", {r['step_p10_ms'] / one:.2f}x 1 slot" if one else ""))  # fmt: skip
    if _OUT.value:
        files.write_json(_OUT.value, {"step_costs": rows})
        startup.write_run_record(_OUT.value, _CONFIG.value)


def _mixed(model, vocab: int, name) -> None:
    try:
        lo, hi = (int(v) for v in _MIXED_LENGTHS.value)
        lengths = S.mixed_lengths(_MIXED.value, lo, hi, _MIXED_SEED.value, _MIXED_SHARE.value)
    except ValueError as e:
        raise app.UsageError(f"--mixed_lengths={','.join(_MIXED_LENGTHS.value)}: two integers lo,hi ({e})") from None
    tokens, page = _MIXED_TOKENS.value, _MIXED_PAGE.value
    if tokens < hi or page < 1:
        raise app.UsageError(f"--mixed_cache_tokens={tokens} must hold one stream of {hi} tokens; "
                             f"--mixed_page_tokens={page} >= 1")  # fmt: skip
    print(f"{len(lengths)} streams of {sum(p + m for p, m in lengths)} tokens ({lo}..{hi} each: "
          f"{sum(p for p, _ in lengths)} prompt, {sum(m for _, m in lengths)} new)", flush=True)  # fmt: skip
    rows = []
    for label, kw in (("paged", dict(slots=len(lengths), cache_tokens=tokens, page_tokens=page)),
                      ("contiguous", dict(slots=tokens // hi))):  # fmt: skip
        row = S.run_mixed(model, vocab, lengths, max_len=hi, **kw)
        reasons = ", ".join(f"{k} {v}" for k, v in row["finish_reasons"].items())
        print(f"{label}: {row['slots']} slots, {row['cache_tokens']} cache tokens ({row['cache_bytes'] / 2**20:.1f} "
              f"MiB): {row['max_busy_slots']} streams at once; {row['tokens']} tokens in {row['seconds']:.1f} s = "
              f"{row['total_tok_s']:.1f} tok/s; TTFT p50 {row['ttft_p50_ms']:.0f} / p99 {row['ttft_p99_ms']:.0f} ms; "
              f"finished {row['finished']} ({reasons}; out of pages {row['finish_out_of_pages']}), page waits "
              f"{row['page_waits']}; peak RSS {row['peak_rss_mb']:.0f} MiB; compile {row['compile_s']:.1f} s",
              flush=True)  # fmt: skip
        rows.append(row)
    p, c = rows
    print(f"paged / contiguous: {p['total_tok_s'] / c['total_tok_s']:.2f}x the tokens/s, TTFT p50 "
          f"{p['ttft_p50_ms'] / c['ttft_p50_ms']:.2f}x, wall time {p['seconds'] / c['seconds']:.2f}x")  # fmt: skip
    if _OUT.value:
        files.write_json(_OUT.value, {"model": name, "mixed": rows})
        startup.write_run_record(_OUT.value, _CONFIG.value)


if __name__ == "__main__":
    cli.run(main)
