"""The multi-process half of tests/test_multihost.py, and the computations both halves share.

Run under the launcher (2 processes x 4 CPU devices, one 8-device mesh):

  python -m experiments.launch --processes=2 --devices_per_process=4 -- python tests/multihost_worker.py \
      --ckpt=CKPT --out=DIR [--hf=HF_DIR --gguf=Q4K.gguf --qckpt=QCKPT]

it restores the glm53 checkpoint CKPT (the tiny sharded model, `experiments.convert`) on the TP rules over a
(1, 8) mesh (the "model" axis spans both processes; every leaf's checksum checked) and scores `SEQS`, serves
`serve_requests` on an engine over it (process 0 leads, the other replays its programs: DIR/serve.json), trains `STEPS` steps of the tiny training model on a (2, 4) "data" x "model" mesh (data parallel
across the processes, tensor parallel inside each), saves the trained state as an Orbax checkpoint written by
both processes (each its own shards) under DIR/state, and process 0 writes DIR/results.npz (logits, losses, the
trained state gathered). With --hf / --gguf / --qckpt it first loads those on the (1, 8) expert-parallel mesh,
recording every tensor byte read (`sliced_loads`: DIR/reads{I}.json, DIR/shards{I}.npz per process). The test
computes the same in one process of 8 devices (the functions below) and restores DIR/state on another mesh.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402

from configs import tiny  # noqa: E402
from configs import train as train_configs  # noqa: E402
from experiments import cli  # noqa: E402
from glm53 import build, scoring  # noqa: E402
from glm53.config import model_config_from_dict  # noqa: E402
from glm53.io.gguf import GGUFFile  # noqa: E402
from glm53.io.safetensors import SafetensorsFile  # noqa: E402
from glm53.model import Glm53Model  # noqa: E402
from glm53.parallel import distributed  # noqa: E402
from glm53.serving import multihost  # noqa: E402
from glm53.serving.engine import Engine, Request, generate  # noqa: E402
from glm53.testing.params import randomize_params  # noqa: E402
from glm53.train import routing  # noqa: E402
from glm53.train import step as S  # noqa: E402
from glm53.train.loop import train_mesh  # noqa: E402
from glm53.train.loss import LossConfig  # noqa: E402

SEQS = [[1, 5, 7, 9, 3, 2, 11, 4, 8, 6], [3, 4, 5, 6, 7]]
TP_MESH = dict(axes=("data", "model"), shape=(1, 8), rules="tp")
TRAIN_MESH = dict(axes=("data", "model"), shape=(2, 4), rules="tp")
BATCH, SEQ, STEPS = 4, 16, 3


# ------------------------------------------------------------------------------------------------ scoring
def score_config(mesh_section: dict) -> ml_collections.ConfigDict:
    c = tiny.get_config("sharded")
    c.mesh = ml_collections.ConfigDict(mesh_section)
    return c


def tp_run(weights: str) -> build.ShardedModel:
    """The checkpoint `weights` on `TP_MESH`."""
    config = ml_collections.ConfigDict({"mesh": TP_MESH})  # the model's shape comes from the weights
    return build.sharded_model(config, weights=weights, with_mtp=False)


def tp_logits(run: build.ShardedModel) -> list[np.ndarray]:
    """Logits of `SEQS` by `run` (a `tp_run`; every process gets them all)."""
    logits, _ = scoring.score(run.model, SEQS)
    return logits


# ------------------------------------------------------------------------------------------------ serving
def serve_requests() -> list[Request]:
    """Greedy and seeded-sampled requests whose prompts use both prefill buckets."""
    return [Request(prompt=SEQS[0], max_tokens=5), Request(prompt=SEQS[1], max_tokens=4, temperature=0.8, seed=3),
            Request(prompt=[2, 2, 8, 1], max_tokens=3, temperature=1.0, top_k=5, seed=11)]  # fmt: skip


def serve_tokens(run: build.ShardedModel) -> list[list[int]] | None:
    """The tokens `serve_requests` generate on an engine of 2 slots over `run` (one decode width, buckets 1 and
    4: few programs). Several processes: process 0 leads (`glm53.serving.multihost`) and gets the tokens, the
    others follow its program calls and get None."""
    engine = Engine(run.model, slots=2, max_len=32, buckets=(1, 4), mesh=run.mesh, rules=run.rules,
                    compiler_options={"xla_backend_optimization_level": 0})  # fmt: skip
    if jax.process_count() > 1 and not distributed.is_main_process():
        multihost.follow(engine)
        return None
    if jax.process_count() > 1:
        multihost.lead(engine)
    engine.warmup()
    programs = engine.compiled_programs()
    tokens = generate(engine, serve_requests())
    # the requests compile nothing more (prefill / insert take back the layouts they return on a mesh)
    assert engine.compiled_programs() == programs, (programs, engine.compiled_programs())
    if jax.process_count() > 1:
        multihost.stop(engine)
    return tokens


# ------------------------------------------------------------------------------------------------ training
def train_setup(mesh_section: dict):
    """(mesh, state, (state shardings, batch sharding), step) of the tiny training model (as
    tests/test_train_sharded.py, without the MTP loss: a shorter compile), the state placed through the host
    (`distributed.put_tree`)."""
    c = train_configs.get_config("tiny")
    c.model.vocab_size = 256
    c.model.linear_num_heads = c.model.num_attention_heads = 4
    c.model.num_hidden_layers = 2
    c.model.layer_types, c.model.mlp_layer_types, c.model.indexer_types = (
        ["kda", "dsa"],
        ["dense", "moe"],
        ["full"] * 2,
    )
    c.mesh = ml_collections.ConfigDict(mesh_section)
    cfg = model_config_from_dict(c.model)
    model = randomize_params(Glm53Model(cfg, rngs=nnx.Rngs(0), kernels={"moe": "reference"}))  # no constant inits
    names = routing.instrument_routers(model)
    graphdef, params, biases, rest = S.split_model(model)
    optim = S.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=STEPS + 1, bias_gamma=0.01, eps=1e-3)
    tx = S.optimizer(optim)
    mesh, rules = train_mesh(c, cfg)
    state = S.init_state(params, biases, tx)
    sh = (S.state_shardings(state, mesh, rules), S.batch_sharding(mesh, rules, BATCH))
    step = S.make_train_step(graphdef, rest, tx, LossConfig(mtp_weight=0.0, balance_weight=1e-3), optim, names,
                             fast_compile=True, shardings=sh)  # fmt: skip
    return mesh, distributed.put_tree(state, sh[0]), sh, step


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(1, 256, (BATCH, SEQ)).astype(np.int32)
        mask = np.ones((BATCH, SEQ), np.int32)
        mask[1, 11:] = 0
        tokens[1, 11:] = 0
        out.append(dict(tokens=tokens, mask=mask))
    return out


def train(mesh_section: dict):
    """(state, losses) after `STEPS` steps; each process puts only its rows of every batch on its devices."""
    _, state, sh, step = train_setup(mesh_section)
    losses = []
    for b in batches():
        state, m = step(state, distributed.put_tree(b, sh[1]))
        losses.append(float(m["loss"]))
    return state, losses


def state_leaves(state) -> dict[str, jax.Array]:
    return {str(i): x for i, x in enumerate(jax.tree.leaves(state))}


def save_state(state, path: str) -> None:
    """The state's leaves as an Orbax checkpoint (as `glm53.train.loop.Trainer.save`): every process writes
    the shards of its devices."""
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, state_leaves(state))
    ckptr.wait_until_finished()


def restore_state(path: str, like) -> dict[str, jax.Array]:
    """The leaves of a `save_state` checkpoint, each read straight into the sharding of `like`'s leaf."""
    abstract = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in state_leaves(like).items()
    }
    return ocp.StandardCheckpointer().restore(path, abstract)


# ------------------------------------------------------------------------------------------------ sliced reads
EP_MESH = dict(axes=("data", "model"), shape=(1, 8), rules="ep")


def record_reads() -> list[tuple[str, str, int, int]]:
    """Every tensor byte run the safetensors and GGUF readers read from now on, as (file, tensor or "", offset,
    bytes): safetensors offsets relative to the data section, GGUF offsets absolute."""
    reads = []
    st_read, gguf_read = SafetensorsFile._read_into, GGUFFile._read_into

    def st(self, f, offset, buf, name):
        reads.append((os.path.basename(self.path), name, int(offset), len(buf)))
        return st_read(self, f, offset, buf, name)

    def gg(self, offset, view, what):
        reads.append((os.path.basename(self.name), "", int(offset), len(view)))
        return gguf_read(self, offset, view, what)

    SafetensorsFile._read_into, GGUFFile._read_into = st, gg
    return reads


def local_shards(model, prefix: str) -> dict[str, np.ndarray]:
    """This process's blocks of every parameter leaf, keyed PREFIX|LEAF PATH|start:stop,..."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        leaf = jax.tree_util.keystr(path)
        for sh in x.addressable_shards:
            box = ",".join(f"{i.start or 0}:{x.shape[k] if i.stop is None else i.stop}"
                           for k, i in enumerate(sh.index))  # fmt: skip
            out[f"{prefix}|{leaf}|{box}"] = np.asarray(sh.data)
    return out


def sliced_loads(hf_dir: str, gguf_file: str, qckpt: str, out: str) -> None:
    """The HF folder and the GGUF (routed experts kept quantized, Q4_K) loaded on the expert-parallel (1, 8)
    mesh, every read recorded: this process's reads and blocks to DIR/reads{I}.json and DIR/shards{I}.npz;
    with them the blocks of the Orbax checkpoint `qckpt` (the GGUF's Q4_K experts) restored on that mesh."""
    reads = record_reads()
    ep = ml_collections.ConfigDict({"mesh": EP_MESH})
    hf = build.sharded_model(ep, weights=hf_dir, with_mtp=False)
    quant = tiny.get_config("sharded").quant
    quant.experts = "q4_k"
    config = ml_collections.ConfigDict({"mesh": EP_MESH, "quant": quant})  # the model's shape: the GGUF's
    gg = build.sharded_model(config, weights=gguf_file, with_mtp=False)
    i = jax.process_index()
    with open(os.path.join(out, f"reads{i}.json"), "w") as f:
        json.dump(reads, f)
    restored = build.sharded_model(ep, weights=qckpt, with_mtp=False).model
    np.savez(
        os.path.join(out, f"shards{i}.npz"),
        **local_shards(hf.model, "hf"),
        **local_shards(gg.model, "gguf"),
        **local_shards(restored, "orbax"),
    )


# ------------------------------------------------------------------------------------------------ main
def main(argv):
    del argv
    out = flags.FLAGS.out
    if flags.FLAGS.hf:
        sliced_loads(flags.FLAGS.hf, flags.FLAGS.gguf, flags.FLAGS.qckpt, out)
    run = tp_run(flags.FLAGS.ckpt)  # restored once: scored, then served (scoring leaves the model unchanged)
    logits = tp_logits(run)
    tokens = serve_tokens(run)
    state, losses = train(TRAIN_MESH)
    save_state(state, os.path.join(out, "state"))
    gathered = {f"state_{k}": distributed.to_host(x) for k, x in state_leaves(state).items()}
    if distributed.is_main_process():
        arrays = {f"logits_{i}": lg for i, lg in enumerate(logits)}
        np.savez(
            os.path.join(out, "results.npz"), losses=np.asarray(losses, np.float64), **arrays, **gathered
        )
        with open(os.path.join(out, "serve.json"), "w") as f:
            json.dump(tokens, f)
        with open(os.path.join(out, "devices.json"), "w") as f:
            json.dump({"processes": jax.process_count(), "devices": jax.device_count(),
                       "local_devices": jax.local_device_count()}, f)  # fmt: skip
    distributed.barrier("multihost_worker done")


if __name__ == "__main__":
    # Flags only when run as the worker: tests/test_multihost.py imports this module for its helpers, and a
    # module-level --out would clash with an entry point's own --out imported later in the same pytest worker.
    flags.DEFINE_string("out", None, "output folder (exists)")
    flags.DEFINE_string("ckpt", None, "glm53 checkpoint of the tiny sharded model")
    flags.DEFINE_string("hf", None, "HF folder of the tiny sharded model (sliced reads, with --gguf)")
    flags.DEFINE_string("gguf", None, "GGUF of the tiny sharded model with Q4_K routed experts")
    flags.DEFINE_string("qckpt", None, "glm53 checkpoint of that model, its experts the GGUF's Q4_K planes")
    cli.run(main)
