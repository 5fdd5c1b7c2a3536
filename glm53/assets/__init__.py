"""The model shipped with glm53: the one home of the default model's location.

``glm53/assets/mini/`` is a small trained GLM-5.3 model in the HF layout (config.json of model_type glm5_next,
model.safetensors, generation_config.json, tokenizer.json + tokenizer_config.json with the GLM chat template,
README.md model card). It is package data: a plain ``pip install .`` contains it. `experiments.generate` and
`experiments.score` run it when given neither --weights nor --config, exactly as with ``--weights=<folder>``.

The location is resolved from this file, never from the working directory. The environment variable
``GLM53_DEFAULT_MODEL`` (a folder) replaces it: the one way to point the default at another model (the tests run
the entry points on a stand-in folder this way).
"""

from __future__ import annotations

import os

from glm53.errors import CheckpointError

NAME = "glm53-mini"
DESCRIPTION = "trained model shipped with glm53"
ENV = "GLM53_DEFAULT_MODEL"
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mini")
# What an entry point needs: the config, the weights and the tokenizer (the chat template is in its config).
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model() -> str:
    """The folder of the default model: $GLM53_DEFAULT_MODEL when set and non-empty, else `DEFAULT_MODEL`."""
    return os.environ.get(ENV) or DEFAULT_MODEL


def missing_files(folder: str | os.PathLike | None = None) -> list[str]:
    """The `REQUIRED` files that `folder` (default: `default_model()`) lacks; empty when it is complete."""
    folder = os.fspath(folder) if folder is not None else default_model()
    return [f for f in REQUIRED if not os.path.isfile(os.path.join(folder, f))]


def is_present(folder: str | os.PathLike | None = None) -> bool:
    """Whether `folder` (default: `default_model()`) holds a complete model."""
    return not missing_files(folder)


def require_default_model() -> str:
    """The default model's folder; CheckpointError naming the folder and the missing files when incomplete."""
    folder = default_model()
    missing = missing_files(folder)
    if missing:
        where = f"${ENV}={folder}" if os.environ.get(ENV) else folder
        what = "does not exist" if not os.path.isdir(folder) else f"lacks {', '.join(missing)}"
        raise CheckpointError(
            f"the default model {NAME} is missing: {where} {what}; give --weights=FOLDER (an HF folder, Orbax "
            "checkpoint or GGUF file) or --config=configs/tiny.py (random weights)"
        )
    return folder


def describe(folder: str | os.PathLike | None = None) -> str:
    """How the entry points name the default model: ``glm53-mini: trained model shipped with glm53 (<folder>)``
    (plus ``[$GLM53_DEFAULT_MODEL]`` when the variable replaced the folder)."""
    folder = os.fspath(folder) if folder is not None else default_model()
    via = f" [${ENV}]" if os.environ.get(ENV) else ""
    return f"{NAME}: {DESCRIPTION} ({folder}){via}"


def resolve(weights: str | None, config) -> tuple[str | None, str | None]:
    """(weights, label) of an entry point given --weights and --config: with neither, the default model's folder
    (`require_default_model`) and its `describe` line; otherwise `weights` as given and no label."""
    if weights is None and config is None:
        folder = require_default_model()
        return folder, describe(folder)
    return weights, None
