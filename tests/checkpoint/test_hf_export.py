"""HF-layout export: sharding by size, index, atomic publish, and readability by safetensors/transformers."""

import json

import pytest
import torch
from safetensors import safe_open

from oarlock.checkpoint import CheckpointError
from oarlock.checkpoint.formats.huggingface_writer import parse_size, save_hf_checkpoint
from oarlock.checkpoint.storage import open_checkpoint


def test_sharded_export_by_size(tmp_path):
    ref = {f"w{i}": torch.randn(10, 10) for i in range(5)}  # 400 bytes each
    out = save_hf_checkpoint(ref.items(), tmp_path / "hf", max_shard_size=900)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 5 * 400
    files = sorted(set(idx["weight_map"].values()))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    for k, f in idx["weight_map"].items():
        with safe_open(str(out / f), "pt") as fh:
            assert torch.equal(fh.get_tensor(k), ref[k])
            assert fh.metadata() == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
    with open_checkpoint(out) as r:
        assert set(r.metadata.tensors) == set(ref)


def test_single_shard_and_tied_views(tmp_path):
    base = torch.arange(12.0)
    out = save_hf_checkpoint([("a", base[:6].view(2, 3)), ("b", base[6:])], tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [".oarlock-files", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert torch.equal(fh.get_tensor("a"), base[:6].view(2, 3)) and torch.equal(fh.get_tensor("b"), base[6:])


def test_failed_export_publishes_nothing_and_keeps_old(tmp_path):
    save_hf_checkpoint([("a", torch.ones(2))], tmp_path / "hf")

    def gen():
        yield "a", torch.zeros(2)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_hf_checkpoint(gen(), tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as fh:
        assert torch.equal(fh.get_tensor("a"), torch.ones(2))
    with pytest.raises(CheckpointError, match="'a' was produced twice"):
        save_hf_checkpoint([("a", torch.ones(1)), ("a", torch.ones(1))], tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(7) == 7
    with pytest.raises(CheckpointError, match="max_shard_size 'big'"):
        parse_size("big")


def test_export_hf_sharded_writes_config_json(tmp_path):
    """``export_hf_sharded(..., config=model.config)`` writes the ``config.json`` transformers reads: the export
    loads with ``from_pretrained`` (no missing or unexpected key) and gives the model's own logits; a dict config
    is written as JSON; without one there is no ``config.json``; a config of another type is refused before
    anything is written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oarlock.checkpoint.convert import export_hf_sharded

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = LlamaForCausalLM(cfg).eval()
    export_hf_sharded(model.state_dict(), tmp_path / "hf", config=model.config)
    got, info = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got.eval()(input_ids=ids).logits, model(input_ids=ids).logits)
    export_hf_sharded(model.state_dict(), tmp_path / "hf_dict", config=cfg.to_dict())
    assert json.loads((tmp_path / "hf_dict" / "config.json").read_text())["hidden_size"] == 16
    export_hf_sharded(model.state_dict(), tmp_path / "bare")
    assert not (tmp_path / "bare" / "config.json").exists()
    with pytest.raises(CheckpointError, match="config: expected a dict or a transformers PretrainedConfig, got int"):
        export_hf_sharded(model.state_dict(), tmp_path / "bad", config=3)
    assert not (tmp_path / "bad").exists()
