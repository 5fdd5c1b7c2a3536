"""Exporting a training run as the HF folder glm53 ships, with its model card (the logic behind
``python -m experiments.export``).

`export_run(workdir, out)` restores the latest checkpoint of a training work directory (`glm53.train.loop.Trainer`,
built from the run's own run.json), writes the HF folder (`glm53.checkpoint.hf_export`) plus the run's tokenizer
files, reads the folder back with glm53's HF loader and measures on the exported weights (float32 compute) the
held-out test-split perplexity, the unigram baseline and the MTP draft acceptance (`glm53.train.card`); then writes
card.json and the model card README.md. Everything is written into a temporary folder next to `out` and renamed
at the end: a failed export leaves no folder.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_collections
from flax import nnx

from glm53.checkpoint.hf import load_hf_model
from glm53.checkpoint.hf_export import staged_folder, write_hf_files
from glm53.data.prepare import corpus_of, data_config_from_dict, fingerprint, read_manifest, split_files
from glm53.errors import ConfigError
from glm53.files import atomic_write, write_json
from glm53.train import card, plot
from glm53.train.loop import RUN_KEYS, Trainer, run_identity

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The experiment config of a run, rebuilt from its run.json (what `Trainer` checks it against)."""
    path = os.path.join(workdir, "run.json")
    try:
        with open(path, encoding="utf-8") as f:
            ident = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"--workdir={workdir}: no readable run.json ({e}); is it a training work directory?"
        ) from None
    try:
        return ml_collections.ConfigDict(dict(model=ident["model"], data=ident["data"], optim=ident["optim"],
                                              loss=ident["loss"], **{k: ident["run"][k] for k in RUN_KEYS}))  # fmt: skip
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a run.json of glm53.train ({e!r})") from None


def check_data(workdir: str, config) -> dict:
    """The run's data manifest, after checking that `Trainer` will reuse the data as it is: a corpus changed
    since training would make it rebuild the data folder, tokenizer included (ConfigError instead)."""
    data_dir = os.path.join(workdir, "data")
    manifest = read_manifest(data_dir)
    if manifest is None:
        raise ConfigError(f"{data_dir}: no manifest.json; the run's data is missing")
    dc = data_config_from_dict(config.data)
    corpus = corpus_of(dc)
    if fingerprint(corpus, split_files(corpus, dc), dc) != manifest.get("fingerprint"):
        raise ConfigError(f"{data_dir}: the corpus ({corpus.root}) differs from the one the run was prepared from; "
                          "export on the machine (and Python) that trained the run")  # fmt: skip
    return manifest


def restore(workdir: str, config, log=print):
    """(cfg, model with the latest checkpoint's f32 parameters, step) of a run; always unrolled (a run with
    `scan_layers` trains stacked layers: they are sliced back per layer, as checkpoints on disk name them)."""
    trainer = Trainer(config, workdir, log=log, progress=False)
    try:
        step = trainer.restore_latest()
        if step == 0:
            raise ConfigError(f"--workdir={workdir}: no checkpoint under {trainer.manager.directory}")
        s = trainer.state
        model = nnx.merge(trainer.graphdef, s.params, s.biases, trainer.rest)
    finally:
        trainer.close()
    model.set_scan_layers(False)
    return model.cfg, model, step


def variant_of(config, variants) -> str | None:
    """The name in `variants` ({name: experiment config}, e.g. configs/train.py's) whose run identity equals the
    run's (None: none does)."""
    ident = json.loads(json.dumps(run_identity(config)))
    for name, other in (variants or {}).items():
        if json.loads(json.dumps(run_identity(other))) == ident:
            return name
    return None


def commands(config, workdir: str, out: str, steps: int, flags_used: list[str], variants=None) -> list[str]:
    """The train + export commands that reproduce the folder (`variants`: see `variant_of`)."""
    name = variant_of(config, variants)
    run_dir = f"runs/{os.path.basename(os.path.normpath(workdir))}"
    cfg_flag = f"--config=configs/train.py:{name}" if name else "--config=<the config in run.json>"
    train = f"python -m experiments.train {cfg_flag} --workdir={run_dir}"
    if steps != config.optim.total_steps:
        train += f" --steps={steps}"
    rel = os.path.relpath(os.path.abspath(out))
    out_s = rel if not rel.startswith("..") else os.path.basename(os.path.normpath(out))
    return [train, " ".join([f"python -m experiments.export --workdir={run_dir} --out={out_s}", *flags_used])]


def export_run(
    workdir: str,
    out: str,
    *,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    test_tokens: int = 65536,
    prompts: int = 8,
    prompt_len: int = 64,
    max_new: int = 32,
    name: str | None = None,
    machine: str | None = None,
    flags_used=(),
    variants=None,
) -> tuple[dict, dict]:
    """Everything the command does (module docstring); returns (card dict, `write_hf_files` summary)."""
    workdir = os.path.abspath(workdir)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    config = run_config(workdir)
    manifest = check_data(workdir, config)
    cfg, model, step = restore(workdir, config, log=lambda m: None)
    records = plot.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    training = card.training_summary([r for r in records if r.get("step", 0) <= step],
                                     batch_size=config.batch_size, seq_len=config.seq_len)  # fmt: skip
    training.update(batch_size=config.batch_size, seq_len=config.seq_len, checkpoint_step=step,
                    elapsed_s=card.elapsed_s(workdir), optim=config.optim.to_dict(), loss=config.loss.to_dict())  # fmt: skip
    data_dir = os.path.join(workdir, "data")
    doc = dict(version=card.CARD_VERSION, name=name or f"glm53-{os.path.basename(workdir)}",
               machine=machine or card.machine(), data=card.data_summary(manifest),
               tokenizer=card.tokenizer_summary(os.path.join(data_dir, "tokenizer"), manifest),
               training=training, commands=commands(config, workdir, out, step, list(flags_used), variants))  # fmt: skip
    extra = {n: os.path.join(data_dir, "tokenizer", n) for n in TOKENIZER_FILES}
    with staged_folder(out, overwrite=overwrite) as tmp:
        summary = write_hf_files(model, cfg, tmp, dtype=dtype, extra_files=extra)
        _, loaded = load_hf_model(tmp, dtype=jnp.float32)  # the exported weights, through our loader
        doc["evaluation"] = card.evaluate(loaded, data_dir, seq_len=config.seq_len, max_tokens=test_tokens,
                                          prompts=prompts, prompt_len=prompt_len, max_new=max_new)  # fmt: skip
        doc["architecture"] = card.architecture(cfg, loaded)
        doc["export"] = dict(dtype=dtype, checkpoint_step=step, files=summary["files"])
        write_json(os.path.join(tmp, "card.json"), doc, indent=1)
        with atomic_write(os.path.join(tmp, "README.md")) as f:
            f.write(card.render(doc))
    return doc, summary
