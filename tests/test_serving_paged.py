"""The serving engine on paged caches (Engine(cache_tokens=...), docs/serving.md "Paged caches").

Reference: `serving_helpers.greedy_alone` (a batch-1 contiguous cache, one token per step, argmax in numpy) on each
prompt alone. On pages, batched greedy decoding with requests joining, leaving, sharing prefixes and running out
of pages must give exactly its tokens (or a prefix of them, ended "length", for a stream that could not grow),
pages must all come back, and nothing may compile after warm-up.
"""

import numpy as np
import pytest
from serving_helpers import greedy_alone

from configs import tiny
from glm53 import build
from glm53.config import model_config_from_dict
from glm53.serving import engine as E
from glm53.testing.params import randomize_params

FAST = {"xla_backend_optimization_level": 0}
PT = 8  # tokens per page (also the prefix cache's block)
_rng = np.random.default_rng(4)
SYSTEM = [int(t) for t in _rng.integers(1, 128, 19)]  # a shared "system prompt" of 2 full pages + 3 tokens
PROMPTS = [SYSTEM + [5, 6], [9, 4, 4, 9, 30], SYSTEM + [7], [3] * 20, SYSTEM[:16] + [1, 2, 3], [7]]
MAX_NEW = [12, 9, 6, 10, 8, 14]


@pytest.fixture(scope="module")
def setup():
    cfg = model_config_from_dict(tiny.get_config().model)
    model = randomize_params(build.random_model(cfg, seed=0, with_mtp=False))
    ref = [greedy_alone(model, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    return model, ref, _engine(model, prefix_cache_bytes=1 << 20)  # one warm-up for the tests that share it


def _engine(model, **kw):
    args = dict(slots=3, max_len=64, buckets=(1, 8), max_queue=16, compiler_options=FAST, cache_tokens=96,
                page_tokens=PT, prefix_block=PT)  # fmt: skip
    eng = E.Engine(model, **{**args, **kw})
    eng.warmup()
    return eng


def _all_free(eng):
    """Every page back in the pool once the prefix cache (if any) lets its blocks go."""
    if eng.prefix:
        eng.prefix.clear()
    return eng.pool.free_count() == eng.pool.capacity and not eng.pool.refs.any()


def test_paged_greedy_equals_alone_with_prefix_sharing(setup):
    model, ref, eng = setup
    n0 = eng.compiled_programs()
    for _ in range(2):  # the second round resumes the shared system prompt's pages from the prefix cache
        assert E.generate(eng, [E.Request(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)]) == ref
    assert eng.stats["prefix_hits"] >= 4 and eng.stats["prefix_hit_tokens"] >= 4 * PT
    assert eng.compiled_programs() == n0
    # the prefix cache holds pages (no copy of rows); once it lets them go, every page is free again
    held = int((eng.pool.refs > 0).sum())
    assert held == eng.prefix.blocks > 0
    assert _all_free(eng) and eng.idle()


def test_out_of_pages_ends_with_length_and_never_corrupts(setup):
    """A pool of 6 usable pages for 3 slots: streams outgrow it; the one that cannot grow ends "length" with a
    prefix of its tokens, the others go on exactly; requests wait for pages instead of failing."""
    model, ref, _ = setup
    eng = _engine(model, cache_tokens=48)
    events: dict[str, list] = {}
    reqs = [E.Request(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)]
    for r in reqs:
        eng.submit(r, lambda e: events.setdefault(e.request_id, []).append(e))
    eng.run_until_idle()
    lengths = 0
    for r, want in zip(reqs, ref):
        got = [t for e in events[r.id] for t in e.token_ids]
        last = events[r.id][-1]
        assert got == want[: len(got)], r.id
        assert last.finish_reason == "length" and got  # max_tokens, or no page to grow into
        lengths += len(got) < len(want)
    assert lengths >= 1 and eng.stats["finish_out_of_pages"] == lengths
    assert eng.stats["page_waits"] >= 1
    assert _all_free(eng)


def test_cancel_and_failure_free_pages(setup):
    model, ref, eng = setup
    ev = {}
    ids = [eng.submit(E.Request(p, max_tokens=n), lambda e: ev.setdefault(e.request_id, []).append(e))
           for p, n in zip(PROMPTS[:3], MAX_NEW)]  # fmt: skip
    for _ in range(4):
        eng.step()
    assert eng.pool.free_count() < eng.pool.capacity
    eng.cancel(ids[1])
    real = dict(eng.programs.fns)

    def boom(*a, **k):
        raise RuntimeError("injected")

    eng.programs.fns.update({k: boom for k in real if k[0] == "decode"})  # a failed step: every slot's request ends
    try:
        while not eng.stats["step_failures"]:
            eng.step()
    finally:
        eng.programs.fns.update(real)
    eng.run_until_idle()
    assert ev[ids[1]][-1].finish_reason == "cancelled" and eng.stats["step_failures"] == 1  # the prefix cache: emptied
    assert ev[ids[0]][-1].finish_reason == "error"
    assert _all_free(eng)
    assert E.generate(eng, [E.Request(PROMPTS[0], max_tokens=MAX_NEW[0])]) == [ref[0]]
    assert _all_free(eng)


def test_bad_paging_options_named(setup):
    model, *_ = setup
    with pytest.raises(ValueError, match="page_tokens=6: must be a multiple of index_kpool=4"):
        E.Engine(model, slots=1, max_len=16, cache_tokens=32, page_tokens=6)
    with pytest.raises(ValueError, match="prefix_block=16: on paged caches"):
        E.Engine(model, slots=1, max_len=16, cache_tokens=32, page_tokens=8, prefix_cache_bytes=1000)
    with pytest.raises(ValueError, match="cache_tokens=0"):
        E.Engine(model, slots=1, max_len=16, cache_tokens=0)
    eng = E.Engine(model, slots=1, max_len=64, cache_tokens=16, page_tokens=8, compiler_options=FAST)
    with pytest.raises(ValueError, match="context holds 16"):
        eng.check(E.Request([1] * 20, max_tokens=1))


def test_paged_equals_contiguous_on_the_shipped_model():
    """The shipped glm53-mini (trained weights: no symmetry to hide a wrong page) on paged and contiguous
    caches: the same greedy tokens for prompts that cross pages, decoded together."""
    from glm53 import assets

    model = build.load_model(assets.require_default_model(), with_mtp=False)[1]
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, model.cfg.vocab_size, n)] for n in (5, 37, 20)]
    kw = dict(slots=3, max_len=96, buckets=(1, 16), compiler_options=FAST)
    outs = []
    for paged in (dict(cache_tokens=192, page_tokens=16), {}):
        eng = E.Engine(model, **kw, **paged)
        outs.append(E.generate(eng, [E.Request(p, max_tokens=14) for p in prompts]))
    assert outs[0] == outs[1] and all(len(o) == 14 for o in outs[0])


def test_speculative_on_pages_equals_plain_greedy(setup):
    """MTP speculative decoding on paged caches (no prefix cache): two positions written per step (the draft's
    row may start a page, or fall past the table at the context's end: scratch), greedy output exact."""
    cfg = model_config_from_dict(tiny.get_config().model)
    model = randomize_params(build.random_model(cfg, seed=0, with_mtp=True))
    w = np.asarray(model.lm_head.kernel[...])  # 5 of 128 tokens only: the random MTP block's drafts are often right
    keep = np.zeros_like(w)
    keep[:, [3, 17, 42, 99, 120]] = 4 * w[:, [3, 17, 42, 99, 120]]
    model.lm_head.kernel[...] = keep
    prompts, new = [*PROMPTS[:2], SYSTEM[:20], PROMPTS[4]], [12, 9, 28, 10]  # 20 + 28: the context's end (48)
    reqs = [E.Request(p, max_tokens=n) for p, n in zip(prompts, new)]
    eng = _engine(model, speculative=True, max_len=48, decode_widths=(3,), prefill_batch=1)
    got = E.generate(eng, reqs)
    assert got == [greedy_alone(model, p, n, max_len=48) for p, n in zip(prompts, new)]
    assert eng.stats["mtp_accepted"] > 0 and _all_free(eng)
