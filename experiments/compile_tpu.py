"""What the real model costs a TPU slice, compiled by libtpu on this host (no TPU needed).

  JAX_PLATFORMS=cpu python -m experiments.compile_tpu --config=configs/glm53_flash.py --topology=v5e:2x4 \
      --experts=ud_iq3_xxs --streams=1,3,8 --prefill=256,2048 --context=262144 --out=compile_tpu.json

AOT-compiles the decode step per stream count and the prefill per bucket (glm53/benchmarks/compile_tpu.py) and
prints a line per compiled unit; --out writes the JSON: per program compile time, per-device argument / temp /
output / code bytes against HBM, cost analysis and roofline time, collectives by kind, Mosaic kernels and their
gathers, and the compile census (persistent cache, jax.export).
"""

from __future__ import annotations

import os
import tempfile

import jax
from absl import app, flags
from ml_collections import config_flags

from experiments import cli, startup
from glm53.benchmarks import compile_tpu
from glm53.benchmarks.harness import write_result

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config (configs/*.py[:variant])", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4", "TPU topology (libtpu's name, e.g. v5e:2x4)")
_EXPERTS = flags.DEFINE_string("experts", "ud_iq3_xxs", "routed-expert mix (glm53.quant.mixes.parse_mix)")
_LAYOUT = flags.DEFINE_enum("layout", "planes", ["planes", "reencoded"], "routed-expert storage layout")
_STREAMS = flags.DEFINE_list("streams", ["1", "3", "8"], "decode stream counts")
_PREFILL = flags.DEFINE_list("prefill", ["256", "2048"], "prefill buckets (tokens)")
_CONTEXT = flags.DEFINE_integer("context", 262144, "cache length per stream (tokens)")
_LAYERS = flags.DEFINE_integer("layers", 0, "0: every layer; n: n layers from the last dense one")
_COMPOSE = flags.DEFINE_enum(
    "compose", "kinds", list(compile_tpu.COMPOSE), "one program per layer kind, or the whole model"
)
_CENSUS = flags.DEFINE_bool(
    "census", True, "time a warm persistent-cache compile and a jax.export round trip"
)
_PLACEMENT = flags.DEFINE_string(
    "placement",
    "",
    "memory-budget placement of weights and caches (glm53.memory.placement: prior_art | tp | ep; "
    "default: the config's mesh.rules)",
)
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", None, "persistent compilation cache (default: a fresh temp dir)"
)
_OUT = flags.DEFINE_string("out", None, "write the result as JSON here")
_CACHE_TOKENS = flags.DEFINE_integer(
    "cache_tokens", 0, "paged DSA caches: a page pool of this many tokens shared by the streams (0: contiguous "
    "caches of --context per stream); --context is then each stream's table length")
_PAGE_TOKENS = flags.DEFINE_integer("page_tokens", 256, "paged caches: tokens per page")


def main(argv):
    del argv
    cli.require_config(_CONFIG.value, "configs/glm53_flash.py")
    try:
        settings = compile_tpu.Settings(
            topology=_TOPOLOGY.value,
            experts=_EXPERTS.value,
            layout=_LAYOUT.value,
            streams=tuple(int(s) for s in _STREAMS.value),
            prefill=tuple(int(p) for p in _PREFILL.value),
            context=_CONTEXT.value,
            layers=_LAYERS.value,
            compose=_COMPOSE.value,
            census=_CENSUS.value,
            placement=_PLACEMENT.value,
            cache_tokens=_CACHE_TOKENS.value,
            page_tokens=_PAGE_TOKENS.value,
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if settings.census:  # every compile is written to the cache; the census recompiles one with it warm
        jax.config.update(
            "jax_compilation_cache_dir", _CACHE_DIR.value or tempfile.mkdtemp(prefix="jaxcache")
        )
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    partial = (lambda r: write_result(_OUT.value + ".partial", r)) if _OUT.value else None
    result = compile_tpu.run(_CONFIG.value, settings, partial=partial)
    print(compile_tpu.table(result))
    if _OUT.value:
        write_result(_OUT.value, result)
        if os.path.exists(_OUT.value + ".partial"):
            os.remove(_OUT.value + ".partial")
        print(f"wrote {os.path.abspath(_OUT.value)} (the run: {startup.write_run_record(_OUT.value, _CONFIG.value)})")


if __name__ == "__main__":
    cli.run(main)
