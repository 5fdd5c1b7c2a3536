"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The longest test files first. The README runs the suite with pytest-xdist, one file per worker at a time
# (--dist loadfile) in collection order; starting the longest files first keeps one long file from running alone
# at the end (longest-first scheduling). The order of the other files, and every test's result, is unchanged.
# Measured per file in CI's `--durations` output; update when a file grows.
LONGEST_FIRST = (
    "test_model.py",
    "test_moe_pallas.py",
    "test_sharding.py",
    "test_moe_quant.py",
    "test_gguf_model.py",
    "test_compile_tpu.py",
    "test_bench_peer.py",
    "test_kda.py",
    "test_train_step.py",
    "test_train_sharded.py",
    "test_train_kill.py",
    "test_defaults.py",
    "test_export.py",
    "test_tpu_compile.py",
    "test_generation.py",
    "test_entry_points.py",
    "test_convert.py",
    "test_orbax_fuzz.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file-internal order kept
