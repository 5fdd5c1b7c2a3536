"""glm53.serving.pages: the page pool, per-stream page tables, prefix sharing with copy-on-write, admission.

The random lifetimes are checked against a model of their own (which pages each stream holds, a storage of
row contents written through the tables), not against the pool's bookkeeping."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from glm53.serving.pages import ADMIT, REJECT, WAIT, Admission, Copy, OutOfPages, PagePool, PageTable, spread


def snapshot(pool: PagePool, *tables: PageTable):
    return pool.free_per_device(), pool.refs.copy(), [(t.pages, t.length) for t in tables]


def same(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_pool_layout_scratch_and_counts():
    pool = PagePool(12, 4, devices=3)
    assert pool.pages_per_device == 4 and pool.capacity == 9
    assert [pool.scratch(d) for d in range(3)] == [0, 4, 8]
    assert [pool.device_of(p) for p in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert pool.free_per_device() == (3, 3, 3) and pool.free_count() == 9 and pool.free_count(1) == 3
    t = PageTable(pool)
    t.ensure(5 * 4)  # five pages: devices 0 1 2 0 1
    assert [pool.device_of(p) for p in t.pages] == [0, 1, 2, 0, 1]
    assert not {pool.scratch(d) for d in range(3)} & set(t.pages)
    assert pool.free_per_device() == (1, 1, 2)
    assert t.release() == 5 and pool.free_count() == 9 and not pool.refs.any()
    for bad in ((7, 4, 2), (2, 4, 2), (4, 0, 1), (4, 4, 0)):
        with pytest.raises(ValueError):
            PagePool(*bad)


def test_out_of_pages_names_needed_and_free_and_changes_nothing():
    pool = PagePool(8, 2, devices=2)  # 3 usable pages per device
    a, b = PageTable(pool), PageTable(pool)
    a.ensure(7)  # 4 pages: 2 per device
    before = snapshot(pool, a, b)
    with pytest.raises(OutOfPages) as e:
        b.ensure(2 * 5)  # 5 pages: 3 on device 0, 2 on device 1; free 1 + 1
    assert (e.value.needed, e.value.free) == (5, 2)
    assert e.value.needed_per_device == (3, 2) and e.value.free_per_device == (1, 1)
    assert "needed 5, free 2" in str(e.value)
    assert same(before, snapshot(pool, a, b))
    with pytest.raises(OutOfPages):  # growing a table that holds pages: still nothing taken
        a.ensure(2 * 7)
    assert same(before, snapshot(pool, a, b))
    with pytest.raises(OutOfPages, match="needed 1, free 0$"):
        one = PagePool(2, 4)
        PageTable(one).ensure(4)
        PageTable(one).ensure(1)


def test_pad_is_each_entrys_scratch_page():
    pool = PagePool(12, 3, devices=4)
    t = PageTable(pool)
    t.ensure(3 * 5)
    row = t.as_array(8)
    assert row.dtype == np.int32 and row.shape == (8,)
    assert list(row[:5]) == list(t.pages)
    # every entry is a valid page on device i % 4, and the pad is that device's scratch page
    for i in range(8):
        assert 0 <= row[i] < pool.num_pages and pool.device_of(int(row[i])) == i % 4
        if i >= 5:
            assert row[i] == pool.scratch(i % 4) and pool.refs[row[i]] == 0
    assert list(PageTable(pool).as_array(3)) == [0, 3, 6]
    with pytest.raises(ValueError, match="max_pages=4"):
        t.as_array(4)


def test_share_prefix_full_pages_and_copy_on_write():
    pool = PagePool(16, 4)
    a = PageTable(pool)
    a.ensure(10)  # 3 pages, the last one partial
    b = PageTable(pool)
    assert b.share_prefix(a, 8) == []  # two full pages
    assert b.pages == a.pages[:2] and b.length == 8 and list(pool.refs[list(a.pages[:2])]) == [2, 2]
    c = PageTable(pool)
    copies = c.share_prefix(a, 10)
    assert copies == [Copy(a.pages[2], c.pages[2], 2)] and c.pages[:2] == a.pages[:2]
    assert pool.refs[c.pages[2]] == 1 and pool.refs[a.pages[2]] == 1
    with pytest.raises(ValueError):
        c.share_prefix(a, 4)  # not empty
    with pytest.raises(ValueError):
        PageTable(pool).share_prefix(a, 11)  # more than a holds
    a.release()
    assert list(pool.refs[list(b.pages)]) == [2, 2]
    b.release(), c.release()
    assert pool.free_count() == pool.capacity and not pool.refs.any()
    full = PagePool(4, 4)  # 3 usable
    x = PageTable(full)
    x.ensure(11)
    before = snapshot(full, x)
    with pytest.raises(OutOfPages):  # the partial page's copy needs a page: none free, nothing shared
        PageTable(full).share_prefix(x, 6)
    assert same(before, snapshot(full, x))


def test_incref_decref_of_unused_pages_raise():
    pool = PagePool(4, 2)
    for f in (pool.incref, pool.decref):
        for p in (0, 1, 4, -1):
            with pytest.raises(ValueError):
                f(p)


def test_spread_counts():
    for d in (1, 2, 3, 5):
        for a in range(12):
            for b in range(a, 20):
                want = collections.Counter(i % d for i in range(a, b))
                assert spread(a, b, d) == [want[k] for k in range(d)]


def test_admission_decisions():
    pool = PagePool(10, 4)  # 9 usable pages = 36 tokens
    adm = Admission(pool)
    assert adm.decide(35, 100) == ADMIT and adm.decide(36, 1) == REJECT
    adm.start("a", 20, 100)  # prompt + 1 token: 6 pages
    assert adm.decide(11, 1) == ADMIT and adm.decide(11, 50) == ADMIT and adm.decide(12, 1) == WAIT
    with pytest.raises(OutOfPages):
        adm.start("b", 12, 1)
    assert "b" not in adm.tables and pool.free_count() == 3
    assert adm.grow("a", 32) and not adm.grow("a", 37)  # the pool is full: finish "a" with "length"
    assert adm.end("a") == 8 and adm.end("a") == 0 and pool.free_count() == 9
    res = Admission(PagePool(10, 4), reserve=True)
    assert res.decide(4, 33) == REJECT and res.decide(4, 32) == ADMIT
    res.start("a", 4, 12)  # holds 2 pages (5 tokens), 2 more reserved: 5 of the 7 free are not
    assert res.decide(4, 16) == ADMIT and res.decide(4, 17) == WAIT
    res.start("b", 4, 16)  # holds 2, 3 more reserved: no free page left unreserved
    assert res.decide(1, 1) == WAIT and not res.grow("a", 17) and res.grow("a", 16) and res.grow("b", 20)
    assert res.pool.free_count() == 0


@pytest.mark.parametrize("devices,page_tokens,pages,reserve", [(1, 1, 64, False), (1, 4, 48, True),
                                                              (2, 3, 40, False), (4, 4, 64, False),
                                                              (3, 16, 30, True)])  # fmt: skip
def test_random_lifetimes_leak_nothing(devices, page_tokens, pages, reserve):
    """Thousands of request lifetimes (admit, share a prefix, grow step by step, cancel, fail, finish, hit the
    pool's end) checked against an independent model after every operation."""
    rng = np.random.default_rng(devices * 1000 + page_tokens)
    pool = PagePool(pages, page_tokens, devices)
    adm = Admission(pool, reserve=reserve)
    scratch = {pool.scratch(d) for d in range(devices)}
    start_free = pool.free_count()
    held: dict[int, list[int]] = {}  # the model: stream -> pages in token order
    seq: dict[int, list[int]] = {}  # stream -> the values of its tokens written so far
    shared_from: dict[int, set[int]] = {}  # stream -> pages it received from another stream's table
    store: dict[int, dict[int, int]] = collections.defaultdict(dict)  # page -> row -> value
    limit: dict[int, int] = {}
    counts = collections.Counter()

    def write(k, n):  # the stream's next n tokens, through its table; never into a page another stream holds
        t = adm.tables[k]
        for pos in range(len(seq[k]), len(seq[k]) + n):
            page, row = t.locate(pos)
            assert sum(page in h for h in held.values()) == 1, "write into a shared page"
            v = int(rng.integers(1 << 30))
            store[page][row] = v
            seq[k].append(v)

    def check():
        owners = collections.Counter(p for h in held.values() for p in h)
        assert all(pool.refs[p] == owners[p] for p in range(pool.num_pages))
        assert pool.free_count() == start_free - len(owners) and not owners.keys() & scratch
        for k, h in held.items():
            t = adm.tables[k]
            assert list(t.pages) == h
            per = collections.Counter(pool.device_of(p) for p in h)
            assert all(pool.device_of(p) == i % devices for i, p in enumerate(h))
            assert max(per[d] for d in range(devices)) - min(per[d] for d in range(devices)) <= 1
            for p in h:  # a page two streams hold came to one of them by share_prefix
                if owners[p] > 1:
                    assert any(p in shared_from[o] for o in held if p in held[o])
            for pos, v in enumerate(seq[k]):  # every token reads back what this stream wrote or shared
                page, row = t.locate(pos)
                assert store[page][row] == v
            row = t.as_array(len(h) + 3)
            assert all(0 <= x < pool.num_pages for x in row) and set(row[len(h) :].tolist()) <= scratch

    next_id = 0
    for step in range(6000):
        op = rng.choice(["new", "grow", "grow", "grow", "end"], p=[0.3, 0.2, 0.2, 0.15, 0.15])
        if op == "new":
            prompt, max_new = int(rng.integers(1, 3 * page_tokens * 4)), int(rng.integers(1, 4 * page_tokens))
            if rng.random() < 0.02:  # more than the pool holds: refused at once
                prompt = pool.capacity * page_tokens + int(rng.integers(0, page_tokens))
            share = None
            if held and rng.random() < 0.5:
                other = int(rng.choice(list(held)))
                share = (other, int(rng.integers(0, min(prompt, len(seq[other])) + 1)))
            decision = adm.decide(prompt, max_new)
            counts[decision] += 1
            if decision != ADMIT:
                before = snapshot(pool, *adm.tables.values())
                with pytest.raises(OutOfPages):
                    adm.start(next_id, prompt, max_new, share)
                assert same(before, snapshot(pool, *adm.tables.values())) and next_id not in adm.tables
                continue
            k, next_id = next_id, next_id + 1
            t, copies = adm.start(k, prompt, max_new, share)
            held[k], limit[k], seq[k] = list(t.pages), prompt + max_new, []
            shared_from[k] = set()
            if share is not None:
                o, n = share
                full = n // page_tokens
                shared_from[k] = set(held[o][:full])
                for c in copies:  # the caller's copy-on-write of the partial page
                    assert pool.refs[c.dst] == 1 and c.src == held[o][full] and c.rows == n % page_tokens
                    store[c.dst].update({r: v for r, v in store[c.src].items() if r < c.rows})
                seq[k] = seq[o][:n]
            write(k, prompt - len(seq[k]))  # the prefill
            counts["shared"] += share is not None and share[1] > 0
        elif op == "grow" and held:
            k = int(rng.choice(list(held)))
            n = int(rng.integers(1, 3))  # one decode step (or two tokens: MTP)
            if len(seq[k]) + n > limit[k]:
                counts["finish"] += 1
                adm.end(k), held.pop(k)
            elif adm.grow(k, len(seq[k]) + n):
                held[k] = list(adm.tables[k].pages)
                write(k, n)
            else:
                assert not reserve, "a reserved stream could not grow within its limit"
                counts["length"] += 1
                adm.end(k), held.pop(k)
        elif op == "end" and held:  # cancelled, failed or stopped early: the same release
            k = int(rng.choice(list(held)))
            counts["cancel"] += 1
            adm.end(k), held.pop(k)
        if step % 7 == 0 or not held:
            check()
    check()
    for k in list(held):
        adm.end(k), held.pop(k)
    assert pool.free_count() == start_free == pool.capacity and not pool.refs.any() and not adm.tables
    assert counts[ADMIT] > 100 and counts["shared"] > 20 and counts["cancel"] > 50 and counts[WAIT] > 0
    assert counts[REJECT] > 0
    if not reserve:
        assert counts["length"] > 0
