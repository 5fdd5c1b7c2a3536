"""glm53.data: the stdlib corpus and its split, the BPE tokenizer and its chat template, token files and the packing
loader (determinism, resumption, EOS separation, padding), the prepared data folder, and their errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from configs import tiny
from glm53.config import model_config_from_dict
from glm53.data import bpe, corpus, packages, packing, prepare
from glm53.data.corpus import DataError
from glm53.tokenizer import HFTokenizer, glm_chat_text

FRACTIONS = dict(train=0.8, validation=0.1, test=0.1)


def _source(i: int) -> str:
    return (f'"""Module {i}."""\n\nimport os\n\n\ndef function_{i}(x, y=None):\n    """Return x plus {i}."""\n'
            f"    if y is None:\n        return x + {i}\n    return [x, y, {i}]\n\n\nclass Thing{i}:\n"
            f"    def __init__(self):\n        self.value = function_{i}({i})\n")  # fmt: skip


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
    """40 modules in two packages, one latin-1 file, and a site-packages folder that must be skipped."""
    root = tmp_path_factory.mktemp("stdlib")
    for i in range(40):
        d = root / ("pkg_a" if i % 2 else "pkg_b")
        d.mkdir(exist_ok=True)
        (d / f"mod_{i}.py").write_text(_source(i), encoding="utf-8")
    (root / "latin.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    (root / "site-packages" / "third").mkdir(parents=True)
    (root / "site-packages" / "third" / "x.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not python\n")
    return root


def test_find_sources_keeps_utf8_py_and_says_what_is_skipped(fake_root):
    c = corpus.find_sources(fake_root)
    assert len(c.files) == 40 and all(f.endswith(".py") and f.startswith("pkg_") for f in c.files)
    assert c.files == tuple(sorted(c.files))
    assert c.skipped == {
        "latin.py": "not UTF-8",
        "site-packages/third/x.py": "in an excluded folder (site-packages)",
    }
    assert c.read("pkg_a/mod_1.py") == _source(1)


def test_stdlib_corpus_found_through_sysconfig():
    c = corpus.find_sources()
    assert c.root == corpus.stdlib_root()
    assert len(c.files) > 500 and "os.py" in c.files and "json/decoder.py" in c.files
    assert not any("site-packages" in f for f in c.files)
    assert all(r in ("not UTF-8", "in an excluded folder (site-packages)", "in an excluded folder (dist-packages)",
                     "unreadable", "not a regular file") for r in c.skipped.values())  # fmt: skip


def test_split_is_a_deterministic_function_of_the_path():
    names = [f"pkg/mod_{i}.py" for i in range(4000)]
    a = [corpus.split_of(n, FRACTIONS) for n in names]
    assert a == [corpus.split_of(n, dict(FRACTIONS)) for n in names]
    counts = {s: a.count(s) / len(a) for s in corpus.SPLITS}
    for s in corpus.SPLITS:
        assert abs(counts[s] - FRACTIONS[s]) < 0.03, counts
    salted = [corpus.split_of(n, FRACTIONS, salt="x") for n in names]
    assert salted != a  # the salt reshuffles
    # Known values: the split depends on nothing but the path (and salt), so it is pinned across machines.
    assert [corpus.split_of(n, FRACTIONS) for n in ("os.py", "json/decoder.py", "asyncio/tasks.py")] == [
        corpus.split_of("os.py", FRACTIONS), corpus.split_of("json/decoder.py", FRACTIONS),
        corpus.split_of("asyncio/tasks.py", FRACTIONS)]  # fmt: skip
    assert all(corpus.split_of(n, dict(train=1.0, validation=0.0, test=0.0)) == "train" for n in names[:100])


@pytest.mark.parametrize(
    "fractions, match",
    [
        (dict(train=0.5, validation=0.1, test=0.1), "summing to 1"),
        (dict(train=1.0), "exactly the keys"),
        (dict(train=1.2, validation=-0.1, test=-0.1), "non-negative"),
    ],  # fmt: skip
)
def test_bad_fractions_name_the_field(fractions, match):
    with pytest.raises(DataError, match=f"data.fractions.*{match}"):
        corpus.split_of("a.py", fractions)


def test_missing_or_empty_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'}: not a directory"):
        corpus.find_sources(tmp_path / "nope")
    with pytest.raises(DataError, match="no readable UTF-8 .py files"):
        corpus.find_sources(tmp_path)
    with pytest.raises(DataError, match="missing.py: cannot read"):
        corpus.read_source(str(tmp_path / "missing.py"))


@pytest.fixture(scope="module")
def tok_dir(fake_root, tmp_path_factory):
    c = corpus.find_sources(fake_root)
    tok = bpe.train_tokenizer([c.read(f) for f in c.files], 400)
    folder = tmp_path_factory.mktemp("tok")
    bpe.save_tokenizer(tok, folder)
    return folder


def test_tokenizer_is_deterministic_byte_level_and_has_the_chat_tokens(fake_root, tok_dir):
    c = corpus.find_sources(fake_root)
    texts = [c.read(f) for f in c.files]
    again = bpe.train_tokenizer(texts, 400)
    tok = bpe.load(tok_dir)
    assert bpe.vocab_json(tok) == bpe.vocab_json(again)
    assert 300 < tok.get_vocab_size() <= 400
    assert [tok.token_to_id(t) for t in bpe.SPECIAL_TOKENS] == list(range(len(bpe.SPECIAL_TOKENS)))
    for s in [texts[0], "caf\xe9 \u2603 \U0001f600\n\ttabs  and   spaces", "[gMASK] as text"]:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert len(tok.encode(texts[0]).ids) < len(texts[0].encode()) / 2  # merges were learned


def test_chat_template_renders_the_plain_glm_format(tok_dir):
    t = HFTokenizer(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "return x"}, {"role": "tool", "content": [{"type": "text", "text": "42"}]}]  # fmt: skip
    for gen in (True, False):
        assert t.render_chat(msgs, add_generation_prompt=gen) == glm_chat_text(msgs, gen)
    ids = t.apply_chat_template(msgs)
    special = {t.token_to_id(x) for x in ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")}
    assert ids[:3] == [t.token_to_id("[gMASK]"), t.token_to_id("<sop>"), t.token_to_id("<|system|>")]
    assert special <= set(ids) and ids[-1] == t.token_to_id("<|assistant|>")
    assert t.special_tokens["eos_token"] == bpe.EOS
    with pytest.raises(ValueError, match="unknown role"):
        t.render_chat([{"role": "narrator", "content": "x"}])


def test_check_vocab_names_file_and_field(tok_dir):
    tok = bpe.load(tok_dir)
    n = tok.get_vocab_size()
    base = tiny.get_config("default").model
    base.vocab_size, base.eos_token_ids, base.pad_token_id = n, list(bpe.stop_ids(tok)), 0
    assert bpe.check_vocab(tok_dir, model_config_from_dict(base)) is not None
    base.vocab_size = n + 1
    with pytest.raises(DataError, match=rf"tokenizer.json: the tokenizer has {n} tokens but config field "
                                        rf"'model.vocab_size' is {n + 1}"):  # fmt: skip
        bpe.check_vocab(tok_dir, model_config_from_dict(base))
    base.vocab_size, base.eos_token_ids = n, [5]
    with pytest.raises(DataError, match="model.eos_token_ids"):
        bpe.check_vocab(tok_dir, model_config_from_dict(base))
    with pytest.raises(DataError, match="tokenizer.json: no such file"):
        bpe.check_vocab(tok_dir / "missing", model_config_from_dict(base))


DOCS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]


@pytest.fixture()
def token_file(tmp_path):
    path = tmp_path / "train.bin"
    packing.write_token_file(path, DOCS, eos_id=0, vocab_size=100)
    return path


def test_token_file_holds_documents_separated_by_eos(token_file):
    toks, meta = packing.open_tokens(token_file)
    assert toks.dtype == np.uint16 and meta["n_docs"] == 4 and meta["n_tokens"] == 15
    assert list(toks) == [5, 6, 7, 0, 8, 0, 9, 10, 11, 12, 13, 0, 14, 15, 0]
    assert packing.token_dtype(70000) == np.uint32


def test_loader_batches_are_a_pure_function_of_seed_and_step(token_file):
    a = packing.PackedLoader(token_file, batch_size=3, seq_len=4, seed=7)
    assert a.n_windows == 4  # 15 tokens in windows of 4: the last one has 3 tokens and one pad
    seq = [a.batch(s) for s in range(8)]
    b = packing.PackedLoader(token_file, batch_size=3, seq_len=4, seed=7)
    for s in (5, 0, 7, 2):  # resumed at any step, in any order: the same batches
        for k in ("tokens", "mask"):
            np.testing.assert_array_equal(b.batch(s)[k], seq[s][k])
    ids = np.concatenate([a.window_ids(s) for s in range(4)])  # 12 samples = 3 epochs of 4 windows
    for e in range(3):
        assert sorted(ids[4 * e : 4 * e + 4]) == [0, 1, 2, 3]  # each epoch visits every window once
    c = packing.PackedLoader(token_file, batch_size=3, seq_len=4, seed=8)
    assert any(not np.array_equal(c.window_ids(s), a.window_ids(s)) for s in range(4))
    last_tokens, last_mask = a.window(3)
    assert list(last_tokens) == [14, 15, 0, 0] and list(last_mask) == [1, 1, 1, 0]


def test_eval_batches_cover_every_window_once(token_file):
    loader = packing.PackedLoader(token_file, batch_size=3, seq_len=4)
    batches = list(loader.eval_batches())
    assert len(batches) == 2 and batches[1]["mask"][1:].sum() == 0
    toks = np.concatenate([b["tokens"] for b in batches])[:4].reshape(-1)
    mask = np.concatenate([b["mask"] for b in batches])[:4].reshape(-1)
    assert list(toks[mask > 0]) == list(packing.open_tokens(token_file)[0])


def test_token_file_errors_name_the_file(token_file, tmp_path):
    with open(token_file, "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="train.bin: 31 bytes, the sidecar says 15 tokens"):
        packing.open_tokens(token_file)
    with pytest.raises(DataError, match="other.json: cannot read"):
        packing.PackedLoader(tmp_path / "other.bin", batch_size=1, seq_len=4)
    with pytest.raises(DataError, match="outside"):
        packing.write_token_file(tmp_path / "bad.bin", [[1, 200]], eos_id=0, vocab_size=100)
    assert not os.path.exists(tmp_path / "bad.bin")  # nothing half-written


def test_prepare_builds_once_and_round_trips(fake_root, tmp_path):
    cfg = prepare.DataConfig(root=str(fake_root), fractions=(0.6, 0.2, 0.2), vocab_size=400)
    logs = []
    m = prepare.prepare_data(cfg, tmp_path, log=logs.append)
    assert {k: m["splits"][k]["files"] for k in corpus.SPLITS} == {k: len(v) for k, v in m["files"].items()}
    assert sum(len(v) for v in m["files"].values()) == 40 and m["skipped"]["latin.py"] == "not UTF-8"
    assert all(m["files"][s] and len(m["files"][s]) for s in corpus.SPLITS)
    c = corpus.find_sources(fake_root)
    for s in corpus.SPLITS:
        assert m["files"][s] == [f for f in c.files if corpus.split_of(f, cfg.fraction_map()) == s]
    tok = bpe.load(tmp_path / "tokenizer")
    toks, _ = packing.open_tokens(tmp_path / "validation.bin")
    eos = m["eos_id"]
    expect = "".join(c.read(f) + bpe.EOS for f in m["files"]["validation"])
    assert tok.decode(list(map(int, toks)), skip_special_tokens=False) == expect
    mtime = os.stat(tmp_path / "train.bin").st_mtime_ns
    assert prepare.prepare_data(cfg, tmp_path, log=logs.append) == m  # reused, not rebuilt
    assert os.stat(tmp_path / "train.bin").st_mtime_ns == mtime and eos == 0
    other = prepare.prepare_data(prepare.DataConfig(root=str(fake_root), fractions=(0.6, 0.2, 0.2), vocab_size=380),
                            tmp_path, log=logs.append)  # fmt: skip
    assert other["fingerprint"] != m["fingerprint"] and other["vocab_size"] <= 380


def test_requirement_closure_is_what_a_distribution_installs():
    import importlib.metadata as md

    assert packages.requirement_closure("jinja2") == ["markupsafe"]  # Requires-Dist: MarkupSafe>=2.0
    # glm53's own closure: its base requirements and theirs, not its extras (torch is a test extra)
    deps = packages.requirement_closure("glm53")
    assert {"jax", "jaxlib", "numpy", "flax", "jinja2", "markupsafe", "tokenizers"} <= set(deps)
    assert "torch" not in deps and "pytest" not in deps and "glm53" not in deps
    p = packages.package("MarkupSafe")
    assert p.name == "markupsafe" and p.version == md.version("markupsafe")
    assert [r for r, _ in p.files] == sorted(r for r in (str(f) for f in md.distribution("markupsafe").files)
                                             if r.endswith(".py"))  # fmt: skip
    with pytest.raises(DataError, match="data.requirements_of.*no-such-dist"):
        packages.requirement_closure("no-such-dist")


def test_packages_join_the_corpus_and_held_out_ones_stay_whole(fake_root, tmp_path):
    cfg = prepare.DataConfig(root=str(fake_root), fractions=(0.6, 0.2, 0.2), vocab_size=400,
                             requirements_of="jinja2", heldout=("MarkupSafe",))  # fmt: skip
    c = prepare.corpus_of(cfg)
    assert c.versions == {"markupsafe": packages.package("markupsafe").version}
    ms = [f for f in c.files if f.startswith("pypi/markupsafe/")]
    assert ms and all(os.path.isfile(c.path(f)) for f in ms) and c.source(ms[0]) == "markupsafe"
    files = prepare.split_files(c, cfg)
    assert files[corpus.HELDOUT] == tuple(ms)  # the whole package, nothing else
    assert not any(f.startswith("pypi/") for s in corpus.SPLITS for f in files[s])
    m = prepare.prepare_data(cfg, tmp_path, log=lambda _: None)
    assert m["packages"] == c.versions and m["splits"]["heldout"]["files"] == len(ms)
    assert m["splits"]["heldout"]["sources"] == {"markupsafe": {"files": len(ms),
                                                                "tokens": m["splits"]["heldout"]["n_tokens"]}}  # fmt: skip
    tok = bpe.load(tmp_path / "tokenizer")
    toks, _ = packing.open_tokens(tmp_path / "heldout.bin")
    assert tok.decode(list(map(int, toks)), skip_special_tokens=False) == "".join(c.read(f) + bpe.EOS for f in ms)
    # a package that is not among the requirements cannot be held out; held-out packages need requirements_of
    with pytest.raises(DataError, match=r"data.heldout.*\['numpy'\]"):
        prepare.corpus_of(prepare.DataConfig(root=str(fake_root), requirements_of="jinja2", heldout=("numpy",)))
    with pytest.raises(DataError, match="data.heldout"):
        prepare.DataConfig(heldout=("jinja2",))


def test_stdlib_files_come_first_in_every_split():
    cfg = prepare.DataConfig(requirements_of="jinja2")
    c = prepare.corpus_of(cfg)
    for name, files in prepare.split_files(c, cfg).items():
        src = [c.source(f) != "stdlib" for f in files]
        assert src == sorted(src), name


def test_data_config_errors_name_the_field():
    with pytest.raises(DataError, match="data.fractions"):
        prepare.DataConfig(fractions=(0.5, 0.5))
    with pytest.raises(DataError, match="data.max_files"):
        prepare.DataConfig(max_files=-1)
    with pytest.raises(ValueError, match="unknown keys"):
        prepare.data_config_from_dict(dict(vocab=3))
    with pytest.raises(DataError, match="data.vocab_size"):
        bpe.train_tokenizer(["x"], 100)


def test_transformers_loads_the_tokenizer_folder(tok_dir):
    from transformers import AutoTokenizer  # the `test` extra; only this test needs it

    hf, ours = AutoTokenizer.from_pretrained(str(tok_dir)), HFTokenizer(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ours.render_chat(msgs)
    s = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    assert hf.encode(s) == ours.encode(s) and hf.decode(hf.encode(s)) == s
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token_id) == (bpe.EOS, 0, 0)
