"""From a corpus folder to a training-ready data folder, once (reused while its config and files are unchanged).

    data_dir/
      tokenizer/tokenizer.json, tokenizer/tokenizer_config.json   BPE trained on the train split only
      train.bin  train.json  validation.bin  validation.json  test.bin  test.json   token files (glm53.data.packing)
      manifest.json   config, corpus root, files per split, what was skipped and why, fingerprint

`manifest.json` is written last: a folder without it (an interrupted preparation) is rebuilt from scratch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from typing import Any

from glm53.config.fields import from_dict
from glm53.data import bpe
from glm53.data.corpus import HELDOUT, SPLITS, Corpus, DataError, check_fractions, find_sources
from glm53.data.packages import normalize, requirement_closure
from glm53.data.packing import write_token_file
from glm53.files import write_json

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` section of a training config.

    root: corpus folder ("" = this Python's standard library, `glm53.data.corpus.stdlib_root`). exclude: folder
    names left out. fractions: (train, validation, test). salt: mixed into the split hash. vocab_size: BPE
    vocabulary including special tokens. min_frequency: of a merge. max_files: keep only the first N files of
    each split in path order (0 = all; for quick runs). requirements_of: an installed distribution whose
    requirements' pure-Python files join the corpus (`glm53.data.packages`; "glm53": what ``pip install -e .``
    brings; "" = the root alone). heldout: packages among those kept whole in the split "heldout", never trained on.
    """

    root: str = ""
    exclude: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__")
    fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)
    salt: str = ""
    vocab_size: int = 4096
    min_frequency: int = 2
    max_files: int = 0
    requirements_of: str = ""
    heldout: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "heldout", tuple(normalize(h) for h in self.heldout))
        if self.heldout and not self.requirements_of:
            raise DataError("config field 'data.heldout': held-out packages need data.requirements_of")
        object.__setattr__(self, "fractions", tuple(self.fractions))
        if len(self.fractions) != len(SPLITS):
            raise DataError(f"config field 'data.fractions': need {len(SPLITS)} values {SPLITS}, "
                            f"got {self.fractions!r}")  # fmt: skip
        check_fractions(self.fraction_map())
        if not isinstance(self.max_files, int) or self.max_files < 0:
            raise DataError(f"config field 'data.max_files': need an int >= 0, got {self.max_files!r}")

    def fraction_map(self) -> dict[str, float]:
        return dict(zip(SPLITS, self.fractions))

    def split_names(self) -> tuple[str, ...]:
        return SPLITS + ((HELDOUT,) if self.heldout else ())


def corpus_of(cfg: DataConfig) -> Corpus:
    """The corpus a data config names: its root (default the standard library) and the packages of
    `requirements_of`; DataError naming data.heldout when a held-out package is not among them."""
    pkgs = tuple(requirement_closure(cfg.requirements_of)) if cfg.requirements_of else ()
    missing = [h for h in cfg.heldout if h not in pkgs]
    if missing:
        raise DataError(f"config field 'data.heldout': {missing} are not among the installed requirements of "
                        f"{cfg.requirements_of!r} ({', '.join(pkgs)})")  # fmt: skip
    return find_sources(cfg.root or None, cfg.exclude, pkgs)


def data_config_from_dict(d: Any) -> DataConfig:
    return from_dict(DataConfig, d, "data config")


def split_files(corpus: Corpus, cfg: DataConfig) -> dict[str, tuple[str, ...]]:
    """{split: files}; in each split the root's files (the standard library) come first, then the packages'."""
    out = {}
    for name in cfg.split_names():
        files = corpus.split(name, cfg.fraction_map(), cfg.salt, cfg.heldout)
        files = tuple(sorted(files, key=lambda f: (corpus.source(f) != "stdlib", f)))
        out[name] = files[: cfg.max_files] if cfg.max_files else files
        if not out[name] and cfg.fraction_map().get(name, 1.0) > 0:
            raise DataError(f"corpus root {corpus.root}: split {name!r} got no files; use a larger corpus "
                            "or change config field 'data.fractions'")  # fmt: skip
    return out


def fingerprint(corpus: Corpus, files: dict[str, tuple[str, ...]], cfg: DataConfig) -> str:
    """sha256 over the config and each kept file's path, size and mtime."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    for name in files:
        for rel in files[name]:
            st = os.stat(corpus.path(rel))
            h.update(f"{name}\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    path = os.path.join(os.fspath(data_dir), MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None


def prepare_data(cfg: DataConfig, data_dir: str | os.PathLike, *, log=print) -> dict:
    """Builds `data_dir` (module docstring) unless its manifest already has this config's fingerprint; returns
    the manifest."""
    data_dir = os.fspath(data_dir)
    corpus = corpus_of(cfg)
    files = split_files(corpus, cfg)
    fp = fingerprint(corpus, files, cfg)
    old = read_manifest(data_dir)
    if old is not None and old.get("fingerprint") == fp:
        return old
    os.makedirs(data_dir, exist_ok=True)
    if old is not None:
        os.unlink(os.path.join(data_dir, MANIFEST))  # stale: nothing is "ready" until rebuilt
    texts = {name: [corpus.read(rel) for rel in files[name]] for name in files}
    log(f"data: {sum(map(len, files.values()))} files from {corpus.root} "
        f"({', '.join(f'{k} {len(v)}' for k, v in files.items())}); skipped {corpus.skipped_summary()}")  # fmt: skip
    tok = bpe.train_tokenizer(texts["train"], cfg.vocab_size, min_frequency=cfg.min_frequency)
    bpe.save_tokenizer(tok, os.path.join(data_dir, "tokenizer"))
    eos = tok.token_to_id(bpe.EOS)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    splits = {}
    for name in files:
        docs = [e.ids for e in tok.encode_batch(texts[name], add_special_tokens=False)]
        meta = write_token_file(os.path.join(data_dir, f"{name}.bin"), docs, eos_id=eos, vocab_size=vocab)
        sources: dict[str, dict[str, int]] = {}  # in file order: the root's files first (`split_files`)
        for rel, ids in zip(files[name], docs):
            s = sources.setdefault(corpus.source(rel), dict(files=0, tokens=0))
            s["files"] += 1
            s["tokens"] += len(ids) + 1
        splits[name] = dict(meta, files=len(files[name]), chars=sum(map(len, texts[name])), sources=sources)
        log(f"data: {name}: {meta['n_docs']} files, {meta['n_tokens']} tokens")
    manifest = dict(
        fingerprint=fp,
        config=dataclasses.asdict(cfg),
        root=corpus.root,
        python=platform.python_version(),
        packages=dict(sorted(corpus.versions.items())),
        vocab_size=vocab,
        eos_id=eos,
        stop_ids=list(bpe.stop_ids(tok)),
        splits=splits,
        files={k: list(v) for k, v in files.items()},
        skipped=dict(sorted(corpus.skipped.items())),
    )
    write_json(os.path.join(data_dir, MANIFEST), manifest)
    return read_manifest(data_dir)
