"""HF (+ GGUF experts) -> glm53 Orbax checkpoint -> restored model, checked against the model the hybrid loader
(`glm53.checkpoint.gguf.load_hybrid`) builds from the same files.

The model is the `sharded` tiny variant (8 heads, so every split divides the mesh) with expert width 128, a
randomized transformers model saved as an HF folder (+ MTP block); its experts are re-quantized by llama.cpp's
quantizer to gate Q8_0 / up Q4_0 / down Q8_0 (block 32, 2-byte f16 scales: the down matrices' 4 input blocks
are split over the 4-device "model" axis of a (2, 4) TP mesh, which needs their planes re-paired on restore).
Run with -s to see the numbers.
"""

import json
import os
import shutil
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from gguf_fixtures import make_hf_folder

from configs import tiny
from glm53 import parallel as S
from glm53.checkpoint import gguf as gguf_ckpt
from glm53.checkpoint import gguf_export as gguf_write
from glm53.checkpoint import orbax as orbax_ckpt
from glm53.checkpoint.convert import ConversionInterrupted, convert, convert_cli_summary
from glm53.config import QuantConfig, model_config_from_dict
from glm53.errors import CheckpointError
from glm53.layers.param import path_str
from glm53.quant.int8 import Int8Weight
from glm53.quant.mixes import ud_iq3_xxs_mix
from glm53.quant.qweight import QuantizedExperts

CFG = model_config_from_dict(tiny.model_config("sharded")).replace(moe_intermediate_size=128)
MIX = "gate=Q8_0,up=Q4_0,down=Q8_0"
INT8_MIN = 2048  # int8 for the tiny model's larger non-expert kernels
CHUNK = 2048  # small Orbax chunks, so that shards are whole chunks even in the tiny model
TOKENS = np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 24)).astype(np.int32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KW = dict(dtype="float32", int8=True, int8_min_size=INT8_MIN, chunk_bytes=CHUNK, progress=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("convert")
    hf = str(d / "hf")
    make_hf_folder(hf, CFG, seed=0)
    f32, q = str(d / "f32.gguf"), str(d / "experts.gguf")
    gguf_write.convert_hf_to_gguf(hf, f32)
    gguf_write.quantize_experts(f32, q, MIX)
    ckpt = convert(hf, str(d / "ckpt"), gguf=[q], **KW)
    quant = QuantConfig(experts=MIX)
    _, ref = gguf_ckpt.load_hybrid(hf, q, dtype=jnp.float32, quant=quant, int8=True, int8_min_size=INT8_MIN)
    return dict(dir=d, hf=hf, gguf=q, ckpt=ckpt, ref=ref)


_JITTED = {}


def logits(model) -> np.ndarray:
    """Logits [B, T, V] of TOKENS (one compile per model structure)."""
    graphdef, state = nnx.split(model)
    if graphdef not in _JITTED:
        _JITTED[graphdef] = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    return np.asarray(_JITTED[graphdef](state, jnp.asarray(TOKENS)))


def flat_leaves(model) -> dict[str, np.ndarray]:
    """Every array of the model's parameters (Int8Weight / QuantizedExperts leaves included) as host arrays."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def param_values(model) -> dict[str, object]:
    return {path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_checkpoint_layout_and_manifest(world):
    meta = orbax_ckpt.read_metadata(world["ckpt"])
    kinds = {e["path"]: e["kind"] for e in meta["manifest"]}
    ref = param_values(world["ref"])
    assert set(kinds) == set(ref)
    for name, v in ref.items():
        want = (
            "int8"
            if isinstance(v, Int8Weight)
            else "quantized"
            if isinstance(v, QuantizedExperts)
            else "array"
        )
        assert kinds[name] == want, name
    q = [e for e in meta["manifest"] if e["kind"] == "quantized"]
    assert {e["format"] for e in q} == {"Q8_0", "Q4_0"} and all(e["block_splits"] == 1 for e in q)
    assert sum(k == "int8" for k in kinds.values()) >= 10
    assert meta["quant"]["experts"] == {"gate": "Q8_0", "up": "Q4_0", "down": "Q8_0"}
    assert os.path.exists(os.path.join(world["ckpt"], orbax_ckpt.COMPLETE))
    assert not os.path.exists(world["ckpt"] + orbax_ckpt.PARTIAL_SUFFIX)
    assert meta["units"][:3] == ["embed", "layers.0", "layers.1"] and "layers.3.experts" in meta["units"]
    print(f"\n{convert_cli_summary(world['ckpt'])}")


def test_restore_unsharded_equals_hybrid_loader(world):
    model = orbax_ckpt.restore_model(world["ckpt"])
    got, want = flat_leaves(model), flat_leaves(world["ref"])
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    a, b = logits(model), logits(world["ref"])
    print(f"\nunsharded restore vs load_hybrid: max|d| {np.abs(a - b).max():.1e} over {a.size} logits")
    np.testing.assert_array_equal(a, b)


def _read_amplification(ckpt: str, model) -> tuple[float, int]:
    """(bytes of the stored chunks that overlap each device's shard, summed over devices) / (bytes of the
    shards), over every stored leaf except the re-paired 2-byte planes (1.0: each device reads exactly its
    shard), and the same ratio if every device read whole tensors; and the number of leaves."""
    meta = orbax_ckpt.read_metadata(ckpt)
    leaves = {
        _key_path(jax.tree_util.keystr(p)): x
        for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    }
    touched = shards = whole = n = 0
    for unit in meta["units"]:
        md = ocp.PyTreeCheckpointer().metadata(os.path.join(ckpt, "units", unit, "arrays")).item_metadata.tree
        for path, m in jax.tree_util.tree_flatten_with_path(md)[0]:
            keys = [str(getattr(k, "key", k)) for k in path]
            if "planes" in keys and keys[-1] in ("d", "dmin", "scales_h"):
                continue
            x = leaves[".".join(keys)]
            chunk, item = m.storage.chunk_shape, x.dtype.itemsize
            for idx in x.sharding.devices_indices_map(x.shape).values():
                span = [(s.start or 0, x.shape[i] if s.stop is None else s.stop) for i, s in enumerate(idx)]
                shards += int(np.prod([b - a for a, b in span])) * item
                whole += x.size * item
                touched += int(np.prod([(-(-b // c) - a // c) * c for (a, b), c in zip(span, chunk)])) * item
            n += 1
    return touched / shards, whole / shards, n


def _key_path(keystr: str) -> str:
    """ "['layers'][3]['mlp']..." -> "layers.3.mlp..." (Variable / Planes field levels dropped)."""
    parts = [p.strip("'\"]") for p in keystr.replace(".", "[").split("[") if p.strip("'\"]")]
    return ".".join(p for p in parts if p not in ("value", "raw_value", "fields"))


def test_restore_sharded_equals_sharded_hybrid_loader(world):
    mesh = S.make_mesh(dict(axes=("data", "model"), shape=(2, 4), rules="tp"))
    model = orbax_ckpt.restore_model(world["ckpt"], mesh, "tp")
    ref = S.shard_model(world["ref"], mesh, "tp")
    got, want = flat_leaves(model), flat_leaves(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    ref_leaves = jax.tree.leaves(nnx.state(ref))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), ref_leaves, strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    down = model.layers[3].mlp.experts.down_proj.get_value()
    assert down.planes.block_splits == 4  # the 4 input blocks split over "model": re-paired on restore
    amp, amp_whole, n = _read_amplification(world["ckpt"], model)
    a, b, plain = logits(model), logits(ref), logits(world["ref"])
    print(f"\nsharded restore: read amplification {amp:.2f} (whole tensors: {amp_whole:.2f}) over {n} stored leaves; "
          f"vs sharded load_hybrid rel "
          f"{rel(a, b):.1e}, vs unsharded rel {rel(a, plain):.1e}")  # fmt: skip
    assert amp < 1.5 < amp_whole
    assert rel(a, b) <= 1e-6
    assert rel(a, plain) <= 1e-5


def test_interrupted_conversion_resumes_to_the_same_checkpoint(world, tmp_path):
    out = str(tmp_path / "ckpt")
    partial = out + orbax_ckpt.PARTIAL_SUFFIX
    with pytest.raises(ConversionInterrupted):
        convert(world["hf"], out, gguf=[world["gguf"]], interrupt_after=5, **KW)
    assert not os.path.exists(out)
    done = sorted(u for u in os.listdir(os.path.join(partial, "units")) if not u.startswith("."))
    # 3 units of GGUF experts, then 2 from the HF folder (interrupted inside the HF loader)
    assert len(done) == 5 and sum(u.endswith(".experts") for u in done) == 3, done
    inodes = {u: os.stat(os.path.join(partial, "units", u)).st_ino for u in done}
    for bad in (partial, out):
        with pytest.raises(CheckpointError, match="incomplete|not a checkpoint") as e:
            orbax_ckpt.restore_model(bad)
        assert bad in str(e.value)
    with pytest.raises(CheckpointError, match="different arguments \\(dtype\\)") as e:
        convert(world["hf"], out, gguf=[world["gguf"]], **{**KW, "dtype": "bf16"})
    assert partial in str(e.value)
    # A crash in the middle of a unit leaves a staging directory: the rerun discards it.
    os.makedirs(os.path.join(partial, "units", ".layers.4.staging", "arrays"))
    convert(world["hf"], out, gguf=[world["gguf"]], **KW)
    assert not os.path.exists(partial)
    assert {u: os.stat(os.path.join(out, "units", u)).st_ino for u in done} == inodes  # not rewritten
    a, b = orbax_ckpt.read_metadata(out), orbax_ckpt.read_metadata(world["ckpt"])
    assert a["manifest"] == b["manifest"] and a["units"] == b["units"]
    got, want = flat_leaves(orbax_ckpt.restore_model(out)), flat_leaves(world["ref"])
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_bad_checkpoints_raise_naming_the_directory(world, tmp_path):
    with pytest.raises(CheckpointError, match="already exists"):
        convert(world["hf"], world["ckpt"], gguf=[world["gguf"]], **KW)

    def broken(name, damage):
        d = str(tmp_path / name)
        shutil.copytree(world["ckpt"], d)
        damage(d)
        with pytest.raises(CheckpointError) as e:
            orbax_ckpt.restore_model(d)
        assert d in str(e.value), str(e.value)
        return str(e.value)

    msg = broken("no_marker", lambda d: os.remove(os.path.join(d, orbax_ckpt.COMPLETE)))
    assert "incomplete" in msg
    msg = broken(
        "bad_json", lambda d: open(os.path.join(d, orbax_ckpt.META), "w").write('{"format": "glm53-or')
    )
    assert "corrupted" in msg

    def drop_unit_data(d):
        arrays = os.path.join(d, "units", "layers.2", "arrays")
        for sub in os.listdir(arrays):
            if sub.startswith("ocdbt") or sub == "d":
                shutil.rmtree(os.path.join(arrays, sub))

    msg = broken("no_data", drop_unit_data)
    assert "layers.2" in msg and "corrupted" in msg
    msg = broken("no_unit", lambda d: shutil.rmtree(os.path.join(d, "units", "layers.0")))
    assert "layers.0" in msg

    def wrong_shape(d, reseal=True):
        p = os.path.join(d, orbax_ckpt.META)
        meta = json.load(open(p))
        meta["config"]["vocab_size"] *= 2
        json.dump(meta, open(p, "w"))
        if reseal:  # a consistent sidecar (its CRC-32 in COMPLETE updated) that does not match the arrays
            c = os.path.join(d, orbax_ckpt.COMPLETE)
            json.dump({**json.load(open(c)), "sidecar_crc32": zlib.crc32(open(p, "rb").read())}, open(c, "w"))

    assert "embed" in broken("wrong_shape", wrong_shape)
    assert "CRC-32" in broken("edited_sidecar", lambda d: wrong_shape(d, reseal=False))


def test_convert_and_score_cli(world, tmp_path):
    """experiments.convert (bf16, dense experts from the HF folder) then experiments.score --weights=CKPT equals
    experiments.score --weights=HF_DIR at the same dtype."""
    from absl import flags

    from experiments import score

    ckpt = str(tmp_path / "ckpt_bf16")
    cmd = [sys.executable, "-m", "experiments.convert", f"--hf={world['hf']}", f"--out={ckpt}", "--dtype=bfloat16",
           "--chunk_bytes=4096"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    bar = [line for line in p.stderr.replace("\r", "\n").splitlines() if "12/12" in line]
    print(f"\n{p.stdout.strip()}\n{bar[-1] if bar else ''}")
    assert f"{ckpt}: 12 units" in p.stdout and "12/12" in p.stderr  # summary line; tqdm bar on stderr
    meta = orbax_ckpt.read_metadata(ckpt)
    assert meta["quant"] is None and meta["dtype"] == "bfloat16"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS.tolist()))
    outs = {}
    for name, weights in {"ckpt": ckpt, "hf": world["hf"]}.items():
        out = str(tmp_path / f"{name}.npz")
        flags.FLAGS.unparse_flags()
        flags.FLAGS(
            ["score", f"--weights={weights}", f"--tokens={tokens}", f"--out={out}", "--dtype=bfloat16"]
        )
        score.main(["score"])
        outs[name] = np.load(out)
    flags.FLAGS.unparse_flags()
    for k in outs["hf"].files:
        np.testing.assert_array_equal(outs["ckpt"][k], outs["hf"][k], err_msg=k)


def test_ud_mix_reencoded_layout_round_trip(tmp_path):
    """UD-IQ3_XXS experts (IQ2_S / IQ3_S at 5 MoE layers; 256-wide blocks: the `gguf` tiny variant) converted with
    --quant_layout=reencoded: the mix is recognized as "ud_iq3_xxs" (MTP experts dense, decoded from the GGUF) and
    the restored parameters equal load_hybrid's with the same QuantConfig, leaf by leaf."""
    cfg = model_config_from_dict(tiny.model_config("gguf"))
    hf = str(tmp_path / "hf")
    make_hf_folder(hf, cfg, seed=1)
    f32, q = str(tmp_path / "f32.gguf"), str(tmp_path / "ud.gguf")
    gguf_write.convert_hf_to_gguf(hf, f32)
    gguf_write.quantize_experts(f32, q, "UD-IQ3_XXS")
    ckpt = convert(hf, str(tmp_path / "ckpt"), gguf=[q], dtype="bf16", layout="reencoded", progress=False)
    meta = orbax_ckpt.read_metadata(ckpt)
    # at 5 MoE layers the scaled UD table is IQ2_S / IQ2_S / IQ3_S throughout: the same mix as the per-matrix spec
    moe = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    assert QuantConfig(experts=meta["quant"]["experts"]).mix.formats(moe) == ud_iq3_xxs_mix(moe)
    assert meta["quant"]["layout"] == "reencoded"
    kinds = {e["path"]: (e["kind"], e.get("planes_format")) for e in meta["manifest"]}
    # the MTP experts follow the recognized mix: a per-matrix mix covers them (kept quantized), the UD table not
    assert kinds["mtp.mlp.experts.gate_proj"][0] == ("array" if meta["quant"]["experts"] == "ud_iq3_xxs" else "quantized")
    assert kinds["layers.3.mlp.experts.gate_proj"][0] == "quantized"
    assert kinds["layers.3.mlp.experts.gate_proj"][1] != "IQ2_S"  # the gather-free re-encoding
    _, ref = gguf_ckpt.load_hybrid(
        hf, q, dtype=jnp.bfloat16, quant=QuantConfig(experts=meta["quant"]["experts"], layout="reencoded")
    )
    got, want = flat_leaves(orbax_ckpt.restore_model(ckpt)), flat_leaves(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _data_files(d: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)


def test_flipped_bytes_in_an_array_file_are_a_checkpoint_error(world, tmp_path):
    """64 bytes flipped in the middle of a unit's largest data file (zstd-compressed chunks): the restore raises
    a CheckpointError naming the unit, and the tensor when the chunk still decodes (the CRC-32 check); without the
    check (verify=False) such a chunk would restore as different numbers."""
    d = str(tmp_path / "flipped")
    shutil.copytree(world["ckpt"], d)
    path = max(_data_files(os.path.join(d, "units", "layers.2", "arrays")), key=os.path.getsize)
    at = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        chunk = f.read(64)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in chunk))
    with pytest.raises(CheckpointError) as e:
        orbax_ckpt.restore_model(d)
    msg = str(e.value)
    assert d in msg and "unit layers.2" in msg, msg
    if "checksum mismatch" in msg:
        assert "layers.2." in msg.split("unit layers.2", 1)[1], msg


def test_rewritten_array_data_is_a_checksum_mismatch_naming_the_tensor(world, tmp_path):
    """A unit whose Orbax arrays decode cleanly but differ from what was converted (one value changed): the
    CRC-32 check names the unit and the tensor; verify=False restores the different numbers."""
    d = str(tmp_path / "rewritten")
    shutil.copytree(world["ckpt"], d)
    udir = os.path.join(d, "units", "layers.2", "arrays")
    tree = ocp.PyTreeCheckpointer().restore(udir)
    fn = np.array(tree["layers"]["2"]["attn_hc"]["fn"])
    fn[3, 5] += 1.0
    tree["layers"]["2"]["attn_hc"]["fn"] = fn
    shutil.rmtree(udir)
    ocp.PyTreeCheckpointer().save(udir, tree)
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        orbax_ckpt.restore_model(d)
    assert "unit layers.2: layers.2.attn_hc.fn" in str(e.value) and d in str(e.value)
    quiet = param_values(orbax_ckpt.restore_model(d, verify=False))["layers.2.attn_hc.fn"]
    np.testing.assert_array_equal(np.asarray(quiet), fn)


def test_resume_with_replaced_source_files_is_an_error(world, tmp_path):
    """Interrupt, replace the HF folder's safetensors with another model's, rerun: the resume fingerprint covers
    the source files' sizes and modification times, so the rerun names the changed files instead of writing a
    checkpoint of half of each model."""
    hf = str(tmp_path / "hf")
    shutil.copytree(world["hf"], hf)
    out = str(tmp_path / "ckpt")
    with pytest.raises(ConversionInterrupted):
        convert(hf, out, interrupt_after=3, **KW)
    other = str(tmp_path / "other")
    make_hf_folder(other, CFG, seed=7)
    for f in os.listdir(other):
        if f.endswith(".safetensors"):
            shutil.copy(os.path.join(other, f), os.path.join(hf, f))
    with pytest.raises(CheckpointError, match="source files changed") as e:
        convert(hf, out, **KW)
    assert out + orbax_ckpt.PARTIAL_SUFFIX in str(e.value) and "delete" in str(e.value)
    assert any(p.endswith(".safetensors") for p in e.value.problems)
    assert not os.path.exists(out)


def test_convert_a_folder_without_mtp(world, tmp_path):
    """A folder saved by transformers (no MTP block): auto converts it without one, --mtp=on names the problem."""
    hf = str(tmp_path / "hf")
    shutil.copytree(world["hf"], hf)
    os.remove(os.path.join(hf, "model-mtp.safetensors"))
    index = os.path.join(hf, "model.safetensors.index.json")
    if os.path.exists(index):
        idx = json.load(open(index))
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-mtp.safetensors"}
        json.dump(idx, open(index, "w"))
    with pytest.raises(CheckpointError, match="no MTP block"):
        convert(hf, str(tmp_path / "on"), with_mtp=True, **KW)
    meta = orbax_ckpt.read_metadata(convert(hf, str(tmp_path / "auto"), **KW))
    assert meta["with_mtp"] is False and not any(u.startswith("mtp") for u in meta["units"])
    restored = orbax_ckpt.restore_model(str(tmp_path / "auto"))
    assert restored.mtp is None
    with pytest.raises(CheckpointError, match="no MTP block"):
        orbax_ckpt.restore_model(str(tmp_path / "auto"), with_mtp=True)
