"""A byte-level BPE tokenizer trained with the `tokenizers` library, saved in the HF layout glm53.tokenizer reads.

`train_tokenizer(texts, vocab_size)` learns merges over UTF-8 bytes (GPT-2 style ByteLevel pre-tokenizer, no
prefix space, so ``decode(encode(s)) == s`` for every string). The special tokens come first (ids 0, 1, ...):
``<|endoftext|>`` (end of document, padding, and the first stop token) and the GLM chat markers that the chat
template writes (``[gMASK]``, ``<sop>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|observation|>``, ...).

`save_tokenizer(tok, folder)` writes ``tokenizer.json`` and ``tokenizer_config.json`` (eos / pad tokens and the
GLM-style jinja `CHAT_TEMPLATE`, which renders exactly `glm53.tokenizer.glm_chat_text`). `check_vocab` compares a
tokenizer folder with a model config and names the file and field that disagree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm53.config import ModelConfig
from glm53.data.corpus import DataError
from glm53.files import atomic_write, write_json

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>")  # fmt: skip
# Generation stops at the end of a document and when the model starts a new user / tool turn (as GLM does).
STOP_TOKENS = (EOS, "<|user|>", "<|observation|>")

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- set role = 'observation' if m['role'] == 'tool' else m['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'observation'] -%}"
    "{{- raise_exception('unknown role ' ~ m['role']) -}}"
    "{%- endif -%}"
    "<|{{ role }}|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] -%}{%- for c in m['content'] -%}{{ c['text'] if c['text'] is defined else c }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE `Tokenizer` of `vocab_size` tokens (special tokens and the 256 byte symbols included)."""
    n_min = len(SPECIAL_TOKENS) + 256
    if not isinstance(vocab_size, int) or vocab_size <= n_min:
        raise DataError(f"config field 'data.vocab_size': need an int > {n_min} (specials + 256 bytes), "
                        f"got {vocab_size!r}")  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config(model_max_length: int = 1 << 16) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, folder: str | os.PathLike) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` in `folder` (created if missing), each written atomically."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "tokenizer.json")) as f:
        f.write(tok.to_str())
    write_json(os.path.join(folder, "tokenizer_config.json"), tokenizer_config())


def load(folder: str | os.PathLike) -> Tokenizer:
    path = os.path.join(os.fspath(folder), "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file (train the tokenizer first)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on bad JSON
        raise DataError(f"{path}: cannot load ({e})") from None


def special_ids(tok: Tokenizer) -> dict[str, int]:
    out = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is not None:
            out[t] = i
    return out


def check_vocab(folder: str | os.PathLike, cfg: ModelConfig) -> Tokenizer:
    """The folder's tokenizer, after checking it against `cfg`: its vocabulary size equals ``model.vocab_size``
    and its ``<|endoftext|>`` id is in ``model.eos_token_ids`` and is ``model.pad_token_id``. DataError naming
    the file and the field otherwise."""
    tok = load(folder)
    path = os.path.join(os.fspath(folder), "tokenizer.json")
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != cfg.vocab_size:
        raise DataError(f"{path}: the tokenizer has {n} tokens but config field 'model.vocab_size' is "
                        f"{cfg.vocab_size}; set --config.model.vocab_size={n}")  # fmt: skip
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise DataError(f"{path}: no {EOS} token")
    if eos not in cfg.eos_token_ids:
        raise DataError(f"{path}: {EOS} is id {eos}, not in config field 'model.eos_token_ids' "
                        f"{list(cfg.eos_token_ids)}")  # fmt: skip
    if cfg.pad_token_id != eos:
        raise DataError(
            f"{path}: {EOS} is id {eos} but config field 'model.pad_token_id' is {cfg.pad_token_id}"
        )
    return tok


def stop_ids(tok: Tokenizer) -> tuple[int, ...]:
    """The ids generation stops at (`STOP_TOKENS`), for ``model.eos_token_ids``."""
    return tuple(tok.token_to_id(t) for t in STOP_TOKENS)


def vocab_json(tok: Tokenizer) -> str:
    """The vocabulary as canonical JSON (token -> id, sorted): a fingerprint of the trained tokenizer."""
    return json.dumps(tok.get_vocab(with_added_tokens=True), sort_keys=True)
