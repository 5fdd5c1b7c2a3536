"""What every entry point sets up and says before it works (`experiments.cli.run` calls it):

* **Configs by name.** ``--config=tiny``, ``--config=tiny:gguf`` or ``--config=configs/tiny.py`` from any folder:
  a value that is not an existing file is looked up among the configs shipped with glm53 (`configs/`).
* **A persistent compilation cache**, on by default: ``--compilation_cache=DIR`` (``off`` or empty: none), else
  ``$GLM53_COMPILATION_CACHE``, else ``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/glm53/jax`` (``~/.cache/
  glm53/jax``). A second run of the same command compiles nothing it compiled before.
* **Run folders.** Outputs an entry point writes without being told where go to a new folder
  ``$GLM53_RUNS/<entry>/<YYYYmmdd-HHMMSS>`` (default ``~/glm53_runs``), never silently into the current folder.
* **The start-up block**: the overrides given, the backend and devices, the cache; the model's lines
  (`glm53.build.describe_run`) follow once the model is placed.
* **The run record** (`write_run_record`): beside every output, ``<output>.run.json`` (a folder: ``glm53_run.json``
  in it) holds the command, every flag given, the resolved config and the versions, as MaxText and big_vision write
  theirs.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import sys

import jax
from absl import flags

import configs
from glm53 import files

CACHE_ENV = "GLM53_COMPILATION_CACHE"
RUNS_ENV = "GLM53_RUNS"
OFF = ("", "off", "none")
CONFIGS_DIR = os.path.dirname(os.path.abspath(configs.__file__))
RUN_RECORD = "glm53_run.json"  # the run record inside an output folder

_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    f"persistent compilation cache folder ('off': none). Default: ${CACHE_ENV}, else $JAX_COMPILATION_CACHE_DIR, "
    "else $XDG_CACHE_HOME/glm53/jax (~/.cache/glm53/jax)",
)  # fmt: skip

_STATE: dict = {"entry": None, "cache": None, "started": None, "config_arg": None}


# ------------------------------------------------------------------------------------------------ configs by name
def config_names() -> list[str]:
    """The configs shipped with glm53 (``--config=NAME``)."""
    return sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py") and not f.startswith("_"))


def resolve_config_arg(value: str) -> str:
    """A ``--config`` value as a file path: an existing file as it is; else ``NAME`` / ``NAME:variant`` /
    ``configs/NAME.py[:variant]`` as the shipped config of that name; anything else unchanged (the flag's own
    error names it)."""
    path, sep, variant = value.partition(":")
    if os.path.isfile(path):
        return value
    name = os.path.basename(path)
    name = name[:-3] if name.endswith(".py") else name
    if os.path.dirname(path) in ("", "configs") and name in config_names():
        return os.path.join(CONFIGS_DIR, name + ".py") + sep + variant
    return value


def rewrite_config_args(argv: list[str]) -> list[str]:
    """`argv` with every ``--config=...`` (and ``--config ...``) value resolved by `resolve_config_arg`."""
    out, it = [], iter(argv)
    for a in it:
        if a.startswith("--config="):
            _STATE["config_arg"] = a.split("=", 1)[1]
            a = "--config=" + resolve_config_arg(_STATE["config_arg"])
        elif a == "--config":
            out.append(a)
            _STATE["config_arg"] = next(it, "")
            a = resolve_config_arg(_STATE["config_arg"])
        out.append(a)
    return out


def config_arg() -> str | None:
    """The ``--config`` value as the user gave it (before `resolve_config_arg`); None when not given."""
    return _STATE["config_arg"]


# ------------------------------------------------------------------------------------------------ compilation cache
def default_cache_dir() -> str:
    if os.environ.get(CACHE_ENV) is not None:
        return os.environ[CACHE_ENV]
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "glm53", "jax")


def enable_compilation_cache(value: str | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on at `value` (None: `default_cache_dir`; ``off`` / empty: off).
    Every program is cached, however fast it compiled (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` where
    set). Returns the folder, or None when off."""
    folder = default_cache_dir() if value is None else value
    if folder.strip().lower() in OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        _STATE["cache"] = None
        return None
    folder = os.path.abspath(os.path.expanduser(folder))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _STATE["cache"] = folder
    return folder


def cache_line() -> str:
    folder = _STATE["cache"]
    if folder is None:
        return "compilation cache: off"
    n = len(os.listdir(folder)) if os.path.isdir(folder) else 0
    state = f"{n} entries" if n else "empty: this run compiles everything"
    return f"compilation cache: {folder} ({state}; --compilation_cache=off to disable)"


# ------------------------------------------------------------------------------------------------ start-up
def start(entry: str) -> None:
    """Called by `cli.run` once flags are parsed: the cache, then the block's first lines."""
    _STATE["entry"] = entry
    _STATE["started"] = datetime.datetime.now()
    enable_compilation_cache(_COMPILATION_CACHE.value)
    lines = [f"{entry}: {overrides_line()}",
             f"  backend: {jax.default_backend()}, {jax.device_count()} device(s) ({jax.devices()[0].device_kind})",
             f"  {cache_line()}"]  # fmt: skip
    print("\n".join(lines), flush=True)


def given_flags() -> dict[str, object]:
    """Every flag given on the command line (``--config.*`` overrides included), by name, as parsed."""
    fl = flags.FLAGS
    skip = {"compilation_cache"}
    return {n: _jsonable(fl[n].value) for n in fl if fl[n].present and n not in skip and n != "config"}


def overrides_line() -> str:
    given = given_flags()
    cfg = flags.FLAGS["config"] if "config" in flags.FLAGS else None
    parts = [f"--config={config_arg() or cfg.config_filename}"] if cfg is not None and cfg.present else []
    parts += [f"--{n}={','.join(map(str, v)) if isinstance(v, list) else v}" for n, v in given.items()]
    return "flags " + (" ".join(parts) if parts else "(none: every default)")


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v) if not hasattr(v, "to_dict") else v.to_dict()


# ------------------------------------------------------------------------------------------------ outputs
def run_folder(entry: str | None = None) -> str:
    """A new folder for this run's outputs: ``$GLM53_RUNS/<entry>/<YYYYmmdd-HHMMSS>`` (``~/glm53_runs``)."""
    entry = (entry or _STATE["entry"] or "run").rsplit(".", 1)[-1]
    base = os.environ.get(RUNS_ENV) or os.path.join(os.path.expanduser("~"), "glm53_runs")
    stamp = (_STATE["started"] or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder = os.path.join(base, entry, stamp)
    os.makedirs(folder, exist_ok=True)
    return folder


def output_path(value: str | None, default_name: str) -> str:
    """An output flag's path: `value` as given, or `default_name` in this run's `run_folder`."""
    return value if value else os.path.join(run_folder(), default_name)


def run_record(config=None, **extra) -> dict:
    """The command, the flags given, the resolved config (`config`: the ConfigDict with every override applied)
    and the versions that ran."""
    versions = {}
    for pkg in ("glm53", "jax", "jaxlib", "flax", "orbax-checkpoint", "numpy"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "entry": _STATE["entry"],
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "started": _STATE["started"].isoformat(timespec="seconds") if _STATE["started"] else None,
        "flags": given_flags(),
        "config": config.to_dict() if config is not None and hasattr(config, "to_dict") else config,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "compilation_cache": _STATE["cache"],
        "versions": versions,
        **extra,
    }


def record_path(output: str) -> str:
    if os.path.isdir(output):
        return os.path.join(output, RUN_RECORD)
    stem = os.path.splitext(output)[0]
    return stem + ".run.json"


def write_run_record(output: str, config=None, **extra) -> str:
    """Writes `run_record` beside `output` (`record_path`); returns its path."""
    path = record_path(output)
    files.write_json(path, run_record(config, **extra))
    return path
