"""Training data every machine has: the Python standard library's sources and the pure-Python files of the packages
glm53 installs, a byte-level BPE tokenizer trained on them, and a deterministic, resumable packing loader.

  * `glm53.data.corpus`:  `find_sources` (the ``.py`` files, what is skipped and why), `split_of` (train /
                          validation / test by path hash; whole held-out packages), `DataError`;
  * `glm53.data.packages`: `requirement_closure` (what a distribution installs), `package` (its ``.py`` files);
  * `glm53.data.bpe`:     `train_tokenizer`, `save_tokenizer` (tokenizer.json + tokenizer_config.json with the GLM
                          chat template), `check_vocab` against a model config;
  * `glm53.data.packing`: token files (`write_token_file`, `open_tokens`) and `PackedLoader` (batch = f(seed, step));
  * `glm53.data.prepare`: `DataConfig` (the ``data`` config section), `corpus_of(cfg)` and
                          `prepare_data(cfg, data_dir)`.
"""

from glm53.data.corpus import HELDOUT, SPLITS, Corpus, DataError, find_sources, split_of
from glm53.data.packing import PackedLoader, open_tokens, write_token_file
from glm53.data.prepare import DataConfig, corpus_of, data_config_from_dict, prepare_data

__all__ = ["HELDOUT", "SPLITS", "Corpus", "DataConfig", "DataError", "PackedLoader", "corpus_of",
           "data_config_from_dict", "find_sources", "open_tokens", "prepare_data", "split_of",
           "write_token_file"]  # fmt: skip
