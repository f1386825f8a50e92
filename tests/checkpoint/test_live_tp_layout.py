"""Checkpoints saved from a live ``parallelize_llama`` model record the TP-blocked layout of the fused gate/up
weights (issue 18, item 2): a save at TP=2 (two gloo ranks) holds ``extra["tp_layouts"]`` equal to what
``convert --tp 2`` records, and loads at TP=1 (one process) and TP=3 (three gloo ranks) re-lay the weights out
without any AOA config, giving the logits of the single-process model built from the same seed. The fused
``qkv_proj`` (rows grouped per KV head) is stored exactly as the single-process model holds it at any degree."""

from __future__ import annotations

import json

import pytest
import torch

from oarlock.checkpoint import load_state_dict, open_checkpoint, save_state_dict, sharded_state_dict
from oarlock.models.llama import Llama, LlamaConfig

# 6 KV heads and an MLP width of 36: TP degrees 2 and 3 both divide them
CFG = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=36, num_hidden_layers=2, num_attention_heads=12,
                  num_key_value_heads=6)
IDS = torch.tensor([[3, 17, 42, 5, 9, 60, 1, 33], [8, 8, 2, 50, 13, 7, 21, 4]])
GATE_UP = [f"layers.{i}.mlp.gate_up_proj.weight" for i in range(CFG.num_hidden_layers)]


def reference_model() -> Llama:
    """The single-process model every layout starts from (same seed everywhere)."""
    m = Llama(CFG)
    m.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    return m


def reference_logits() -> torch.Tensor:
    with torch.no_grad():
        return reference_model()(IDS)


def tp_blocked(w: torch.Tensor, tp: int) -> torch.Tensor:
    """The ``fused_ffn`` layout of degree ``tp`` written out by hand: ``[gate | up]`` rows become
    ``[gate_0, up_0, gate_1, up_1, ...]`` with ``gate_r``/``up_r`` the r-th of ``tp`` equal row blocks."""
    gate, up = w.chunk(2)
    return torch.cat([blk for r in range(tp) for blk in (gate.chunk(tp)[r], up.chunk(tp)[r])])


def stored_tensor(ckpt, key: str) -> torch.Tensor:
    """The global tensor exactly as stored (shards placed at their offsets; no AOA, no relayout)."""
    with open_checkpoint(ckpt) as r:
        t = r.metadata.tensors[key]
        out = torch.empty(t.global_shape, dtype=getattr(torch, t.dtype))
        for s in t.shards:
            out[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = r.read(key, s)
    return out


def _parallel(tp: int) -> Llama:
    from oarlock.models.parallel import ParallelLayout, build_mesh, parallelize_llama

    model = reference_model()
    return parallelize_llama(model, build_mesh(ParallelLayout(tp=tp), "cpu"), tp=tp)


def scenario_save_from_tp2(ctx):
    model = _parallel(2)
    with torch.no_grad():  # the live TP=2 model computes the single-process logits
        torch.testing.assert_close(model(IDS), reference_logits(), rtol=1e-5, atol=1e-5)
    save_state_dict(sharded_state_dict(model), ctx.shared / "tp2")


def scenario_load_at_tp3(ctx):
    model = _parallel(3)
    with torch.no_grad():
        for p in model.parameters():  # nothing of the reference survives: everything comes from the file
            p.zero_()
    load_state_dict(sharded_state_dict(model), ctx.shared / "tp2")  # no AOA config
    with torch.no_grad():
        got = model(IDS)
    torch.testing.assert_close(got, reference_logits(), rtol=1e-5, atol=1e-5)
    return float((got - reference_logits()).abs().max())


@pytest.mark.multiproc
def test_live_tp2_save_records_layout_and_loads_at_tp1_and_tp3(multirank, tmp_path):
    from oarlock.checkpoint.convert import convert_checkpoint
    from oarlock.models.llama import tp_relayout_aoa_config

    multirank("test_live_tp_layout", 2, ["scenario_save_from_tp2"]).check()
    ckpt = tmp_path / "ranks" / "tp2"
    ref = reference_model().state_dict()

    # the record: what convert --tp 2 writes for the same keys (from a TP=1 save of the same weights)
    save_state_dict(reference_model().state_dict(), tmp_path / "tp1")
    converted = convert_checkpoint(tmp_path / "tp1", tmp_path / "conv2", tp=2,
                                   aoa_config={"aoa_statements": tp_relayout_aoa_config(CFG)})
    with open_checkpoint(ckpt) as r:
        live = r.metadata.extra.get("tp_layouts")
    assert live == converted.extra["tp_layouts"] == {k: {"statement": "fused_ffn", "tp": 2, "axis": 0}
                                                      for k in GATE_UP}
    # stored bytes: gate/up TP-blocked (as convert writes them), qkv exactly the single-process tensor
    for k in GATE_UP:
        assert torch.equal(stored_tensor(ckpt, k), tp_blocked(ref[k], 2)), k
        assert torch.equal(stored_tensor(ckpt, k), stored_tensor(tmp_path / "conv2", k)), k
        assert not torch.equal(stored_tensor(ckpt, k), ref[k]), k  # the layout really depends on the degree
    for i in range(CFG.num_hidden_layers):
        k = f"layers.{i}.self_attn.qkv_proj.weight"
        assert torch.equal(stored_tensor(ckpt, k), ref[k]), k

    # TP=1 in this process, no AOA config: re-laid out from the record
    model = Llama(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_state_dict(sharded_state_dict(model), ckpt)
    for k, v in ref.items():
        assert torch.equal(model.state_dict()[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference_logits(), rtol=1e-6, atol=1e-6)

    # TP=3 on three ranks
    out = multirank("test_live_tp_layout", 3, ["scenario_load_at_tp3"])
    out.check()
    assert all(v is not None and v < 1e-5 for v in out.values("scenario_load_at_tp3"))


def test_without_the_record_the_tp1_load_is_wrong(tmp_path):
    """Why the record matters: the same TP-blocked bytes with ``extra["tp_layouts"]`` removed load at TP=1
    without error and give other logits (the silent wrong layout the record prevents)."""
    ref = reference_model().state_dict()
    conv = tmp_path / "conv2"
    from oarlock.checkpoint.convert import convert_checkpoint
    from oarlock.models.llama import tp_relayout_aoa_config

    save_state_dict(ref, tmp_path / "tp1")
    convert_checkpoint(tmp_path / "tp1", conv, tp=2, aoa_config={"aoa_statements": tp_relayout_aoa_config(CFG)})
    meta = json.loads((conv / "metadata.json").read_text())
    assert meta["extra"].pop("tp_layouts")
    (conv / "metadata.json").write_text(json.dumps(meta))
    model = Llama(CFG)
    load_state_dict(model.state_dict(), conv)
    with torch.no_grad():
        assert not torch.allclose(model(IDS), reference_logits(), atol=1e-3)
    for k in GATE_UP:
        assert torch.equal(model.state_dict()[k], tp_blocked(ref[k], 2))
