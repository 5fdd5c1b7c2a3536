"""Benchmark the serving engine: total and per-stream tokens/s, time to first token and inter-token latency.

  python -m experiments.bench_serve                                   # the shipped model, 1 2 4 8 streams
  python -m experiments.bench_serve --config=configs/tiny.py --streams=1,2 --max_new=8 --out=/tmp/b.json

For each stream count N: an engine of --slots slots (default: N, the smallest batch that holds them) is compiled
and warmed, then N requests (different prompts of --prompt_len tokens, greedy, --max_new tokens each, no EOS)
are submitted at once and run to completion in this thread. Reported per N: total tokens/s, per-stream tokens/s,
time to first token (from submission) and inter-token latency, p50 / p99 in ms, and the decode steps. The last
line is the ratio of the largest N's total tokens/s to one stream's. --out writes the rows as JSON.
"""

import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from glm53 import assets, build, files
from glm53.config import model_config_from_dict
from glm53.serving import engine as E

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config: its random model", lock_config=True
)
_WEIGHTS = flags.DEFINE_string("weights", None, "weights (default: the shipped glm53-mini)")
_STREAMS = flags.DEFINE_list("streams", ["1", "2", "4", "8"], "concurrent stream counts")
_SLOTS = flags.DEFINE_integer("slots", 0, "engine slots (0: as many as streams)")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "prompt tokens per stream")
_MAX_NEW = flags.DEFINE_integer("max_new", 64, "tokens generated per stream")
_OUT = flags.DEFINE_string("out", None, "write the rows as JSON here")


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1000 if len(xs) else float("nan")


def bench(model, vocab: int, n: int, slots: int, prompt_len: int, max_new: int) -> dict:
    eng = E.Engine(model, slots=slots, max_len=prompt_len + max_new + 1, buckets=(1, 16), eos_ids=())
    eng.warmup()
    E.generate(eng, [E.Request([1] * prompt_len, max_tokens=2)])  # one untimed request
    times: dict[str, list[float]] = {}
    reqs = [E.Request([(7 * i + j) % vocab for j in range(prompt_len)], max_tokens=max_new) for i in range(n)]
    steps0 = eng.stats["steps"]
    t0 = time.perf_counter()
    for r in reqs:
        eng.submit(r, lambda ev: times.setdefault(ev.request_id, []).append(time.perf_counter()))
    eng.run_until_idle()
    dt = time.perf_counter() - t0
    ttft = [ts[0] - t0 for ts in times.values()]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    total = sum(len(ts) for ts in times.values())
    return {"streams": n, "slots": slots, "tokens": total, "seconds": dt, "total_tok_s": total / dt,
            "per_stream_tok_s": total / dt / n, "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99), "decode_steps": eng.stats["steps"] - steps0}  # fmt: skip


_MOE_IMPL = cli.define_moe_impl_flag()


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
    ):
        if v < 1:
            raise app.UsageError(f"--{name}: must be >= 1")
    if _SLOTS.value and _SLOTS.value < max(streams):
        raise app.UsageError(f"--slots={_SLOTS.value}: fewer than the {max(streams)} streams")
    weights, label = assets.resolve(_WEIGHTS.value, _CONFIG.value)
    if weights is None:
        cfg = model_config_from_dict(_CONFIG.value.model)
        model = build.random_model(
            cfg, seed=_CONFIG.value.seed, with_mtp=False, kernels={"moe": _MOE_IMPL.value}
        )
    else:
        cfg, model = build.load_model(weights, with_mtp=False, kernels={"moe": _MOE_IMPL.value})
    print(label or weights or f"config {cli.config_name('config')} (random weights)", flush=True)
    rows = []
    for n in streams:
        row = bench(model, cfg.vocab_size, n, _SLOTS.value or n, _PROMPT_LEN.value, _MAX_NEW.value)
        rows.append(row)
        print(f"{n:3d} streams, {row['slots']} slots: {row['total_tok_s']:8.1f} tok/s total, "
              f"{row['per_stream_tok_s']:7.1f} per stream; TTFT p50 {row['ttft_p50_ms']:.0f} / p99 "
              f"{row['ttft_p99_ms']:.0f} ms; ITL p50 {row['itl_p50_ms']:.1f} / p99 {row['itl_p99_ms']:.1f} ms; "
              f"{row['decode_steps']} steps", flush=True)  # fmt: skip
    one = next((r for r in rows if r["streams"] == 1), None)
    if one and len(rows) > 1:
        print(f"{rows[-1]['streams']} streams: {rows[-1]['total_tok_s'] / one['total_tok_s']:.2f}x the total "
              f"tokens/s of 1 stream")  # fmt: skip
    if _OUT.value:
        files.write_json(_OUT.value, {"model": label or weights, "rows": rows})


if __name__ == "__main__":
    cli.run(main)
