"""DeepSpeed ZeRO 1/2/3 checkpoints written by the real DeepSpeed (``engine.save_checkpoint`` of a tiny HF Llama
on 2 gloo CPU ranks, AdamW, two steps) in ``.foreign-venv`` (scripts/foreign_env.sh; skipped without it).
Also ZeRO-1 in one process with AdamW, as written and with the integer ``step`` DeepSpeed's FusedAdam stores.
References: DeepSpeed's own ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` on the writer."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import ShardedWeight, load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.cli import main
from testkit import st_tensors

REPO = Path(__file__).resolve().parents[2]
# through the venv's real path, as scripts/foreign_env.sh prebuilt DeepSpeed's C++ op: same build commands, so
# torch finds the op up to date (a checkout whose .foreign-venv is a symlink would otherwise rebuild it)
VENV = (REPO / ".foreign-venv").resolve()
PY = VENV / "bin" / "python"
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).parent))
from _foreign_writers import SHM_OP, deepspeed_op_ready, extensions_dir, tiny_llama_config  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    if not PY.exists():
        pytest.skip("no .foreign-venv (run scripts/foreign_env.sh): DeepSpeed is not installed")
    so = Path(extensions_dir(str(VENV))) / SHM_OP / f"{SHM_OP}.so"
    if not so.is_file():
        pytest.skip(f"DeepSpeed's {SHM_OP} op is not prebuilt ({so}): run scripts/foreign_env.sh")
    built = so.stat().st_mtime_ns
    out = tmp_path_factory.mktemp("deepspeed")
    # the writers run as multirank scenarios on 2 ranks: a failure names the scenario and the rank
    writers = Path(__file__).with_name("_foreign_writers.py")
    r = subprocess.run([str(PY), str(REPO / "tests" / "multirank.py"), str(writers), "2", str(out),
                        "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    # DeepSpeed loaded the prebuilt op from .foreign-venv/torch_extensions: nothing was rebuilt during the tests
    assert so.stat().st_mtime_ns == built, f"{so} was rebuilt by a test run"
    return out


def test_deepspeed_op_lock_fails_fast(tmp_path):
    """A build lock left by a killed process (torch.utils.cpp_extension would wait on it forever, taking it even
    for an up-to-date op) fails the writer within the wait, naming the lock file; a live holder's lock, released
    during the wait, does not; an op that is not prebuilt is named with the script that builds it."""
    import threading

    ext = tmp_path / "torch_extensions"
    with pytest.raises(RuntimeError, match=r"not prebuilt .*deepspeed_shm_comm\.so is missing.*scripts/foreign_env"):
        deepspeed_op_ready(str(ext), wait_s=0.2)
    (ext / SHM_OP).mkdir(parents=True)
    (ext / SHM_OP / f"{SHM_OP}.so").write_bytes(b"")
    deepspeed_op_ready(str(ext), wait_s=0.2)  # prebuilt, no lock
    lock = ext / SHM_OP / "lock"
    lock.touch()
    with pytest.raises(RuntimeError, match="stale torch extension build lock " + re.escape(str(lock))):
        deepspeed_op_ready(str(ext), wait_s=0.3)
    assert lock.exists()  # reported, not deleted
    threading.Timer(0.2, lock.unlink).start()  # a live holder releasing it
    deepspeed_op_ready(str(ext), wait_s=30)
    assert not lock.exists()


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


def test_zero_to_hf_model_weights_only(written, tmp_path, capsys):
    """`oarlock convert <ds dir> OUT --to hf`, no AOA: the export holds exactly the model weights, each equal to
    DeepSpeed's own full fp32 parameter, and the CLI says the optimizer state was left out; config.json put next
    to the checkpoint travels along and transformers loads OUT. --keep-optimizer-state keeps the Adam moments."""
    from transformers import LlamaForCausalLM

    src = tmp_path / "src"
    shutil.copytree(written / "z3" / "ckpt", src)
    tiny_llama_config().save_pretrained(src)
    ref = torch.load(written / "z3" / "ref.pt", weights_only=True)
    params = {k: v for k, v in ref.items() if not k.startswith("optim.")}
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    text = capsys.readouterr().out
    # per parameter: exp_avg, exp_avg_sq and step
    assert f"left out {3 * len(params)} optimizer state tensor(s) (model weights only; --keep-optimizer-state" in text
    got = st_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(params)
    for k, v in params.items():
        assert torch.equal(got[k], v), k
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # the explicit way to include them
    assert main(["convert", str(src), str(tmp_path / "hf_opt"), "--to", "hf", "--keep-optimizer-state"]) == 0
    assert "left out" not in capsys.readouterr().out
    got = st_tensors(tmp_path / "hf_opt")
    assert len(got) == 4 * len(params)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


def test_zero_to_oarlock_to_hf_keeps_optimizer_marking(written, tmp_path, capsys):
    """DeepSpeed -> oarlock (TP=2, everything kept) -> HF: the oarlock checkpoint records which tensors the
    DeepSpeed reader marked as optimizer state, so the HF export still holds exactly the model weights (each equal
    to DeepSpeed's own fp32 parameter)."""
    ref = torch.load(written / "z3" / "ref.pt", weights_only=True)
    params = {k: v for k, v in ref.items() if not k.startswith("optim.")}
    assert main(["convert", str(written / "z3" / "ckpt"), str(tmp_path / "oar"), "--to", "oarlock"]) == 0
    meta = json.loads((tmp_path / "oar" / "metadata.json").read_text())
    assert len(meta["extra"]["optimizer_keys"]) == 3 * len(params)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "oar"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert f"left out {3 * len(params)} optimizer state tensor(s)" in capsys.readouterr().out
    got = st_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(params)
    for k, v in params.items():
        assert torch.equal(got[k], v), k


def test_zero_model_only_strict_load(written):
    """A strict load of the model from the training checkpoint: the optimizer state and the engine's records
    (global_steps, ds_config, optim.param_groups) are unexpected unless model_only=True, and the hint says so."""
    from oarlock.checkpoint.errors import CheckpointMismatchError

    ref = torch.load(written / "z2" / "ref.pt", weights_only=True)
    target = {k: torch.zeros_like(v) for k, v in ref.items() if not k.startswith("optim.")}
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys .*'global_steps'.*'optim\.state\..*"
                       r"none of them are model weights: this deepspeed checkpoint.*pass model_only=True"):
        load_state_dict(target, written / "z2" / "ckpt")
    report = load_state_dict(target, written / "z2" / "ckpt", model_only=True)
    assert report.missing_keys == [] and "global_steps" in report.unexpected_keys
    for k, v in target.items():
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


@pytest.fixture(scope="module")
def written_adamw(tmp_path_factory) -> Path:
    """ZeRO-1, one CPU process, AdamW (``deepspeed_zero1_adamw``): ``ckpt`` as written, ``ckpt_intstep`` with
    each group's step a Python int as DeepSpeed's FusedAdam stores it."""
    if not PY.exists():
        pytest.skip("no .foreign-venv (run scripts/foreign_env.sh): DeepSpeed is not installed")
    so = Path(extensions_dir(str(VENV))) / SHM_OP / f"{SHM_OP}.so"
    if not so.is_file():
        pytest.skip(f"DeepSpeed's {SHM_OP} op is not prebuilt ({so}): run scripts/foreign_env.sh")
    out = tmp_path_factory.mktemp("deepspeed_adamw")
    r = subprocess.run([str(PY), str(REPO / "tests" / "multirank.py"),
                        str(Path(__file__).with_name("_foreign_writers.py")), "1", str(out), "deepspeed_zero1_adamw"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    steps = json.loads((out / "z1w" / "steps.json").read_text())
    assert steps["steps"] == [2] and steps["groups"] == 1  # the rewritten file holds a Python int
    return out / "z1w"


@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_intstep"])
def test_zero1_adamw_verify_is_clean(written_adamw, ckpt, capsys):
    """`oarlock verify` on a healthy ZeRO-1 AdamW checkpoint: intact, exit 0 (an integer step is a step)."""
    capsys.readouterr()
    assert main(["verify", str(written_adamw / ckpt), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["problems"] == [], rep["problems"]


@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_intstep"])
def test_zero1_adamw_targets_as_inspect_lists_them(written_adamw, ckpt, capsys):
    """Targets keyed and shaped exactly as `oarlock inspect --json` lists the tensors load with no missing key:
    weights and moments equal DeepSpeed's own full fp32 values, every step equals the stored step (2)."""
    ref = torch.load(written_adamw / "ref.pt", weights_only=True)
    assert main(["inspect", str(written_adamw / ckpt), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tensors"]
    targets = {t["key"]: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"])) for t in listed}
    report = load_state_dict(targets, written_adamw / ckpt, strict=False)
    assert report.missing_keys == []
    for k, v in ref.items():
        assert torch.equal(targets[k], v), k
    steps = [k for k in targets if k.endswith(".step")]
    assert len(steps) == len([k for k in ref if not k.startswith("optim.")])
    for k in steps:
        assert targets[k].item() == 2.0, k


@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_intstep"])
def test_zero1_adamw_deepspeed_targets_from_the_model(written_adamw, ckpt):
    """The README's snippet: ``deepspeed_targets(model)`` of the training model (not torch's
    ``{"model": ..., "optim": opt.state_dict()}``) loads the checkpoint with nothing missing, values equal to
    DeepSpeed's own; the only unexpected keys are the engine's records."""
    from transformers import LlamaForCausalLM

    from oarlock.checkpoint.formats.deepspeed import deepspeed_targets

    ref = torch.load(written_adamw / "ref.pt", weights_only=True)
    targets = deepspeed_targets(LlamaForCausalLM(tiny_llama_config()))
    report = load_state_dict(targets, written_adamw / ckpt, strict=False)
    assert report.missing_keys == []
    with open_checkpoint(written_adamw / ckpt) as r:
        assert set(report.unexpected_keys) <= set(r.metadata.non_model_keys)
    for k, v in ref.items():
        assert torch.equal(targets[k], v), k
    assert all(targets[k].item() == 2.0 for k in targets if k.endswith(".step"))
