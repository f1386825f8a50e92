"""Capture on a stock transformers LlamaForCausalLM (tiny config, random weights): a full training step
(forward, loss, backward, AdamW step) with every checksum mode, and ``debug diff`` finding a one-ulp weight
change at the first op reading that weight, with the user's own line shown. Also: a capture whose block
raises leaves no dump that looks complete."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oarlock.debug as od

transformers = pytest.importorskip("transformers")

_SOURCE = Path(__file__).read_text().splitlines()
STEP_LINE = next(i for i, line in enumerate(_SOURCE, 1) if line.endswith("# " + "STEP_LINE"))
OPT_LINE = next(i for i, line in enumerate(_SOURCE, 1) if line.endswith("# " + "OPT_LINE"))


def make_llama(perturb: bool = False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    if perturb:
        with torch.no_grad():
            w = model.model.layers[1].mlp.up_proj.weight
            w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(float("inf")))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, ids


def user_train_step(model, ids, opt):
    out = model(input_ids=ids, labels=ids)  # STEP_LINE
    out.loss.backward()
    opt.step()  # OPT_LINE
    opt.zero_grad()
    return out.loss


def capture_step(path, checksum, perturb=False):
    model, ids = make_llama(perturb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with od.capture(path, checksum=checksum):
        loss = user_train_step(model, ids, opt)
    return loss


@pytest.mark.parametrize("checksum", ["fast", "md5", "rounded:6"])
def test_full_training_step_of_hf_llama_captures_with_each_checksum(tmp_path, checksum):
    path = tmp_path / "a.jsonl"
    loss = capture_step(path, checksum)
    assert torch.isfinite(loss)
    d = od.load_dump(path)
    assert d.checksum == checksum
    fwd, bwd = d.forward_ops(), d.backward_ops()
    assert len(fwd) > 100 and len(bwd) > 100
    # every tensor output got a checksum
    assert all(h is not None for r in d.ops for h, m in zip(r.get("h") or [], r["out"]) if m is not None)
    # the optimizer's ops run outside any module; their user frame is the opt.step() line of this file
    mods = {r.get("mod") for r in fwd}
    assert "model.layers.1.mlp.up_proj" in mods
    opt_ops = [r for r in fwd if d.user_frame(r.get("st")) and d.user_frame(r["st"])[1] == OPT_LINE]
    assert opt_ops and all(r["mod"] is None for r in opt_ops)
    # a model op's user frame is this file's model(...) line although transformers' frames are inside it
    up = next(r for r in fwd if r["mod"] == "model.layers.1.mlp.up_proj")
    uf = d.user_frame(up["st"])
    assert uf[0] == __file__ and uf[1] == STEP_LINE
    assert any("transformers" in f for f, _, _ in d.stack(up["st"])[:d.user_index[up["st"]]])


def test_one_ulp_change_in_hf_llama_found_at_first_reader_with_user_line(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    capture_step(a, "fast")
    capture_step(b, "fast", perturb=True)
    rep = od.diff(a, b)
    assert rep.diverged and rep.structural == []
    d = rep.first
    # the first op reading the perturbed weight (its transposed view in F.linear)
    assert d.a["ph"] == "f" and d.a["mod"] == "model.layers.1.mlp.up_proj"
    assert "p:model.layers.1.mlp.up_proj.weight" in d.a["src"]
    ops_a = od.load_dump(a).ops
    assert all("p:model.layers.1.mlp.up_proj.weight" not in (r.get("src") or []) for r in ops_a[:d.a["i"]])
    uf = d.user_frames()
    assert uf["a"][:2] == uf["b"][:2] == (__file__, STEP_LINE)
    # the CLI prints the user frame of both runs
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "debug", "diff", str(a), str(b)],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert r.stdout.count(f"A user frame (run at): {__file__}:{STEP_LINE}") == 1
    assert r.stdout.count(f"B user frame (run at): {__file__}:{STEP_LINE}") == 1
    assert "library frames folded" in r.stdout


def test_capture_whose_block_raises_leaves_no_complete_dump(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("stale dump of an earlier run\n")
    model, ids = make_llama()
    with pytest.raises(ValueError, match="boom"):
        with od.capture(path):
            model(input_ids=ids)
            raise ValueError("boom")
    assert not path.exists()  # neither the stale one nor a new one that would look complete
    partial = tmp_path / "run.jsonl.partial"
    last = json.loads(partial.read_text().splitlines()[-1])
    assert last["k"] == "end" and "ValueError: boom" in last["error"]
    with pytest.raises(od.DumpFormatError, match="incomplete capture.*ValueError: boom"):
        od.load_dump(partial)
    with pytest.raises(od.DumpFormatError, match="run.jsonl.partial holds an incomplete capture"):
        od.load_dump(path)
    assert len(od.load_dump(partial, allow_incomplete=True).ops) > 10
