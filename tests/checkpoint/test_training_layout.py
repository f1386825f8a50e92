"""torch's training-state layout end to end (issue 29, section 1): ``get_state_dict(model, optim)`` of an FSDP2
HF Llama saved as ``{"model": ..., "optim": ...}`` by oarlock and by ``dcp.save`` (real writers, one gloo CPU
rank: ``_training_layout_scenarios.py``), and torchtitan's top-level entries. References: the FSDP2 model's own
full state dict and eval-mode logits, and transformers loading the export."""

from __future__ import annotations

import json

import pytest
import torch

from oarlock.checkpoint import load_state_dict, open_checkpoint, save_state_dict
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.cli import main
from testkit import st_tensors

pytestmark = [pytest.mark.multiproc]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from multirank import run_scenarios

    root = tmp_path_factory.mktemp("training_layout")
    run_scenarios("_training_layout_scenarios", 1, root).check()
    return root


def _hf_export_matches(hf, full):
    """The HF export ``hf`` holds exactly the tensors of ``full`` (read with safetensors) and transformers loads it
    with no missing or unexpected key; returns the loaded model."""
    from transformers import LlamaForCausalLM

    got = st_tensors(hf)
    assert sorted(got) == sorted(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    model, info = LlamaForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    return model


@pytest.mark.parametrize("src", ["oar", "dcp"])
def test_export_hf_holds_model_weights_under_transformers_names(written, tmp_path, capsys, src):
    """`oarlock convert SRC OUT --to hf` on torch's training state: no optimizer tensor and no param group in the
    HF files, the ``model.`` wrapper stripped (the CLI says both), and transformers loads OUT with no missing or
    unexpected key, every weight equal to the FSDP2 model's full state dict and the logits equal to its own."""
    full = torch.load(written / "full.pt", weights_only=True)
    ref = torch.load(written / "logits.pt", weights_only=True)
    capsys.readouterr()
    assert main(["convert", str(written / src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    text = capsys.readouterr().out
    n_opt = 3 * len(full)  # exp_avg, exp_avg_sq and step per parameter
    assert f"left out {n_opt} optimizer state tensor(s)" in text, text
    assert "without their wrapper prefix 'model.'" in text, text
    model = _hf_export_matches(tmp_path / "hf", full)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    assert torch.equal(logits, ref["logits"])


@pytest.mark.parametrize("src", ["oar", "dcp"])
def test_inspect_marks_training_entries_and_prefix(written, capsys, src):
    with open_checkpoint(written / src) as r:
        meta = r.metadata
    opt = meta.optimizer_state_keys()
    assert "optim.state.lm_head.weight.exp_avg" in opt and "optim.state.lm_head.weight.step" in opt
    assert not any(k.startswith("model.") for k in opt)
    assert any(k.startswith("optim.param_groups") for k in meta.non_model_keys), meta.non_model_keys
    assert meta.model_prefix == "model."
    capsys.readouterr()
    assert main(["inspect", str(written / src)]) == 0
    text = capsys.readouterr().out
    assert "model weights under the wrapper prefix 'model.'" in text
    assert f"not model weights: {len(opt)} optimizer state tensor(s)" in text
    assert main(["inspect", str(written / src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_prefix"] == "model." and sorted(doc["optimizer_state_keys"]) == sorted(opt)


@pytest.mark.parametrize("src", ["oar", "dcp"])
def test_model_only_strict_load(written, src):
    """``{"model": model.state_dict()}`` targets load strictly with model_only=True (optimizer state and param
    groups ignored); without it they are unexpected and the hint names model_only."""
    from transformers import LlamaForCausalLM

    full = torch.load(written / "full.pt", weights_only=True)
    from _training_layout_scenarios import tiny_llama_config

    target = {"model": {k: torch.zeros_like(v) for k, v in LlamaForCausalLM(tiny_llama_config()).state_dict().items()}}
    with pytest.raises(CheckpointMismatchError, match=r"optim\.state\..*model_only=True"):
        load_state_dict(target, written / src)
    report = load_state_dict(target, written / src, model_only=True)
    assert report.missing_keys == []
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k


def test_accelerate_fsdp_save_state(written, tmp_path, capsys):
    """accelerate's FSDP2 ``save_state`` output (``pytorch_model_fsdp_0/`` and ``optimizer_0/`` DCP directories and
    an RNG pickle, written by accelerate's own writers): ``inspect`` reads both directories as one checkpoint with
    the ``model.`` wrapper and the optimizer marked; ``convert --to hf`` gives transformers' names (no missing or
    unexpected key, equal weights); a strict ``model_only`` load fills every weight; each stored tensor
    equals what torch's own ``dcp_to_torch_save`` reads from its directory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import LlamaForCausalLM

    from _training_layout_scenarios import tiny_llama_config

    acc = written / "acc"
    full = torch.load(written / "acc_full.pt", weights_only=True)
    ref = {}
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        dcp_to_torch_save(acc / sub, tmp_path / f"{sub}.pt")
        ref.update(_flat(torch.load(tmp_path / f"{sub}.pt", weights_only=True)))
    with open_checkpoint(acc) as r:
        meta = r.metadata
        assert meta.format == "accelerate" and meta.model_prefix == "model."
        assert sorted(meta.tensors) == sorted(k for k, v in ref.items() if isinstance(v, torch.Tensor))
        for k in meta.tensors:
            assert torch.equal(r.read(k, meta.tensors[k].shards[0]), ref[k]), k
    opt = meta.optimizer_state_keys()
    assert len(opt) == 3 * len(full) and all(k.startswith("optimizer.state.") for k in opt)
    assert "optimizer.param_groups" in meta.non_model_keys
    capsys.readouterr()
    assert main(["inspect", str(acc)]) == 0
    text = capsys.readouterr().out
    assert "accelerate checkpoint" in text and "wrapper prefix 'model.'" in text, text
    assert main(["convert", str(acc), str(tmp_path / "hf")]) == 0  # --to hf is the default for this source
    _hf_export_matches(tmp_path / "hf", full)
    target = {"model": {k: torch.zeros_like(v) for k, v in LlamaForCausalLM(tiny_llama_config()).state_dict().items()}}
    with pytest.raises(CheckpointMismatchError, match="model_only=True"):
        load_state_dict(target, acc)
    assert load_state_dict(target, acc, model_only=True).missing_keys == []
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k


def _flat(d, prefix=""):
    """A nested state dict flattened with dots (lists of dicts by index), as DCP names its keys."""
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) and any(
        isinstance(x, (dict, list)) for x in d) else None
    if items is None:
        return {prefix[:-1]: d}
    for k, v in items:
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def test_model_prefix_option(written, tmp_path, capsys):
    """`--model-prefix ''` keeps the stored names; another prefix strips that one; a prefix no key has is an
    error naming it (exit 2)."""
    full = torch.load(written / "full.pt", weights_only=True)
    assert main(["convert", str(written / "oar"), str(tmp_path / "keep"), "--to", "hf", "--model-prefix", ""]) == 0
    assert sorted(st_tensors(tmp_path / "keep")) == sorted(f"model.{k}" for k in full)
    assert main(["convert", str(written / "oar"), str(tmp_path / "mm"), "--to", "hf",
                 "--model-prefix", "model.model."]) == 0
    got = st_tensors(tmp_path / "mm")
    assert sorted(got) == sorted(k[len("model."):] if k.startswith("model.") else f"model.{k}" for k in full)
    capsys.readouterr()
    assert main(["convert", str(written / "oar"), str(tmp_path / "bad"), "--to", "hf",
                 "--model-prefix", "net."]) == 2
    assert "model prefix 'net.'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(["convert", str(written / "oar"), str(tmp_path / "o"), "--to", "oarlock", "--model-prefix", "x"]) == 2
    assert "--model-prefix applies to --to hf" in capsys.readouterr().err


def test_torchtitan_layout(tmp_path):
    """torchtitan's documented top-level entries (``model``, ``optimizer``, ``lr_scheduler``, ``dataloader``,
    ``train_state``) saved by oarlock: only the model's weights reach the HF export, without ``model.``; the
    scheduler, data-loader and step records (tensors too) are not model weights for a model_only load."""
    from oarlock.checkpoint.convert import export_hf

    w = {"tok_embeddings.weight": torch.randn(8, 4), "output.weight": torch.randn(8, 4)}
    state = {"model": w,
             "optimizer": {"state": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v),
                                         "step": torch.tensor(3.0)} for k, v in w.items()},
                           "param_groups": [{"lr": 0.1, "params": sorted(w)}]},
             "lr_scheduler": {"last_epoch": 3, "_step_count": 4},
             "dataloader": {"world_size": 1, "dp_rank_0": torch.tensor([1, 2, 3], dtype=torch.uint8)},
             "train_state": {"step": 3, "global_avg_losses": torch.tensor([2.5, 2.25])}}
    save_state_dict(state, tmp_path / "tt")
    with open_checkpoint(tmp_path / "tt") as r:
        meta = r.metadata
    assert meta.model_prefix == "model."
    assert {"dataloader.dp_rank_0", "train_state.global_avg_losses", "lr_scheduler.last_epoch"} \
        <= set(meta.non_model_keys)
    export_hf(tmp_path / "tt", tmp_path / "hf")
    got = st_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(w)
    for k, v in w.items():
        assert torch.equal(got[k], v), k
    target = {"model": {k: torch.zeros_like(v) for k, v in w.items()}}
    load_state_dict(target, tmp_path / "tt", model_only=True)
    for k, v in w.items():
        assert torch.equal(target["model"][k], v), k
    with pytest.raises(CheckpointError, match="no tensor key of the checkpoint starts with it"):
        export_hf(tmp_path / "tt", tmp_path / "hf2", model_prefix="net.")


def _flat_layouts():
    """Checkpoints whose model keys are at the top level beside optimizer records, from torch's own state-dict
    API on a small trained model: torchtitan's flattened model states (model keys at the top, ``optimizer`` with
    ``flatten_optimizer_state_dict``, ``lr_scheduler``, ``train_state``), a model saved beside ``optim``, and
    torch's flattened optimizer state merged with the model's keys (``state.<fqn>.*``, ``param_groups``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    flat = get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    msd = {k: v.clone() for k, v in m.state_dict().items()}
    return msd, {
        "torchtitan": {**m.state_dict(), "optimizer": flat, "lr_scheduler": {"last_epoch": 1},
                       "train_state": {"step": 1}},
        "beside_optim": {**m.state_dict(), "optim": get_optimizer_state_dict(m, opt)},
        "merged_flat": {**m.state_dict(), **flat},
    }


@pytest.mark.parametrize("writer", ["oar", "dcp"])
@pytest.mark.parametrize("layout", ["torchtitan", "beside_optim", "merged_flat"])
def test_model_only_without_model_wrapper(tmp_path, writer, layout):
    """Model weights stored at the top level beside optimizer records: a strict ``model_only`` load fills the
    model from a plain ``model.state_dict()`` target and from the README's ``{"model": model.state_dict()}``
    one (the wrapper the checkpoint does not have is matched), every weight equal to the model's; without
    ``model_only`` the optimizer records are unexpected; the HF export holds exactly the model's keys."""
    import torch.distributed.checkpoint as dcp

    from oarlock.checkpoint.convert import export_hf

    msd, states = _flat_layouts()
    ck = tmp_path / "ck"
    save_state_dict(states[layout], ck) if writer == "oar" else dcp.save(states[layout], checkpoint_id=str(ck))
    flat = {k: torch.zeros_like(v) for k, v in msd.items()}
    with pytest.raises(CheckpointMismatchError, match="model_only=True"):
        load_state_dict(flat, ck)
    for target in (flat, {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}):
        report = load_state_dict(target, ck, model_only=True)
        got = target.get("model", target)
        assert report.missing_keys == []
        for k, v in msd.items():
            assert torch.equal(got[k], v), (k, list(target))
    export_hf(ck, tmp_path / "hf")
    hf = st_tensors(tmp_path / "hf")
    assert sorted(hf) == sorted(msd) and all(torch.equal(hf[k], v) for k, v in msd.items())


def test_wrapper_is_matched_only_under_model_only(tmp_path):
    """A plain ``model.state_dict()`` over torch's ``{"model": ..., "optim": ...}`` layout loads with
    ``model_only``; a target whose keys are partly stored as given is never re-wrapped (a missing key stays
    missing)."""
    msd, states = _flat_layouts()
    save_state_dict({"model": msd, "optim": states["beside_optim"]["optim"]}, tmp_path / "ck")
    flat = {k: torch.zeros_like(v) for k, v in msd.items()}
    load_state_dict(flat, tmp_path / "ck", model_only=True)
    assert all(torch.equal(flat[k], v) for k, v in msd.items())
    save_state_dict({**msd, "optim": states["beside_optim"]["optim"]}, tmp_path / "flat")
    part = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}, "0.weight": torch.zeros(4, 3)}
    with pytest.raises(CheckpointMismatchError, match="missing keys.*model.0.bias"):
        load_state_dict(part, tmp_path / "flat", model_only=True)


def test_no_prefix_without_training_entries(tmp_path):
    """A model whose every key starts with ``model.`` (an HF Llama with tied embeddings) keeps its names: saved
    alone, or with oarlock's own optimizer records (``optimizer.param_groups``), nothing is stripped."""
    from oarlock.checkpoint.convert import export_hf

    w = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4)}
    save_state_dict(w, tmp_path / "plain")
    save_state_dict({**w, "model.norm.weight.exp_avg": torch.randn(4),
                     "optimizer": {"param_groups": [{"lr": 0.1, "params": sorted(w)}]}}, tmp_path / "own")
    for d in ("plain", "own"):
        with open_checkpoint(tmp_path / d) as r:
            assert r.metadata.model_prefix is None, d
        export_hf(tmp_path / d, tmp_path / f"hf_{d}")
        assert sorted(st_tensors(tmp_path / f"hf_{d}")) == sorted(w), d
