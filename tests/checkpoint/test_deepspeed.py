"""DeepSpeed ZeRO 1/2/3 checkpoints written by the real DeepSpeed (``engine.save_checkpoint`` of a tiny HF Llama
on 2 gloo CPU ranks, AdamW, two steps) in ``.foreign-venv`` (scripts/foreign_env.sh; skipped without it).
References: DeepSpeed's own ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` on the writer."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import ShardedWeight, load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.cli import main

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".foreign-venv" / "bin" / "python"
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    if not PY.exists():
        pytest.skip("no .foreign-venv (run scripts/foreign_env.sh): DeepSpeed is not installed")
    out = tmp_path_factory.mktemp("deepspeed")
    # the writers run as multirank scenarios on 2 ranks: a failure names the scenario and the rank
    writers = Path(__file__).with_name("_foreign_writers.py")
    r = subprocess.run([str(PY), str(REPO / "tests" / "multirank.py"), str(writers), "2", str(out),
                        "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_fp32_weights_and_moments(written, stage):
    """Saved on 2 ranks, loaded whole in one process: every fp32 master weight and Adam moment bit-exact."""
    ref = torch.load(written / f"z{stage}" / "ref.pt", weights_only=True)
    with open_checkpoint(written / f"z{stage}" / "ckpt") as r:  # the save directory: 'latest' names the tag
        meta = r.metadata
        assert meta.format == "deepspeed" and meta.extra["deepspeed"]["zero_stage"] == stage
        q = meta.tensors["model.layers.0.self_attn.q_proj.weight"]
        assert all(s.flattened_range is not None for s in q.shards)
        assert meta.objects["optim.param_groups"][0]["lr"] == 0.01 and meta.objects["global_steps"] == 2
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    report = load_state_dict(got, written / f"z{stage}" / "ckpt", strict=False)
    assert report.missing_keys == []
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reshard_to_three_data_parallel_ranks(written, stage):
    """A different data-parallel degree than saved (2 -> 3, DeepSpeed#3810): each of 3 ranks loads its own
    ZeRO-style flat partition of every parameter (flattened ShardedWeights, one rank at a time, no process
    group) straight from the 2-rank files."""
    ref = torch.load(written / f"z{stage}" / "ref.pt", weights_only=True)
    names = [k for k in ref if not k.startswith("optim.")]
    for r in range(3):
        targets = {}
        for k in names + [f"optim.state.{n}.exp_avg" for n in names]:
            n = ref[k].numel()
            ps = math.ceil(n / 3)
            a, b = min(r * ps, n), min((r + 1) * ps, n)
            targets[k] = ShardedWeight(k, torch.zeros(b - a), tuple(ref[k].shape), tuple(ref[k].shape),
                                       (0,) * ref[k].dim(), (a, b))
        load_state_dict(targets, written / f"z{stage}" / "ckpt", strict=False)
        for k, sw in targets.items():
            a, b = sw.flattened_range
            assert torch.equal(sw.local_tensor, ref[k].reshape(-1)[a:b]), (r, k)


def test_zero_to_hf_loads_in_transformers(written, tmp_path):
    """`oarlock convert <ds dir> OUT --to hf` with an AOA config dropping the optimizer state; config.json put
    next to the checkpoint travels along; transformers loads OUT with the fp32 master weights."""
    import sys

    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from _foreign_writers import tiny_llama_config

    src = tmp_path / "src"
    shutil.copytree(written / "z3" / "ckpt", src)
    tiny_llama_config().save_pretrained(src)
    ref = torch.load(written / "z3" / "ref.pt", weights_only=True)
    with open_checkpoint(src) as r:
        drops = sorted({k.rsplit(".", 1)[0] for k in r.metadata.tensors if k.startswith("optim.")})
    # statements name the parameter; its optimizer states (.exp_avg, .exp_avg_sq, .step) follow it
    aoa = tmp_path / "drop.aoa"
    aoa.write_text("\n".join(f"{k} -> _" for k in drops) + "\n")
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--aoa", str(aoa)]) == 0
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_zero_hostile_and_broken(written, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(written / "z2" / "ckpt", d)
    tag = d / "global_step2"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    good = (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes()
    torch.save({"optimizer_state_dict": Evil()}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFormatError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: not a weights-only"):
        open_checkpoint(d)
    assert not (tmp_path / "pwned").exists()
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointFormatError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        open_checkpoint(d)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointFormatError,
                       match=r"saved by 2 ranks, but optimizer state files of ranks \[1\] are missing"):
        open_checkpoint(d)
