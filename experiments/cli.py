"""What every entry point shares: `run(main)`, absl's `app.run` with glm53's conventions.

* Bad input (`glm53.errors`: ConfigError, CheckpointError, GGUFError, ShardingError; TokenizerError): one ``error:`` message
  (plus CheckpointError.problems, one per line) on stderr, exit status 1, no traceback.
* Usage errors (`app.UsageError`, a flag that does not parse, an unknown ``--config.*`` field): one
  ``usage error:`` line naming the flag, exit status 2, no flag listing (``--helpshort`` shows it).
* Logs are quiet by default (absl verbosity WARNING); ``--verbosity=0`` shows info, ``--verbosity=1`` debug.
* With JAX_PLATFORMS unset on a machine without TPU or NVIDIA devices, JAX uses the CPU without probing (and
  logging the failure of) an installed libtpu.
* Several processes (hosts): ``--coordinator=HOST:PORT --num_processes=N --process_id=I`` (or
  ``--coordinator=auto``, or a detected SLURM / Open MPI / TPU-pod environment) join one `jax.distributed`
  system before `main` runs (`glm53.parallel.distributed`); the mesh then spans every process's devices.
  ``python -m experiments.launch`` starts such processes on one machine.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import startup  # noqa: E402 -- defines --compilation_cache beside the flags above
from glm53 import build, logs
from glm53.config.kernels import OPS, KernelConfig
from glm53.errors import CheckpointError, ConfigError, DataError, GGUFError, ShardingError, TrainingError
from glm53.parallel import distributed
from glm53.tokenizer import TokenizerError

INPUT_ERRORS = (
    ConfigError,
    CheckpointError,
    GGUFError,
    ShardingError,
    TokenizerError,
    DataError,
    TrainingError,
)
USAGE_EXIT, INPUT_EXIT = 2, 1

# --- several processes (glm53.parallel.distributed): defined here, so every entry point has them
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None,
    "HOST:PORT of process 0's jax.distributed coordinator (with --num_processes, --process_id), or 'auto': "
    "JAX's cluster detection (Cloud TPU, SLURM, Open MPI). Unset: one process, unless such a cluster is detected",
)  # fmt: skip
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "with --coordinator: number of processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "with --coordinator: this process's index (0: writes outputs)")


PCI = "/sys/bus/pci/devices"
GPU_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def _google_pci_device() -> bool:
    """Whether a PCI device of Google's vendor id (a TPU chip) is attached."""
    for dev in os.listdir(PCI) if os.path.isdir(PCI) else ():
        try:
            with open(os.path.join(PCI, dev, "vendor")) as f:
                if f.read().strip() == "0x1ae0":
                    return True
        except OSError:
            continue
    return False


def default_platforms() -> None:
    """JAX on the CPU when JAX_PLATFORMS is unset and no TPU / NVIDIA device is visible (module docstring).
    Call before the first computation: JAX picks its backends then."""
    if "JAX_PLATFORMS" in os.environ or _google_pci_device() or any(map(os.path.exists, GPU_DEVICES)):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def usage_exit(message: str) -> None:
    print(f"usage error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def error_exit(e: Exception) -> None:
    text = str(e)
    print(f"error: {text}", file=sys.stderr)
    problems = getattr(e, "problems", [])
    if "\n" not in text and len(problems) > 1:
        for p in problems:
            print(f"  {p}", file=sys.stderr)
    sys.exit(INPUT_EXIT)


def _config_flag(argv: list[str], field: str) -> str:
    for a in argv:
        if a.startswith("--config.") and a.split("=", 1)[0].split(".")[-1] == field:
            return a.split("=", 1)[0]
    return f"--config.*{field}"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing; any failure (including a ``--config.*`` override) is one usage-error line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if len(lines) > 1:  # a config file's get_config raised: ml_collections quotes the traceback
            usage_exit(f"{lines[0].rstrip(':')}: {lines[-1]}")
        usage_exit(str(e))
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field the config lacks
        msg = str(e)  # the field's name first, quoted (and escaped), maybe 'Did you mean "x" instead of "y"?'
        name = re.search(r"\w+", msg)
        field = name.group(0) if name else msg
        similar = re.search(r'Did you mean \\?"(\w+)\\?"', msg)
        hint = f'; did you mean "{similar.group(1)}"?' if similar else ""
        if field == "moe_impl":  # quant.moe_impl of older configs and commands
            hint = "; the expert kernel is --config.kernels.moe"
        usage_exit(f"{_config_flag(argv, field)}: the config has no field {field!r}{hint}")
    except INPUT_ERRORS as e:
        usage_exit(str(e))
    except Exception as e:  # noqa: BLE001 -- a config file that fails to load, whatever it raises
        usage_exit(f"{type(e).__name__}: {e}")
    return []


def config_name(flag: str = "config") -> str | None:
    """The ``--config`` file (and variant) as given on the command line; None when not given."""
    if not flags.FLAGS[flag].present:
        return None
    return (flag == "config" and startup.config_arg()) or config_flags.get_config_filename(flags.FLAGS[flag])


def entry_name(main: Callable) -> str:
    """``experiments.<name>`` of the module that defines `main` (as ``python -m`` names it)."""
    mod = getattr(main, "__module__", "") or ""
    if mod == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        mod = spec.name if spec is not None else os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return mod


def loaded_config():
    """The ``--config`` flag's ConfigDict (None: not given). A file that failed to load (ml_collections defers the
    error to the first access) is a usage error: one line naming the flag, the shipped configs where no such file
    exists."""
    if "config" not in flags.FLAGS or not flags.FLAGS["config"].present:
        return None
    holder = flags.FLAGS["config"]
    if not hasattr(holder, "override_values"):  # a plain string flag of that name (bench_peer's variant)
        return None
    try:
        config = holder.value
        _ = config is not None and "model" in config  # raises where the load failed
    except Exception as e:  # noqa: BLE001 -- whatever the config file raised
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        given = holder.config_filename if hasattr(holder, "config_filename") else "?"
        if "No such file" in str(e):
            usage_exit(f"--config={given}: no such file, nor a config shipped with glm53 "
                       f"({', '.join(startup.config_names())})")  # fmt: skip
        usage_exit(f"--config={given}: {lines[-1] if lines else type(e).__name__}")
    return config


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def print_help(argv: list[str]) -> None:
    """The entry point's usage (its module docstring) and its own flags (``--helpfull``: every flag); exit 0."""
    main = sys.modules["__main__"]
    print((main.__doc__ or "").strip() + "\n")
    print(flags.FLAGS.get_help() if "--helpfull" in argv else flags.FLAGS.main_module_help())
    sys.exit(0)


def run(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)` with the conventions of the module docstring."""
    default_platforms()
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help(sys.argv)
    sys.argv = startup.rewrite_config_args(sys.argv)  # --config=NAME: the shipped config of that name

    def wrapped(argv):
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        logs.quiet_third_party()  # libtpu's start-up chatter off unless --verbosity (glm53.logs)
        try:
            distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        except ConfigError as e:
            usage_exit(str(e))
        config = loaded_config()
        try:
            build.check_experiment_config(config)  # every override takes effect or is rejected here
        except ConfigError as e:
            usage_exit(f"--config={config_name()}: {e}")
        try:
            startup.start(entry_name(main))
            return main(argv)
        except app.UsageError as e:
            usage_exit(str(e))
        except INPUT_ERRORS as e:
            error_exit(e)

    app.run(wrapped, flags_parser=parse_flags)


def define_moe_impl_flag() -> flags.FlagHolder:
    """`--moe_impl` of the entry points that may run without --config (generate, serve, bench_serve): the kernels
    section's ``moe`` for a run that has no config to set it in (`kernel_config`). Unset: the config's."""
    return flags.DEFINE_enum(
        "moe_impl", None, list(OPS["moe"]),
        "routed-expert implementation (kernels.moe.api) of a run without --config (the shipped model, --weights "
        "alone); with --config set --config.kernels.moe. Unset: the config's kernels section, else "
        f"{KernelConfig().moe} (the backend's best)",
    )  # fmt: skip


def kernel_config(config, moe_impl: flags.FlagHolder) -> KernelConfig:
    """The run's KernelConfig: the experiment config's ``kernels`` section (`build.kernels_from_experiment_config`;
    no config: every op "auto"), with `--moe_impl` as its ``moe`` when given. One setting per run: --moe_impl with
    a --config is a usage error naming --config.kernels.moe, the config's own field."""
    kernels = build.kernels_from_experiment_config(config)
    if moe_impl.value is None:
        return kernels
    if config is not None:
        raise app.UsageError(
            f"--moe_impl={moe_impl.value}: with --config, set --config.kernels.moe={moe_impl.value} instead"
        )
    return kernels.replace(moe=moe_impl.value)


def require_config(config, example: str):
    """The `--config` value, or a usage error naming an example (entry points whose config has no default)."""
    if config is None:
        raise app.UsageError(f"--config is required (e.g. {example})")
    return config


def write_result(path: str | None, result, write: Callable | None = None, blank_line: bool = False) -> None:
    """Writes `result` as JSON to `path` (`write(path, result)`, default `glm53.benchmarks.harness.write_result`)
    when a path is given, on process 0 only (several processes: one file), with the run record beside it
    (`startup.write_run_record`: flags, resolved config, versions), and says so."""
    if not path or not distributed.is_main_process():
        return
    if write is None:
        from glm53.benchmarks import harness  # the benchmark harness only where a result is written

        write = harness.write_result
    write(path, result)
    record = startup.write_run_record(path, loaded_config())
    print(f"{chr(10) if blank_line else ''}wrote {path} (the run: {record})")
