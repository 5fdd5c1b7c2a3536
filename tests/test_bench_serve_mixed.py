"""experiments.bench_serve --mixed (glm53.benchmarks.serve.run_mixed): mixed-length streams on paged caches against
contiguous caches of the same DSA cache tokens, on the tiny model. Counts that are exact: every stream finishes,
greedy streams without EOS generate exactly their max_new tokens (the pool holds every stream's pages at once, so
none runs out), and the paged engine holds more streams at once than the contiguous one's slots."""

import json

import pytest

from configs import tiny
from glm53 import build, files
from glm53.benchmarks import serve as S
from glm53.config import model_config_from_dict

FAST = {"compiler_options": {"xla_backend_optimization_level": 0}, "prefill_batch": 1}
PT = 4  # tokens per page (a multiple of the tiny model's index_kpool)
LENGTHS = [(3, 30), (2, 20), (4, 12), (1, 6), (2, 25), (3, 9)]  # (prompt, max_new): totals 7 .. 33
MAX_LEN = 40
CACHE_TOKENS = 128  # 32 pages >= the 31 the six streams need together; contiguous: 128 // 40 = 3 slots
FIELDS = ("mode", "streams", "slots", "max_len", "cache_tokens", "cache_bytes", "prompt_tokens", "max_new_tokens",
          "max_busy_slots", "tokens", "seconds", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms", "finished",
          "finish_reasons", "finish_out_of_pages", "page_waits", "decode_steps", "peak_rss_mb")  # fmt: skip


@pytest.fixture(scope="module")
def rows():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = build.random_model(cfg, seed=0, with_mtp=False)
    kw = dict(max_len=MAX_LEN, buckets=(1, 4), engine_kwargs=FAST)
    paged = S.run_mixed(model, cfg.vocab_size, LENGTHS, slots=len(LENGTHS), cache_tokens=CACHE_TOKENS,
                        page_tokens=PT, **kw)  # fmt: skip
    contiguous = S.run_mixed(model, cfg.vocab_size, LENGTHS, slots=CACHE_TOKENS // MAX_LEN, **kw)
    return paged, contiguous


def test_mixed_lengths_deterministic_in_range():
    a = S.mixed_lengths(32, 16, 4096, seed=0)
    assert a == S.mixed_lengths(32, 16, 4096, seed=0) != S.mixed_lengths(32, 16, 4096, seed=1)
    assert len(a) == 32 and all(p >= 1 and m >= 1 and 16 <= p + m <= 4096 for p, m in a)
    assert max(p + m for p, m in a) > 8 * min(p + m for p, m in a)  # spread, not one length
    assert all(p == min(max(1, int((p + m) * 0.75)), p + m - 1) for p, m in a)
    prompts = S.mixed_prompts(a, 128)
    assert [len(p) for p in prompts] == [p for p, _ in a] and len({tuple(p[:8]) for p in prompts}) > 1
    with pytest.raises(ValueError):
        S.mixed_lengths(4, 1, 10)


def test_every_stream_finishes_with_its_max_new(rows):
    for row in rows:
        assert row["finished"] == row["streams"] == len(LENGTHS)
        assert row["finish_reasons"] == {"length": len(LENGTHS)}  # max_tokens (no EOS)
        assert row["finish_out_of_pages"] == 0
        assert row["tokens"] == row["max_new_tokens"] == sum(m for _, m in LENGTHS)
        assert row["prompt_tokens"] == sum(p for p, _ in LENGTHS)
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["seconds"] > 0 and row["peak_rss_mb"] > 0


def test_paged_holds_more_streams_at_the_same_cache_tokens(rows):
    paged, contiguous = rows
    assert paged["mode"] == "paged" and contiguous["mode"] == "contiguous"
    assert paged["cache_tokens"] == CACHE_TOKENS and contiguous["cache_tokens"] == 3 * MAX_LEN
    assert contiguous["slots"] == 3 and contiguous["max_busy_slots"] <= 3 and contiguous["page_waits"] == 0
    assert paged["max_busy_slots"] > contiguous["max_busy_slots"]
    assert paged["page_tokens"] == PT and contiguous["page_tokens"] is None


def test_row_fields_in_the_json(rows, tmp_path):
    path = tmp_path / "mixed.json"
    files.write_json(path, {"model": None, "mixed": list(rows)})
    back = json.loads(path.read_text())["mixed"]
    for row in back:
        assert all(k in row for k in FIELDS), [k for k in FIELDS if k not in row]
