"""`oarlock convert` and the conversion API: real MiniLM HF -> fused-QKV TP=2 oarlock -> HF, simulated ranks
against real gloo ranks (save_state_dict) and the live HF export, every safetensors dtype, and bad input."""

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oarlock.checkpoint import ShardedWeight, load_state_dict, open_checkpoint, save_state_dict
from oarlock.checkpoint.convert import (chunk_sizes, convert_checkpoint, export_hf, export_hf_sharded,
                                        iter_full_tensors, resolve_tp_rules, tp_axis)
from oarlock.cli import main
from oarlock.checkpoint.storage import read_metadata
from testkit import st_tensors, tree_digest

P = "encoder.layer.$LAYER_ID.attention.self"
QKV = [f"{P}.query.{w}, {P}.key.{w}, {P}.value.{w} -> {P}.qkv.{w}, axis=0" for w in ("weight", "bias")]


def bits(t):
    t = t.contiguous().view(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


# ---------------------------------------------------------------- real input: all-MiniLM-L6-v2

def _embed(model_dir, sentences):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    batch = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * mask).sum(1) / mask.sum(1)


def test_minilm_fused_qkv_tp2_round_trip(minilm_dir, tmp_path, capsys):
    cfg = tmp_path / "qkv.json"
    cfg.write_text(json.dumps({"aoa_statements": QKV}))
    before = tree_digest(minilm_dir)
    oar, hf = tmp_path / "oar_tp2", tmp_path / "hf"
    # --dry-run prints the plan and writes nothing
    assert main(["convert", str(minilm_dir), str(oar), "--aoa", str(cfg), "--tp", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not oar.exists()
    assert "encoder.layer.3.attention.self.qkv.weight" in out and "[1152, 384]" in out
    assert "# rank-00000.safetensors" in out and "# rank-00001.safetensors" in out

    assert main(["convert", str(minilm_dir), str(oar), "--aoa", str(cfg), "--tp", "2"]) == 0
    assert main(["convert", str(oar), str(hf), "--aoa", str(cfg), "--reverse", "--max-shard-size", "40MB"]) == 0
    capsys.readouterr()
    assert tree_digest(minilm_dir) == before  # the source is never written

    ref = st_tensors(minilm_dir)
    with open_checkpoint(oar) as r:
        meta = r.metadata
        assert meta.format == "oarlock"
        for layer in range(6):
            q = f"encoder.layer.{layer}.attention.self"
            t = meta.tensors[f"{q}.qkv.weight"]
            assert t.global_shape == (1152, 384)
            assert sorted((s.global_offset, s.local_shape, s.file) for s in t.shards) == [
                ((0, 0), (576, 384), "rank-00000.safetensors"), ((576, 0), (576, 384), "rank-00001.safetensors")]
            fused = torch.cat([ref[f"{q}.query.weight"], ref[f"{q}.key.weight"], ref[f"{q}.value.weight"]])
            for s in t.shards:  # rank r's stored shard is rows [576 r, 576 (r + 1)) of the concatenation
                with safe_open(str(oar / s.file), "pt") as fh:
                    assert torch.equal(fh.get_tensor(f"{q}.qkv.weight"), fused[s.global_offset[0]:][:576])
            assert f"{q}.query.weight" not in meta.tensors
        emb = meta.tensors["embeddings.word_embeddings.weight"]
        assert [s.local_shape for s in emb.shards] == [(15261, 384), (15261, 384)]
        dense = meta.tensors["encoder.layer.0.attention.output.dense.weight"]
        assert [s.global_offset for s in dense.shards] == [(0, 0), (0, 192)]  # row-parallel: input axis
        ln = meta.tensors["encoder.layer.0.attention.output.LayerNorm.weight"]
        assert len(ln.shards) == 1  # replicated: written once

    idx = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1 and set(idx["weight_map"]) == set(ref)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    got = st_tensors(hf)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]), k

    sentences = ["A checkpoint is a snapshot of model weights.", "Tensor parallelism splits matrices.", "Hi!"]
    assert torch.equal(_embed(hf, sentences), _embed(minilm_dir, sentences))


# ---------------------------------------------------------------- simulated ranks == real ranks; live export

WORLD = 2


def tiny_model():
    g = torch.Generator().manual_seed(1)
    return {"embed_tokens.weight": torch.randn(11, 6, generator=g),  # 11 rows: uneven split 6 + 5
            "layers.0.self_attn.q_proj.weight": torch.randn(8, 6, generator=g),
            "layers.0.self_attn.k_proj.weight": torch.randn(4, 6, generator=g),
            "layers.0.self_attn.v_proj.weight": torch.randn(4, 6, generator=g),
            "layers.0.self_attn.o_proj.weight": torch.randn(6, 8, generator=g).to(torch.bfloat16),
            "layers.0.mlp.down_proj.weight": torch.randn(6, 10, generator=g),
            "layers.0.input_layernorm.weight": torch.randn(6, generator=g),
            "step": torch.tensor(7, dtype=torch.int64)}


FUSE = ["layers.$LAYER_ID.self_attn.q_proj.weight, layers.$LAYER_ID.self_attn.k_proj.weight, "
        "layers.$LAYER_ID.self_attn.v_proj.weight -> layers.$LAYER_ID.self_attn.qkv_proj.weight, "
        "fused_qkv, num_heads=4, num_key_value_groups=2, axis=0"]


def _rank_shards(full, rank):
    """What a TP=2 job holds on ``rank`` under the default ('megatron') rules."""
    rules = resolve_tp_rules("megatron")
    sd = {}
    for k, t in full.items():
        axis = tp_axis(k, t.shape, rules)
        if axis is None:
            sd[k] = t.clone()
            continue
        sizes = chunk_sizes(t.shape[axis], WORLD)
        off = sum(sizes[:rank])
        sd[k] = ShardedWeight.shard_along_axis(k, t.narrow(axis, off, sizes[rank]).clone(), axis, sizes=sizes,
                                               rank=rank)
    return sd


def scenario_save_real_ranks_and_export_live(ctx):
    """Two gloo ranks save a TP=2 checkpoint with save_state_dict, then export the fused model they train live
    to HF through the reverse config (rank 0 writes, rank 1 only sends)."""
    from oarlock.checkpoint.aoa import compile_aoa
    from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors
    from oarlock.utils import dtype_name

    ref = tiny_model()
    save_state_dict(_rank_shards(ref, ctx.rank), ctx.shared / "real")
    specs = {k: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for k, t in ref.items()}
    fused = execute_on_full_tensors(compile_aoa(FUSE, specs), ref)
    out = export_hf_sharded(_rank_shards(fused, ctx.rank), ctx.shared / "live_hf",
                            aoa_config={"aoa_statements": FUSE, "aoa_config_reverse": True}, max_shard_size=300)
    assert (out is not None) == (ctx.rank == 0), out


@pytest.mark.multiproc
def test_simulated_tp_equals_real_ranks_and_live_export(tmp_path, multirank):
    multirank("test_convert", WORLD).check()
    shared = tmp_path / "ranks"
    ref = tiny_model()
    src = tmp_path / "hf_src"
    src.mkdir()
    save_file(ref, src / "model.safetensors")
    sim = tmp_path / "sim"
    convert_checkpoint(src, sim, tp=WORLD)
    real = shared / "real"
    # the same metadata and byte-identical data files as the two gloo ranks saved with save_state_dict, but for
    # the unique id of each save (metadata.json and every data file header carry it)
    metas = [json.loads((d / "metadata.json").read_text()) for d in (sim, real)]
    ids = [m.pop("save_id") for m in metas]
    # the block checksums cover the headers, which hold the save ids: both record every data file, sizes equal
    sums = [m["extra"].pop("checksums") for m in metas]
    sizes = [{f: r["size"] for f, r in s_["files"].items()} for s_ in sums]
    assert sizes[0] == sizes[1] and len(sizes[0]) == WORLD
    assert metas[0] == metas[1] and ids[0] != ids[1] and len(ids[0]) == len(ids[1]) == 32
    data = lambda d, i: {f.name: f.read_bytes().replace(i.encode(), b"0" * 32)  # noqa: E731
                         for f in sorted(d.iterdir()) if f.name not in ("metadata.json", ".oarlock-files")
                         and f.suffix != ".xxh3"}  # block digests: of the headers, which hold the save ids
    assert data(sim, ids[0]) == data(real, ids[1]) and len(data(sim, ids[0])) == WORLD
    # export back to HF: every tensor as saved
    got = dict(iter_full_tensors(sim))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)

    live = shared / "live_hf"  # the live export wrote the unfused HF layout, split over several files
    assert (live / "model.safetensors.index.json").is_file()
    got = st_tensors(live)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)


def test_pp_dp_layout_and_reload(tmp_path):
    ref = tiny_model()
    ref.update({f"layers.{i}.mlp.down_proj.weight": torch.randn(6, 10) for i in (1, 2, 3)})
    src = tmp_path / "src.safetensors"
    save_file(ref, src)
    meta = convert_checkpoint(src, tmp_path / "oar", tp=2, pp=2, dp=2)
    files = {k: {s.file for s in t.shards} for k, t in meta.tensors.items()}
    # ranks: tp fastest, then dp, then pp; layers 0-1 on stage 0 (ranks 0-3), 2-3 on stage 1 (ranks 4-7)
    stage0 = {f"rank-{r:05d}.safetensors" for r in range(4)}
    assert files["layers.0.mlp.down_proj.weight"] <= stage0 and files["layers.1.mlp.down_proj.weight"] <= stage0
    assert not files["layers.3.mlp.down_proj.weight"] & stage0 and not files["step"] & stage0
    assert files["embed_tokens.weight"] <= stage0
    assert all(len(t.shards) == len({s.global_offset for s in t.shards}) for t in meta.tensors.values())
    # the data-parallel replicas spread the writes: all 8 ranks write something
    assert len(meta.files) == 8
    # load back whole, and into another TP layout
    full = {k: torch.empty_like(v) for k, v in ref.items()}
    load_state_dict(full, tmp_path / "oar")
    assert all(torch.equal(full[k], ref[k]) for k in ref)
    t = ShardedWeight("layers.2.mlp.down_proj.weight", torch.empty(3, 10), (3, 10), (6, 10), (3, 0))
    load_state_dict({"x": t}, tmp_path / "oar", strict=False)
    assert torch.equal(t.local_tensor, ref["layers.2.mlp.down_proj.weight"][3:])


def test_tp_rules_file_and_errors(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"*.down_proj.weight": 0, "*": None}))
    ref = tiny_model()
    save_file(ref, tmp_path / "m.safetensors")
    meta = convert_checkpoint(tmp_path / "m.safetensors", tmp_path / "o", tp=2, tp_rules=rules)
    assert [s.global_offset for s in meta.tensors["layers.0.mlp.down_proj.weight"].shards] == [(0, 0), (3, 0)]
    assert len(meta.tensors["layers.0.self_attn.q_proj.weight"].shards) == 1
    # oarlock TP=2 -> oarlock TP=3 (--to defaults to oarlock when a parallel degree is given)
    assert main(["convert", str(tmp_path / "o"), str(tmp_path / "o3"), "--tp", "3"]) == 0
    meta3 = json.loads((tmp_path / "o3" / "metadata.json").read_text())
    # a TP split is a grid: one record, three row chunks written by ranks 0, 1, 2
    assert meta3["tensors"]["layers.0.self_attn.q_proj.weight"]["grid"] == {
        "chunks": [[3], []], "writers": {"base": 0, "strides": [1]}}
    q = read_metadata(tmp_path / "o3").tensors["layers.0.self_attn.q_proj.weight"].shards
    assert sorted(sh.global_offset[0] for sh in q) == [0, 3, 6]
    back = {k: torch.empty_like(v) for k, v in ref.items()}
    load_state_dict(back, tmp_path / "o3")
    assert all(torch.equal(back[k], ref[k]) for k in ref)
    rules.write_text(json.dumps({"*norm.weight": 1}))
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "o2"), "--tp", "2",
                 "--tp-rules", str(rules)]) == 2
    assert not (tmp_path / "o2").exists()


# ---------------------------------------------------------------- every safetensors dtype, with and without AOA

def all_dtypes():
    g = torch.Generator().manual_seed(3)
    raw = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)  # noqa: E731
    return {
        "f64": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "f32": torch.randn(3, 4, generator=g),
        "f16": torch.randn(3, 4, generator=g).half(),
        "bf16": torch.randn(3, 4, generator=g).bfloat16(),
        "f8_e4m3": raw(12).view(torch.float8_e4m3fn).view(3, 4),
        "f8_e5m2": raw(12).view(torch.float8_e5m2).view(3, 4),
        "i64": torch.randint(-2**62, 2**62, (3, 4), generator=g),
        "i32": torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**15, 2**15 - 1, (3, 4), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (3, 4), generator=g, dtype=torch.int8),
        "u8": raw(12).view(3, 4),
        "bool": raw(12).view(3, 4) > 127,
        "u16": raw(24).view(torch.uint16).view(3, 4),
        "u32": raw(48).view(torch.uint32).view(3, 4),
        "u64": raw(96).view(torch.uint64).view(3, 4),
        "c64": torch.randn(3, 4, generator=g, dtype=torch.complex64),
    }


def test_every_dtype_from_hf_with_and_without_aoa(tmp_path):
    ref = all_dtypes()
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(ref)
    weight_map = {}
    for i, part in enumerate((names[:8], names[8:])):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: ref[k] for k in part}, hf / f)
        weight_map.update({k: f for k in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = tree_digest(hf)

    plain = {k: torch.zeros_like(v) for k, v in ref.items()}
    load_state_dict(plain, hf)
    assert all(torch.equal(bits(plain[k]), bits(ref[k])) for k in ref)

    # AOA: transpose, split and rename every tensor
    aoa = [f"{k}^T -> {k}.t" for k in names] + [f"{k}.t -> {k}.a, {k}.b, axis=0" for k in names]
    tgt = {f"{k}.a": torch.zeros(2, 3, dtype=ref[k].dtype) for k in names} | \
          {f"{k}.b": torch.zeros(2, 3, dtype=ref[k].dtype) for k in names}
    load_state_dict(tgt, hf, aoa_config=aoa)
    for k in names:
        t = ref[k].T
        assert torch.equal(bits(tgt[f"{k}.a"]), bits(t[:2])) and torch.equal(bits(tgt[f"{k}.b"]), bits(t[2:])), k

    # HF -> TP=2 oarlock (fp8/bool/int tensors split by a rule for every key) -> HF: bit-identical
    convert_checkpoint(hf, tmp_path / "oar", tp=2, tp_rules={"*": 1})
    export_hf(tmp_path / "oar", tmp_path / "back", max_shard_size=100)
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(ref)
    assert all(got[k].dtype == ref[k].dtype and torch.equal(bits(got[k]), bits(ref[k])) for k in ref)
    assert tree_digest(hf) == before


# ---------------------------------------------------------------- bad input: one line naming file and key; nothing written

def _hf_pair(root):
    root.mkdir()
    save_file({"a": torch.zeros(2, 2)}, root / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(3)}, root / "model-00002-of-00002.safetensors")
    return {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def _bad_source(tmp_path, kind):
    root = tmp_path / "src"
    if kind == "missing_file":
        wm = _hf_pair(root)
        wm["c"] = "model-00003-of-00003.safetensors"
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        return root, ["model.safetensors.index.json", "'c'", "model-00003-of-00003.safetensors"]
    if kind == "listed_twice":
        _hf_pair(root)
        save_file({"b": torch.ones(3)}, root / "model-00003-of-00003.safetensors")
        return root, ["'b' is stored twice", "model-00002-of-00002.safetensors", "model-00003-of-00003.safetensors"]
    if kind == "unknown_dtype":
        root.mkdir()
        p = root / "model.safetensors"
        save_file({"a": torch.zeros(2), "weird": torch.zeros(2, dtype=torch.int16)}, p)
        raw = p.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        header["weird"]["dtype"] = "F4"
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        p.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
        return root, ["model.safetensors", "weird"]
    if kind == "unsafe_pickle":
        import numpy as np

        from oarlock.checkpoint.formats import paddle_pickle as pp

        root.mkdir()
        (root / "0_0.distcp").write_bytes(pickle.dumps({"w": np.ones(2, dtype=np.float32)}))
        meta = pickle.dumps({"w": os.getcwd})  # references posix.getcwd: must never be resolved
        (root / "0.metadata").write_bytes(meta)
        assert pp  # the restricted unpickler lives there
        return root, ["0.metadata", "getcwd"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing_file", "listed_twice", "unknown_dtype", "unsafe_pickle"])
def test_bad_source_is_one_line_and_writes_nothing(tmp_path, kind, capsys):
    src, needles = _bad_source(tmp_path, kind)
    before = tree_digest(src)
    for to in ("hf", "oarlock"):
        dst = tmp_path / f"out_{to}"
        assert main(["convert", str(src), str(dst), "--to", to]) == 2
        err = capsys.readouterr().err
        assert err.startswith("oarlock: error: ") and err.count("\n") == 1, err
        for n in needles:
            assert n in err, (n, err)
        assert not dst.exists()
    assert tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temporary directory left behind


def test_convert_of_metadata_with_an_edited_dtype_reports_the_tensor_not_a_checksum(tmp_path, capsys):
    """A source whose metadata.json says float16 for a float32 tensor: the conversion fails naming the file and
    the tensor (before the fix its own half-written output's checksum error masked it), and leaves nothing."""
    src = tmp_path / "ck"
    save_state_dict({"a": torch.ones(2, 3), "b": torch.arange(4)}, src)
    meta = json.loads((src / "metadata.json").read_text())
    meta["tensors"]["a"]["dtype"] = "float16"
    (src / "metadata.json").write_text(json.dumps(meta))
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "oarlock"]) == 2
    err = capsys.readouterr().err
    assert "rank-00000.safetensors: tensor 'a' is float32, metadata says float16" in err, err
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_convert_carries_the_json_values(tmp_path):
    """A conversion to oarlock keeps the source's non-tensor values under their keys (a resumed job needs its
    step and settings), filtered like the tensors; ``oarlock diff`` then finds the two checkpoints equal."""
    import subprocess
    import sys

    a = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    save_state_dict({"a": a, "step": 7, "cfg": {"lr": 0.1, "names": ["x", "y"]}}, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp2", tp=2)
    out = {"a": torch.zeros(8, 4), "step": 0, "cfg": {"lr": 0.0, "names": []}}
    load_state_dict(out, tmp_path / "tp2")
    assert torch.equal(out["a"], a) and out["step"] == 7 and out["cfg"] == {"lr": 0.1, "names": ["x", "y"]}
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "diff", str(tmp_path / "src"), str(tmp_path / "tp2")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    convert_checkpoint(tmp_path / "src", tmp_path / "nocfg", exclude=["cfg.*"])
    with open_checkpoint(tmp_path / "nocfg") as rd:
        assert rd.metadata.objects == {"step": 7}
    # a NaN is a value a save stores, so it is carried; the optimizer's records go only with optimizer state
    import math

    save_state_dict({"a": a, "loss": float("nan"), "optimizer": {"algorithm": "adamw", "param_groups": [{"lr": 0.1}]}},
                    tmp_path / "opt")
    convert_checkpoint(tmp_path / "opt", tmp_path / "opt-model", optimizer_state=False)
    with open_checkpoint(tmp_path / "opt-model") as rd:
        assert list(rd.metadata.objects) == ["loss"] and math.isnan(rd.metadata.objects["loss"])
    convert_checkpoint(tmp_path / "opt", tmp_path / "opt-all")
    with open_checkpoint(tmp_path / "opt-all") as rd:
        assert rd.metadata.objects["optimizer.algorithm"] == "adamw"
        assert rd.metadata.objects["optimizer.param_groups"] == [{"lr": 0.1}]


def test_hf_export_of_a_wrapped_model_strips_the_wrapper_and_names_dropped_values(tmp_path, capsys):
    """``{"model": model.state_dict(), "step": 100}`` (no optimizer beside it) exports to the model's own names
    (before: 'model.0.weight'), and stderr names the value an HF checkpoint cannot hold (before: 'step' dropped
    silently). A flat state whose keys merely start with 'model.' (an HF Llama's) keeps them."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    save_state_dict({"model": m.state_dict(), "step": 100}, tmp_path / "ck")
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    cap = capsys.readouterr()
    got = st_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(m.state_dict())
    assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())
    assert "left out 1 non-tensor value(s) (an HF checkpoint holds tensors only): 'step'" in cap.err, cap.err
    assert "without their wrapper prefix 'model.'" in cap.out, cap.out
    flat = {"model.embed.weight": torch.randn(3, 2), "model.norm.weight": torch.randn(2)}
    save_state_dict(flat, tmp_path / "flat")
    assert main(["convert", str(tmp_path / "flat"), str(tmp_path / "hf_flat"), "--to", "hf"]) == 0
    assert "non-tensor" not in capsys.readouterr().err
    assert sorted(st_tensors(tmp_path / "hf_flat")) == sorted(flat)
    export_hf(tmp_path / "ck", tmp_path / "hf_api")  # the Python entry point strips it too
    assert sorted(st_tensors(tmp_path / "hf_api")) == sorted(m.state_dict())


def test_tp_split_that_cuts_heads_apart_warns(tmp_path):
    """convert --tp with a config.json beside the source: a degree that does not divide the key/value heads (3
    at TP=2: k_proj's 12 rows split 6/6, half a head each) warns naming the key, the head count and its field;
    a degree that divides every head count (TP=3) says nothing. The conversion itself is still written."""
    import warnings

    src = tmp_path / "hf"
    src.mkdir()
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.randn(24, 24),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(12, 24),
          "model.layers.0.self_attn.v_proj.weight": torch.randn(12, 24)}
    save_file(sd, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 3}))
    with pytest.warns(UserWarning, match=r"k_proj\.weight holds 3 heads \(num_key_value_heads") as rec:
        convert_checkpoint(src, tmp_path / "tp2", tp=2, show_progress=False)
    assert not any("q_proj" in str(w.message) for w in rec), [str(w.message) for w in rec]
    assert (tmp_path / "tp2" / "metadata.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(src, tmp_path / "tp3", tp=3, show_progress=False)
