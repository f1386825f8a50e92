"""Real models through `convert`: SmolLM2-135M (Llama, GQA 9/3 heads) HF -> fused-QKV/gate-up TP=3 oarlock -> HF
with identical transformers logits, and checkpoints written by PaddlePaddle 3.3.1 itself loaded with AOA."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from oarlock.checkpoint import ShardedWeight, load_state_dict
from oarlock.checkpoint.convert import convert_checkpoint, export_hf
from paddle_venv import paddle_python
from testkit import st_tensors


@pytest.mark.slow
def test_smollm2_tp3_round_trip_logits(cache_dir, tmp_path):
    smollm2 = pytest.importorskip("oarlock.models.smollm2")
    from oarlock.models.llama import (LlamaConfig, convert_hf_state_dict, ffn_fused_permutation, hf_aoa_config)
    from transformers import LlamaForCausalLM

    try:
        hf = smollm2.ensure_hf_checkpoint(cache_dir)
    except smollm2.MissingModelPackageError as e:
        pytest.skip(str(e))
    config = LlamaConfig.from_hf(json.loads((hf / "config.json").read_text()))
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    ref = st_tensors(hf)
    # save_pretrained drops the tied lm_head.weight; hf_aoa_config's "lm_head.weight -> _" needs it to exist
    aoa = [st for st in hf_aoa_config(config) if not st.startswith("lm_head.weight") or "lm_head.weight" in ref]
    oar, back = tmp_path / "tp3", tmp_path / "hf"
    meta = convert_checkpoint(hf, oar, aoa_config=aoa, tp=3)
    assert len(meta.files) == 3

    # the TP=3 shards are what the plain-torch reference converter gives, cut for 3 ranks
    layer = {k.replace("model.layers.7.", "model.layers.0."): v for k, v in ref.items() if ".layers.7." in k}
    one = convert_hf_state_dict({**layer, "model.embed_tokens.weight": ref["model.embed_tokens.weight"],
                                 "model.norm.weight": ref["model.norm.weight"]},
                                LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1}))
    perm = ffn_fused_permutation(config.intermediate_size, 3)
    want = {"layers.7.self_attn.qkv_proj.weight": one["layers.0.self_attn.qkv_proj.weight"],
            "layers.7.mlp.gate_up_proj.weight": one["layers.0.mlp.gate_up_proj.weight"][perm],
            "layers.7.self_attn.o_proj.weight": one["layers.0.self_attn.o_proj.weight"]}
    for key, full in want.items():
        t = meta.tensors[key]
        assert len(t.shards) == 3
        for s in t.shards:
            with safe_open(str(oar / s.file), "pt") as fh:
                box = tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))
                assert torch.equal(fh.get_tensor(key), full[box]), (key, s)

    export_hf(oar, back, aoa_config={"aoa_statements": aoa, "aoa_config_reverse": True}, max_shard_size="200MB")
    got = st_tensors(back)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    ids = torch.tensor([[1, 504, 3458, 282, 260, 1789, 30, 2], [5, 17, 9000, 42, 7, 123, 49151, 0]])
    logits = []
    for d in (hf, back):
        model = LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
        del model
    assert torch.equal(logits[0], logits[1])


# ---------------------------------------------------------------- PaddlePaddle 3.3.1 as the writer

PADDLE_SAVE = r"""
import sys, numpy as np, paddle, paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

def arrays():
    rng = np.random.default_rng(0)
    return {"rows": rng.standard_normal((6, 4)).astype("float32"),
            "cols": rng.standard_normal((3, 8)).astype("float32"),
            "flat": rng.standard_normal((4, 5)).astype("float32"),
            "linear.weight": rng.standard_normal((4, 3)).astype("float32"),  # Paddle Linear: [in, out]
            "linear.bias": rng.standard_normal(3).astype("float32"),
            "half": rng.standard_normal((2, 6)).astype("float32"),
            "ids": np.arange(10, dtype="int64")}

def main(out):
    dist.init_parallel_env()
    r = dist.get_rank()
    a = arrays()
    t = paddle.to_tensor
    cut = [0, 7, 20][r:r + 2]  # flattened ZeRO-style ranges that cut rows mid-way
    sd = {
        "rows": ShardedWeight("rows", t(a["rows"][3 * r:3 * r + 3]), (3, 4), (6, 4), (3 * r, 0)),
        "cols": ShardedWeight("cols", t(a["cols"][:, 4 * r:4 * r + 4]), (3, 4), (3, 8), (0, 4 * r)),
        "flat": ShardedWeight("flat", t(a["flat"].reshape(-1)[cut[0]:cut[1]]), (4, 5), (4, 5), (0, 0),
                              is_flattened=True, flattened_range=slice(cut[0], cut[1])),
        "linear.weight": ShardedWeight("linear.weight", t(a["linear.weight"]), (4, 3), (4, 3), (0, 0)),
        "linear.bias": ShardedWeight("linear.bias", t(a["linear.bias"]), (3,), (3,), (0,)),
        "half": ShardedWeight("half", t(a["half"][r:r + 1]).astype("bfloat16"), (1, 6), (2, 6), (r, 0)),
        "ids": ShardedWeight("ids", t(a["ids"][5 * r:5 * r + 5]), (5,), (10,), (5 * r,)),
    }
    dist.save_state_dict(sd, out + "/distcp")
    dist.save_state_dict(sd, out + "/st", safetensors=True)

if __name__ == "__main__":
    np.savez(sys.argv[1] + "/ref.npz", **arrays())
    dist.spawn(main, args=(sys.argv[1],), nprocs=2, backend="gloo")
"""


@pytest.fixture(scope="module")
def paddle_checkpoints(tmp_path_factory):
    py = paddle_python()
    root = tmp_path_factory.mktemp("paddle")
    script = root / "save.py"
    script.write_text(PADDLE_SAVE)
    r = subprocess.run([py, str(script), str(root)], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {k: torch.from_numpy(v) for k, v in np.load(root / "ref.npz").items()}
    return root, ref


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["distcp", "st"])
def test_real_paddle_sharded_checkpoint_into_torch(paddle_checkpoints, variant):
    root, ref = paddle_checkpoints
    src = root / variant
    assert sorted(p.name for p in src.iterdir() if not p.name.endswith(".lock")) == (
        ["0.metadata", "0_0.distcp", "1_0.distcp"] if variant == "distcp"
        else ["0.metadata", "0_0.safetensors", "1_0.safetensors"])
    # whole tensors (bf16 stays bf16: Paddle rounded the fp32 values)
    sd = {k: torch.zeros(v.shape, dtype=torch.bfloat16 if k == "half" else v.dtype) for k, v in ref.items()
          if not k.startswith("linear.")}
    linear = torch.nn.Linear(4, 3)  # torch Linear: weight [out, in]
    sd["linear"] = linear.state_dict()
    load_state_dict(sd, src, aoa_config=["linear.weight^T -> linear.weight"])
    for k in ("rows", "cols", "flat", "ids"):
        assert torch.equal(sd[k], ref[k]), k
    assert torch.equal(sd["half"], ref["half"].to(torch.bfloat16))
    linear.load_state_dict(sd["linear"])
    assert torch.equal(linear.weight, ref["linear.weight"].T) and torch.equal(linear.bias, ref["linear.bias"])
    x = torch.randn(5, 4)
    assert torch.allclose(linear(x), x @ ref["linear.weight"] + ref["linear.bias"], atol=1e-6)
    # into other shardings: a flattened range of "rows" and a column block of "cols"
    a = ShardedWeight("rows", torch.zeros(9), (6, 4), (6, 4), (0, 0), (5, 14))
    b = ShardedWeight("cols", torch.zeros(3, 3), (3, 3), (3, 8), (0, 3))
    load_state_dict({"a": a, "b": b}, src, strict=False)
    assert torch.equal(a.local_tensor, ref["rows"].reshape(-1)[5:14]) and torch.equal(b.local_tensor, ref["cols"][:, 3:6])
    # and through `convert` to HF with the transpose: the export holds torch-layout tensors
    out = root / f"hf_{variant}"
    export_hf(src, out, aoa_config=["linear.weight^T -> linear.weight"])
    got = st_tensors(out)
    assert torch.equal(got["linear.weight"], ref["linear.weight"].T) and torch.equal(got["flat"], ref["flat"])
    assert sys.modules.get("paddle") is None  # oarlock never imports Paddle
