"""Quiet unless verbose: third-party libraries' own chatter is off unless the run asks for logs.

The entry points' convention (`experiments.cli.run`): absl verbosity WARNING by default, ``--verbosity=0`` info,
``--verbosity=1`` debug. `verbose()` is that decision for what absl does not control:

  * llama.cpp's load logs (``load: adding 4096 dummy tokens``, the metadata dump): `quiet_llama_cpp` installs a
    no-op ``llama_log_set`` callback (llama-cpp-python's own callback prints ERROR-level lines, and llama.cpp logs
    some load lines at that level);
  * libtpu's start-up messages where an entry point compiles for TPU (``Failed to find host bounds ...``,
    ``WARNING: Logging before InitGoogle() ...``, an ``E0000 ... common_lib.cc`` line on a host without TPU
    metadata): `libtpu_env_defaults` sets ``TPU_STDERR_LOG_LEVEL`` (when unset) before libtpu loads, and
    `native_stderr_quiet` holds back what libtpu prints while it initializes, before any such setting applies
    (replayed on stderr if that step fails);
  * gloo's ``[Gloo] Rank N is connected to ...`` lines (printed by the C++ library on stdout, unconditionally,
    when XLA:CPU sets up its collectives): dropped by ``python -m experiments.launch`` (`GLOO_LINE`).

Outside an absl entry point (a library call, a test) `verbose()` is False: quiet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

from absl import flags

# The connectivity line gloo's TCP transport prints to stdout for each new context (several per process).
GLOO_LINE = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks?\b")

# libtpu's stderr log threshold when the run is not verbose (0 info, 1 warning, 2 error, 3 fatal). Compile errors
# still reach the caller as exceptions; libtpu's log files (TPU_MIN_LOG_LEVEL, /tmp/tpu_logs) are unchanged.
TPU_STDERR_QUIET = "3"


def verbose(level: int = 0) -> bool:
    """Whether the run asked for logs of `level` or finer (0: info): absl's ``--verbosity`` given on the command
    line and >= `level`. False when no absl flags were parsed (library use) or the flag was not given."""
    fl = flags.FLAGS
    try:
        if fl.is_parsed() and "verbosity" in fl and fl["verbosity"].present:
            return int(fl.verbosity) >= level
    except (AttributeError, flags.Error):  # pragma: no cover -- flags in an odd state: quiet
        pass
    return False


def verbosity_in_args(args: list[str], level: int = 0) -> bool:
    """Whether a command line (e.g. the command `experiments.launch` runs) asks for ``--verbosity`` >= `level`
    (``--verbosity=N``, ``--verbosity N``, ``-v N``)."""
    for i, a in enumerate(args):
        value = None
        if a.startswith("--verbosity="):
            value = a.split("=", 1)[1]
        elif a in ("--verbosity", "-v") and i + 1 < len(args):
            value = args[i + 1]
        if value is not None:
            try:
                return int(value) >= level
            except ValueError:
                return False
    return False


def quiet_third_party() -> None:
    """The entry points' call (`experiments.cli.run`, after absl parsed the flags, before any device use): the
    settings above that must precede a library's loading, unless `verbose()`; the rest happens where the library
    is used (`quiet_llama_cpp` at each llama.cpp load, the launcher's gloo filter, `native_stderr_quiet`)."""
    libtpu_env_defaults()
    if "llama_cpp" in sys.modules:  # already loaded: quiet it now (otherwise at its first model load)
        quiet_llama_cpp()


# ---------------------------------------------------------------------------------------------- llama.cpp
_LLAMA: dict = {}  # the installed no-op callback (ctypes must keep it alive while llama.cpp holds it)


def quiet_llama_cpp(quiet: bool | None = None) -> None:
    """llama.cpp's log lines off (None: unless `verbose()`), process-wide; with logs asked for, llama-cpp-python's
    own callback at DEBUG (everything). Call before loading a model; no-op without llama-cpp-python."""
    quiet = not verbose() if quiet is None else quiet
    try:
        import llama_cpp  # optional dependency (the `test` extra)
    except ImportError:
        return
    if not quiet:
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG)
        if "noop" in _LLAMA:  # back to llama-cpp-python's callback
            from llama_cpp import _logger  # optional dependency: its own callback, installed on import

            llama_cpp.llama_log_set(_logger.llama_log_callback, None)
            del _LLAMA["noop"]
        return
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    if "noop" not in _LLAMA:
        _LLAMA["noop"] = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_LLAMA["noop"], None)


# ---------------------------------------------------------------------------------------------- libtpu
def libtpu_env_defaults() -> None:
    """Unless `verbose()`: ``TPU_STDERR_LOG_LEVEL`` when unset (libtpu reads it when it loads: call before)."""
    if not verbose():
        os.environ.setdefault("TPU_STDERR_LOG_LEVEL", TPU_STDERR_QUIET)


@contextlib.contextmanager
def native_stderr_quiet(quiet: bool | None = None):
    """Holds back what native code writes to this process's stderr (file descriptor 2) in the block, e.g. a C++
    library's start-up messages that no setting reaches (None: unless `verbose()`). If the block raises, the
    held-back text goes to stderr first, so a failure keeps its context. Python's sys.stderr is flushed around."""
    quiet = not verbose() if quiet is None else quiet
    if not quiet:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
