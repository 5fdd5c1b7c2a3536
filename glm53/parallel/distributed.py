"""Several JAX processes (one per host) as one system: `jax.distributed` set-up and the multi-process helpers.

Every entry point calls `initialize` once, before any device use (`experiments.cli`: ``--coordinator=HOST:PORT
--num_processes=N --process_id=I``; ``--coordinator=auto`` or a detected cluster environment: JAX's own
detection, as ``jax.distributed.initialize()`` does on Cloud TPU, SLURM and Open MPI). Without either, nothing
happens: one process, as before. After it, `jax.devices()` lists every process's devices, so the mesh of the
config's ``mesh`` section spans all of them (`glm53.parallel.make_mesh`), while each process addresses only its
own (`jax.local_devices()`).

Rules the helpers below implement:
  * host data becomes a global array shard by shard: `put` (`jax.make_array_from_callback`: each process
    reads / slices only the blocks of its addressable devices), never through one host;
  * a global array comes back to the host with `to_host` (every process gets the whole value: results such
    as logits, which process 0 then writes);
  * files are written by process 0 only (`is_main_process`), with a `barrier` where the others read them;
    Orbax checkpoints are written by every process (each its shards), as Orbax requires.

On CPU the processes' collectives run over gloo (``jax_cpu_collectives_implementation``); on TPU / GPU over the
chips' interconnect / NCCL, with no change here.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from glm53.errors import ConfigError

AUTO = "auto"
# What JAX's cluster detection (jax._src.clusters) reads, and the count that makes a job multi-process here:
# (kind, variables that must all be set, the variable holding the number of processes or of hosts).
CLUSTER_ENV = (
    ("SLURM", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID"), "SLURM_NTASKS"),
    ("Open MPI", ("OMPI_MCA_orte_hnp_uri",), "OMPI_COMM_WORLD_SIZE"),  # mpirun / mpiexec (srun: SLURM)
    ("Cloud TPU (GKE)", (), "TPU_WORKER_HOSTNAMES"),  # comma-separated hosts of the slice
)
CLUSTER_VARS = sorted({v for _, need, n in CLUSTER_ENV for v in (*need, n)})

_STATE = {"initialized": False}


def detected_cluster() -> str | None:
    """The kind of multi-process job (more than one process) the environment describes, else None. A Cloud TPU
    pod slice on GCE is recognized by JAX through the metadata server only: pass ``--coordinator=auto`` there."""
    for kind, need, count in CLUSTER_ENV:
        v = os.environ.get(count, "")
        n = (
            len([h for h in v.split(",") if h.strip()])
            if count == "TPU_WORKER_HOSTNAMES"
            else (int(v) if v.isdigit() else 0)
        )
        if n > 1 and all(var in os.environ for var in need):
            return kind
    return None


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """ConfigError naming the flag when the three do not describe one process of a job."""
    if coordinator is None or coordinator == AUTO:
        given = [
            n for n, v in (("--num_processes", num_processes), ("--process_id", process_id)) if v is not None
        ]
        if given and coordinator is None:
            raise ConfigError(f"{', '.join(given)} without --coordinator=HOST:PORT (or --coordinator=auto)")
        return
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator={coordinator}: expected HOST:PORT (or 'auto')")
    if num_processes is None or process_id is None:
        raise ConfigError(f"--coordinator={coordinator} needs --num_processes=N and --process_id=I")
    if num_processes < 1:
        raise ConfigError(f"--num_processes={num_processes}: must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process_id={process_id}: must be in [0, {num_processes})")


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """`jax.distributed.initialize` once (module docstring); returns whether this is a multi-process run.

    coordinator: "HOST:PORT" of process 0's coordinator (with num_processes and process_id), "auto" (JAX's
    detection), or None: a detected cluster environment (`detected_cluster`) is joined by detection, otherwise
    nothing is done. Must run before the first device use. ConfigError for inconsistent arguments."""
    check_args(coordinator, num_processes, process_id)
    if _STATE["initialized"]:
        return jax.process_count() > 1
    if coordinator is None and detected_cluster() is None:
        return False
    if _on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator is None or coordinator == AUTO:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    _STATE["initialized"] = True
    return jax.process_count() > 1


def _on_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS") or (jax.config.jax_platforms or "")
    return platforms.split(",")[0].strip() == "cpu"


def is_main_process() -> bool:
    """Whether this process writes the run's files (process 0; always True for one process)."""
    return jax.process_index() == 0


def process_count() -> int:
    return jax.process_count()


def barrier(name: str) -> None:
    """Every process waits here until all arrived (no-op for one process); `name` must be the same in all."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def put(value, sharding) -> jax.Array:
    """A host array (numpy, or anything with numpy indexing such as a memory map) as a device array with
    `sharding` (None: the default device). Each process reads only the blocks of its own devices
    (`jax.make_array_from_callback`; a block several of them hold, once), so a global array is never assembled
    on one host (`glm53.checkpoint.slices`: tensors on disk read by block)."""
    if sharding is None:
        return jnp.asarray(value)
    if sharding.is_fully_addressable:
        return jax.device_put(np.asarray(value), sharding)
    blocks = {}  # a block replicated on several of this process's devices is read once

    def block(index):
        key = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)
        if key not in blocks:
            blocks[key] = np.asarray(value[index])
        return blocks[key]

    return jax.make_array_from_callback(tuple(value.shape), sharding, block)


def to_host(x) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on this host: every process gets it (an all-gather
    across processes when the array spans devices of other processes)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def put_tree(tree, shardings):
    """`put` for every leaf of `tree` (host or this process's device arrays, the same value in every process)
    with the matching leaf of `shardings` (a pytree of the same structure, e.g. `glm53.train.step.state_shardings`;
    or one sharding for every leaf). Unlike `jax.device_put`, it also places a process-local array on a mesh that
    spans other processes (it goes through the host: meant for values built identically in every process)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: put(np.asarray(x), shardings), tree)
    return jax.tree.map(lambda x, s: put(np.asarray(x), s), tree, shardings)


def device_put(tree, shardings):
    """`jax.device_put(tree, shardings)`, except that a leaf held by this process alone (a host array, or an
    array on this process's devices) going to a sharding that spans other processes goes through `put` (JAX
    does not move a process-local array across hosts). For one process it is `jax.device_put`."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        local = not isinstance(x, jax.Array) or x.is_fully_addressable
        if local and s is not None and not s.is_fully_addressable:
            return put(np.asarray(x), s)
        return jax.device_put(x, s)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)
