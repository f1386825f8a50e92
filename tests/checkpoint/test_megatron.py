"""Megatron-Core ``torch_dist`` checkpoints written by the real ``megatron.core.dist_checkpointing.save`` of a
``GPTModel`` with tensor parallelism 2 on 2 gloo ranks (CPU), in ``.foreign-venv`` (scripts/foreign_env.sh; the
tests skip without it). References are the writer's own per-rank parameters, placed by Megatron's documented
sharding: stacked layer axis, column-parallel rows (QKV per query group, fc1 as gate and up halves),
row-parallel columns, vocabulary rows.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.cli import main

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".foreign-venv" / "bin" / "python"
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
L, TP = 2, 2


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    if not PY.exists():
        pytest.skip("no .foreign-venv (run scripts/foreign_env.sh): Megatron-Core is not installed")
    out = tmp_path_factory.mktemp("megatron")
    # the writers run as multirank scenarios on 2 ranks: a failure names the scenario and the rank
    writers = Path(__file__).with_name("_foreign_writers.py")
    r = subprocess.run([str(PY), str(REPO / "tests" / "multirank.py"), str(writers), "2", str(out), "megatron_gpt_tp2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    return out


def expected(out: Path) -> dict[str, torch.Tensor]:
    """Global tensors under Megatron's checkpoint keys, assembled from each TP rank's own parameters."""
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=True) for r in range(TP)]
    cat0 = lambda name: torch.cat([refs[r][name] for r in range(TP)], 0)  # noqa: E731
    cat1 = lambda name: torch.cat([refs[r][name] for r in range(TP)], 1)  # noqa: E731
    layer = "decoder.layers.{}."
    exp = {"embedding.word_embeddings.weight": cat0("embedding.word_embeddings.weight"),
           "output_layer.weight": cat0("output_layer.weight"),
           "decoder.final_layernorm.weight": refs[0]["decoder.final_layernorm.weight"]}
    stack = lambda f: torch.stack([f(layer.format(i)) for i in range(L)])  # noqa: E731
    exp["decoder.layers.self_attention.linear_qkv.weight"] = stack(lambda p: cat0(p + "self_attention.linear_qkv.weight"))
    exp["decoder.layers.self_attention.linear_proj.weight"] = stack(lambda p: cat1(p + "self_attention.linear_proj.weight"))
    exp["decoder.layers.mlp.linear_fc2.weight"] = stack(lambda p: cat1(p + "mlp.linear_fc2.weight"))
    half = lambda p, r, j: refs[r][p + "mlp.linear_fc1.weight"].chunk(2)[j]  # noqa: E731  (gate, up) per rank
    exp["decoder.layers.mlp.linear_fc1.weight"] = stack(
        lambda p: torch.cat([half(p, r, 0) for r in range(TP)] + [half(p, r, 1) for r in range(TP)]))
    exp["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] = stack(lambda p: refs[0][p + "input_layernorm.weight"])
    exp["decoder.layers.mlp.linear_fc1.layer_norm_weight"] = stack(lambda p: refs[0][p + "pre_mlp_layernorm.weight"])
    return exp


def test_megatron_tensors_and_common(written):
    exp = expected(written)
    with open_checkpoint(written / "ckpt") as r:
        meta = r.metadata
        assert meta.format == "megatron"
        assert set(meta.tensors) == set(exp)
        fc1 = meta.tensors["decoder.layers.mlp.linear_fc1.weight"]
        assert len(fc1.shards) == L * TP * 2  # gate and up chunks of one key per layer and TP rank
        assert meta.objects["common.iteration"] == 7
        assert meta.objects["common.args"]["tensor_model_parallel_size"] == 2
        assert meta.extra["megatron"]["backend"]["sharded_backend"] == "torch_dist"
    # 2 ranks saved; one process loads everything (2 -> 1), chunk by chunk through the planner
    got = {k: torch.zeros_like(v) for k, v in exp.items()}
    load_state_dict(got, written / "ckpt", strict=False)
    for k, v in exp.items():
        assert torch.equal(got[k], v), k
    # and a TP-4-like box of one stacked key: layer 1, rows 96..144 of fc1 (the first half of "up")
    box = {"decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 192, 64)}
    load_state_dict(box, written / "ckpt", strict=False)
    assert torch.equal(box["decoder.layers.mlp.linear_fc1.weight"][1, 96:144], exp[
        "decoder.layers.mlp.linear_fc1.weight"][1, 96:144])


def test_megatron_convert_and_inspect(written, tmp_path, capsys):
    exp = expected(written)
    out = tmp_path / "oar"
    assert main(["convert", str(written / "ckpt"), str(out), "--to", "oarlock", "--tp", "4"]) == 0
    got = {k: torch.zeros_like(v) for k, v in exp.items()}
    load_state_dict(got, out, strict=False)
    for k, v in exp.items():
        assert torch.equal(got[k], v), k
    capsys.readouterr()
    assert main(["inspect", str(written / "ckpt")]) == 0
    assert "megatron checkpoint, 9 tensors" in capsys.readouterr().out


def test_megatron_broken(written, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(written / "ckpt", d)
    (d / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    with pytest.raises(CheckpointFormatError, match="sharded_backend 'zarr' is not supported"):
        open_checkpoint(d)
    shutil.copy(written / "ckpt" / "metadata.json", d / "metadata.json")
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (d / "common.pt").write_bytes(b"")
    torch.save({"iteration": 1, "hook": Evil()}, d / "common.pt")  # a common.pt calling os.system
    with open_checkpoint(d) as r:
        assert "common_error" in r.metadata.extra["megatron"] and r.metadata.extra["megatron"]["common_error"]
        assert "common.iteration" not in r.metadata.objects
    assert not (tmp_path / "pwned").exists()
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafePickleError):
        open_checkpoint(d)
    assert not (tmp_path / "pwned").exists()
    (d / ".metadata").write_bytes((written / "ckpt" / ".metadata").read_bytes())
    f = d / "__1_1.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match=r"__1_1\.distcp: truncated"):
        open_checkpoint(d)
