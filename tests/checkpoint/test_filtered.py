"""Model-only and filtered operations on training checkpoints (model + optimizer state + objects)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from oarlock.checkpoint import (CheckpointMismatchError, convert_checkpoint, export_hf, load_sharded_optimizer_state_dict,
                                load_state_dict, open_checkpoint, save_state_dict, sharded_optimizer_state_dict,
                                sharded_state_dict)
from oarlock.cli import main


def _model(layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def _trained(layers: int):
    model = _model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture()
def train_ckpt(tmp_path):
    model, opt = _trained(4)
    msd = sharded_state_dict(model)
    save_state_dict({**msd, **sharded_optimizer_state_dict(opt, msd), "step": 7, "config": {"lr": 0.01}},
                    tmp_path / "train")
    return tmp_path, model, opt


def test_hf_export_holds_only_model_keys(train_ckpt, capsys):
    tmp, model, _ = train_ckpt
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    stored = open_checkpoint(tmp / "train").metadata
    assert len(stored.tensors) == 4 * len(ref)  # weights + exp_avg, exp_avg_sq, step for each
    export_hf(tmp / "train", tmp / "hf", show_progress=False)
    got = load_file(tmp / "hf" / "model.safetensors")
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # the CLI says what it left out, and keeps it on request
    assert main(["convert", str(tmp / "train"), str(tmp / "hf2"), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert f"left out {3 * len(ref)} optimizer state tensor(s)" in out
    # no --aoa/--preset: the stored (training) names are kept, and the CLI says how to map them
    assert any(f"keys written under their stored names (e.g. {k!r})" in out for k in ref), out
    assert "--preset NAME --model-config CONFIG.json" in out
    assert sorted(load_file(tmp / "hf2" / "model.safetensors")) == sorted(ref)
    assert main(["convert", str(tmp / "train"), str(tmp / "hf3"), "--to", "hf", "--keep-optimizer-state"]) == 0
    assert sorted(load_file(tmp / "hf3" / "model.safetensors")) == sorted(stored.tensors)


def test_convert_include_exclude(train_ckpt):
    tmp, model, _ = train_ckpt
    meta = convert_checkpoint(tmp / "train", tmp / "tp2", tp=2, include=["0.*", "1.*"], exclude=["*.step"],
                              show_progress=False)
    want = sorted(k for k in open_checkpoint(tmp / "train").metadata.tensors
                  if k.split(".")[0] in ("0", "1") and not k.endswith(".step"))
    assert sorted(meta.tensors) == want and len(want) == 12
    got = {k: torch.empty(8, 8) if k.endswith("weight") or "weight." in k else torch.empty(8) for k in want}
    load_state_dict(got, tmp / "tp2")
    assert torch.equal(got["1.weight"], model[1].weight.detach())
    with pytest.raises(Exception, match="no tensor left"):
        export_hf(tmp / "train", tmp / "none", include=["nothing.*"], show_progress=False)


def test_strict_model_load_from_training_checkpoint(train_ckpt):
    tmp, model, _ = train_ckpt
    fresh = _model(4, seed=1)
    sd = sharded_state_dict(fresh)
    with pytest.raises(CheckpointMismatchError, match="model_only=True"):
        load_state_dict(sd, tmp / "train")  # strict: the optimizer state and objects are unexpected
    rep = load_state_dict(sd, tmp / "train", model_only=True, ignore_unexpected=["step", "config.*"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert "0.weight.exp_avg" in rep.unexpected_keys  # still reported, just not an error
    with pytest.raises(CheckpointMismatchError, match="'step'"):
        load_state_dict(sd, tmp / "train", model_only=True)  # objects that are not the optimizer's stay unexpected
    load_state_dict(sd, tmp / "train", ignore_unexpected=True)
    # missing keys are never excused
    with pytest.raises(CheckpointMismatchError, match="missing keys"):
        load_state_dict({**sd, "extra.weight": torch.zeros(2)}, tmp / "train", ignore_unexpected=True)


def test_objects_come_back_in_one_load(train_ckpt):
    tmp, model, _ = train_ckpt
    target = {"0.weight": torch.zeros(8, 8), "step": None, "config": {"lr": None}}
    load_state_dict(target, tmp / "train", ignore_unexpected=True)
    assert target["step"] == 7 and target["config"] == {"lr": 0.01}
    assert torch.equal(target["0.weight"], model[0].weight.detach())


def test_optimizer_load_never_takes_a_smaller_model_silently(train_ckpt):
    tmp, model, opt = train_ckpt
    small, small_opt = _trained(2)
    msd = sharded_state_dict(small)
    with pytest.raises(CheckpointMismatchError, match="'2.weight'"):
        load_sharded_optimizer_state_dict(small_opt, msd, tmp / "train", load_model=True)
    with pytest.raises(CheckpointMismatchError, match="optimizer states of parameters this optimizer does not have"):
        load_sharded_optimizer_state_dict(small_opt, msd, tmp / "train")
    before = small[0].weight.detach().clone()
    load_sharded_optimizer_state_dict(small_opt, msd, tmp / "train", load_model=True, strict=False)
    assert not torch.equal(before, model[0].weight) and torch.equal(small[0].weight, model[0].weight)
    # the matching model loads strictly
    same, same_opt = _trained(4)
    load_sharded_optimizer_state_dict(same_opt, sharded_state_dict(same), tmp / "train", load_model=True)
    assert torch.equal(same_opt.state[same[3].bias]["exp_avg"], opt.state[model[3].bias]["exp_avg"])


def test_recorded_optimizer_keys_are_filtered_on_read(tmp_path):
    """A metadata.json whose ``extra.optimizer_keys`` holds junk (numbers, objects, paths, unknown keys) opens
    without error; only strings naming stored tensors count as marked, and a non-list entry is ignored."""
    import json

    save_state_dict({"w": torch.ones(2), "w.m": torch.zeros(2)}, tmp_path / "ck")
    meta_file = tmp_path / "ck" / "metadata.json"
    rec = json.loads(meta_file.read_text())
    rec["extra"]["optimizer_keys"] = [5, {"k": 1}, "../../etc/passwd", "nope", "w.m"]
    meta_file.write_text(json.dumps(rec))
    with open_checkpoint(tmp_path / "ck") as r:
        assert r.metadata.optimizer_keys == ["w.m"]
        assert r.metadata.optimizer_state_keys() == ["w.m"]
    rec["extra"]["optimizer_keys"] = "w"
    meta_file.write_text(json.dumps(rec))
    with open_checkpoint(tmp_path / "ck") as r:
        assert r.metadata.optimizer_keys == [] and r.metadata.optimizer_state_keys() == []
