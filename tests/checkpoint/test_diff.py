"""`oarlock diff` / diff_checkpoints against an independent torch.equal loop, across formats and layouts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from oarlock.checkpoint import convert_checkpoint, save_state_dict
from oarlock.checkpoint.convert.diff import compare_tensors, diff_checkpoints
from oarlock.cli import main


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 40, generator=g),
        "model.norm.weight": torch.ones(16),
        "model.layers.0.counter": torch.arange(12, dtype=torch.int64),
        "lm_head.weight": torch.randn(64, 16, generator=g),
    }


@pytest.fixture()
def ckpts(tmp_path):
    ref = _model()
    (tmp_path / "hf").mkdir()
    save_file(ref, tmp_path / "hf" / "model.safetensors")
    convert_checkpoint(tmp_path / "hf", tmp_path / "tp4", tp=4, show_progress=False)
    mod = {k: v.clone() for k, v in ref.items()}
    mod["model.layers.0.self_attn.q_proj.weight"][3, 5] += 0.5
    mod["model.layers.0.self_attn.q_proj.weight"][7, :4] = 0.0
    mod["lm_head.weight"][0, 0] += 1e-6
    del mod["model.norm.weight"]
    mod["extra.bias"] = torch.zeros(3)
    mod["model.layers.0.mlp.down_proj.weight"] = torch.randn(16, 41)
    mod["model.layers.0.counter"] = mod["model.layers.0.counter"].to(torch.int32)
    (tmp_path / "mod").mkdir()
    save_file(mod, tmp_path / "mod" / "model.safetensors")
    return tmp_path, ref, mod


def _reference(a: dict, b: dict, atol: float = 0.0) -> dict:
    """The independent loop: torch.equal / elementwise on whole in-memory tensors."""
    only_a = sorted(k for k in a if k not in b)
    only_b = sorted(k for k in b if k not in a)
    changed = {}
    for k in a:
        if k not in b:
            continue
        x, y = a[k], b[k]
        if x.shape != y.shape:
            changed[k] = ("shape", None, None)
            continue
        xd, yd = x.double(), y.double()
        if x.dtype == y.dtype and (torch.equal(x, y) if atol == 0 else torch.allclose(xd, yd, 0, atol)):
            continue
        bad = (xd - yd).abs() > atol
        changed[k] = ("dtype" if x.dtype != y.dtype else "values", int(bad.sum()),
                      float((xd - yd).abs().max()) if bad.any() else 0.0)
    return {"only_a": only_a, "only_b": only_b, "changed": changed}


def _as_dict(rep) -> dict:
    return {"only_a": sorted(rep.only_in_a), "only_b": sorted(rep.only_in_b),
            "changed": {c.key: (c.kind, None if c.kind == "shape" else c.num_different,
                                None if c.kind == "shape" else c.max_abs_diff) for c in rep.changed}}


def test_hf_against_tp4_is_equal(ckpts):
    tmp, ref, _ = ckpts
    rep = diff_checkpoints(tmp / "hf", tmp / "tp4")
    assert rep.equal and rep.equal_keys == len(ref)
    assert main(["diff", str(tmp / "hf"), str(tmp / "tp4")]) == 0


def test_changes_match_torch_equal_loop(ckpts):
    tmp, ref, mod = ckpts
    rep = diff_checkpoints(tmp / "mod", tmp / "tp4")
    want = _reference(mod, ref)
    assert _as_dict(rep) == want
    assert set(want["changed"]) == {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                    "model.layers.0.mlp.down_proj.weight", "model.layers.0.counter"}
    q = next(c for c in rep.changed if c.key == "model.layers.0.self_attn.q_proj.weight")
    x, y = mod[q.key].double(), ref[q.key].double()
    nz = (x != y) & (y != 0)
    assert q.max_rel_diff == pytest.approx(float(((x - y).abs()[nz] / y.abs()[nz]).max()))
    # a tolerance hides the 1e-6 change only
    rep = diff_checkpoints(tmp / "mod", tmp / "tp4", atol=1e-5)
    assert _as_dict(rep) == _reference(mod, ref, atol=1e-5)
    assert "lm_head.weight" not in {c.key for c in rep.changed}


def test_cli_exit_codes_json_and_filters(ckpts, capsys):
    tmp, ref, mod = ckpts
    assert main(["diff", str(tmp / "mod"), str(tmp / "tp4"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] is False and out["only_in_a"] == ["extra.bias"] and out["only_in_b"] == ["model.norm.weight"]
    kinds = {c["key"]: c["kind"] for c in out["changed"]}
    assert kinds == {"model.layers.0.self_attn.q_proj.weight": "values", "lm_head.weight": "values",
                     "model.layers.0.mlp.down_proj.weight": "shape", "model.layers.0.counter": "dtype"}
    # only the untouched keys: equal
    assert main(["diff", str(tmp / "mod"), str(tmp / "tp4"), "--include", "model.*",
                 "--exclude", "*q_proj*", "--exclude", "*down_proj*", "--exclude", "*counter",
                 "--exclude", "model.norm*"]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("equal: 3 common tensor keys, 3 equal")  # embed, o_proj, up_proj
    assert main(["diff", str(tmp / "mod"), str(tmp / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["diff", str(tmp / "mod"), str(tmp / "tp4"), "--rtol", "-1"]) == 2


def test_objects_and_nan(tmp_path):
    a = {"w": torch.tensor([1.0, float("nan"), 3.0]), "step": 5}
    save_state_dict(a, tmp_path / "a")
    save_state_dict({"w": torch.tensor([1.0, float("nan"), 3.0]), "step": 6}, tmp_path / "b")
    rep = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert rep.equal_keys == 1 and rep.objects_changed == ["step"] and not rep.equal
    d = compare_tensors("w", torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([1.0, 2.0, 0.0]))
    assert d.num_different == 1 and d.max_abs_diff == float("inf")
    big = torch.tensor([2**60, 5], dtype=torch.int64)
    d = compare_tensors("i", big, big + torch.tensor([1, 0]))  # beyond float64's exact integers
    assert d.num_different == 1 and d.max_abs_diff == 1.0
    d = compare_tensors("w", torch.tensor([-0.0, 2.0]), torch.tensor([0.0, 0.0]))
    assert d.num_different == 1 and d.max_abs_diff == 2.0 and d.max_rel_diff == float("inf")



def test_summary_counts_objects_as_it_lists_them(tmp_path, capsys):
    """A training state against its HF export: the wrapper prefix is read off as the export strips it (the 2
    tensors equal), and the summary counts the object it lists as only in A (before: 'object only in A: step'
    above a summary saying '0 only in A'); both sides saved with the object: counted equal."""
    from oarlock.checkpoint import export_hf

    m = torch.nn.Linear(3, 2)
    save_state_dict({"model": m.state_dict(), "step": 100}, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "hf")
    assert main(["diff", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["object only in A: step",
                   "differ: 2 common tensor keys, 2 equal, 0 changed, 0 only in A, 0 only in B; "
                   "0 common objects, 0 equal, 0 changed, 1 only in A, 0 only in B"], out
    assert main(["diff", str(tmp_path / "hf"), str(tmp_path / "ck"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["objects_only_in_b"] == ["step"] and doc["equal_keys"] == 2 and doc["equal_objects"] == 0
    save_state_dict({"model": m.state_dict(), "step": 100, "lr": 0.5}, tmp_path / "ck2")
    save_state_dict({"model": m.state_dict(), "step": 100, "lr": 0.1}, tmp_path / "ck3")
    rep = diff_checkpoints(tmp_path / "ck2", tmp_path / "ck3")
    assert rep.render().splitlines()[-1] == ("differ: 2 common tensor keys, 2 equal, 0 changed, 0 only in A, 0 only "
                                             "in B; 2 common objects, 1 equal, 1 changed, 0 only in A, 0 only in B")


def test_inspect_include_exclude(ckpts, capsys):
    tmp, ref, _ = ckpts
    assert main(["inspect", str(tmp / "tp4"), "--json", "--include", "model.layers.*", "--exclude", "*proj*"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["key"] for t in out["tensors"]] == ["model.layers.0.counter"]
    assert out["total_bytes"] == ref["model.layers.0.counter"].numel() * 8


def test_checksum_fast_path_does_not_vouch_for_a_corrupted_copy(tmp_path, capsys):
    """Two copies of one checkpoint are equal by their recorded checksums; after a byte of one copy's data file
    is flipped (metadata.json untouched) diff must not answer "equal": it names the corrupt file."""
    import shutil

    ref = _model()
    (tmp_path / "hf").mkdir()
    save_file(ref, tmp_path / "hf" / "model.safetensors")
    convert_checkpoint(tmp_path / "hf", tmp_path / "a", tp=2, show_progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "equal" in capsys.readouterr().out
    f = sorted((tmp_path / "b").glob("*.safetensors"))[1]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f.name in err and "corrupted" in err


def test_diff_compares_tp_blocked_layouts_as_logical_tensors(tmp_path):
    """gate/up fused with ``fused_ffn`` at TP degree 1 and 3 store different bytes for the same logical tensor
    (blocks ``[gate_r, up_r]`` per rank); diff re-lays out the recorded layouts and finds them equal, and still
    finds a changed element, counted against an independent reference (torch.cat of the HF tensors)."""
    g = torch.Generator().manual_seed(3)
    hf = tmp_path / "hf"
    hf.mkdir()
    gate, up = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g)
    save_file({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}, str(hf / "model.safetensors"))
    aoa = {"aoa_statements": ["mlp.gate_proj.weight, mlp.up_proj.weight -> mlp.gate_up.weight, fused_ffn, axis=0"]}
    convert_checkpoint(hf, tmp_path / "tp1", aoa_config=aoa, tp_rules={"mlp.gate_up.weight": 0})
    m3 = convert_checkpoint(hf, tmp_path / "tp3", aoa_config=aoa, tp=3, tp_rules={"mlp.gate_up.weight": 0})
    assert m3.extra["tp_layouts"]["mlp.gate_up.weight"]["tp"] == 3
    rep = diff_checkpoints(tmp_path / "tp1", tmp_path / "tp3")
    assert rep.equal and rep.equal_keys == 1, rep.render()

    # the same fusion with one element of up changed: exactly one differing element, of the reference's size
    up2 = up.clone()
    up2[7, 2] += 0.5
    hf2 = tmp_path / "hf2"
    hf2.mkdir()
    save_file({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up2}, str(hf2 / "model.safetensors"))
    convert_checkpoint(hf2, tmp_path / "tp3b", aoa_config=aoa, tp=3, tp_rules={"mlp.gate_up.weight": 0})
    rep = diff_checkpoints(tmp_path / "tp1", tmp_path / "tp3b")
    ref_a, ref_b = torch.cat([gate, up]), torch.cat([gate, up2])
    (d,) = rep.changed
    assert d.num_different == int((ref_a != ref_b).sum()) == 1
    assert d.max_abs_diff == pytest.approx(float((ref_a - ref_b).abs().max()))


def test_diff_preset_compares_a_training_checkpoint_with_hf(tmp_path, capsys):
    """oarlock's Llama (fused QKV, fused gate/up) saved as an oarlock checkpoint against the HF directory of the
    same weights: `diff --preset llama` reads the oarlock side through the reverse preset and finds every key
    equal; one changed element of the HF side is found and counted; without the preset the key names differ."""
    transformers = pytest.importorskip("transformers")
    from oarlock.models.llama import Llama, LlamaConfig, convert_hf_state_dict

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False)
    torch.manual_seed(5)
    hf_model = transformers.LlamaForCausalLM(cfg)
    hf_model.save_pretrained(tmp_path / "hf")
    config = LlamaConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    ours = Llama(config)
    ours.load_state_dict(convert_hf_state_dict(hf_model.state_dict(), config))  # the independent converter
    save_state_dict(ours.state_dict(), tmp_path / "ours")

    assert main(["diff", str(tmp_path / "ours"), str(tmp_path / "hf"), "--preset", "llama", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["equal"] and rep["equal_keys"] == len(hf_model.state_dict()), rep

    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    key = "model.layers.1.self_attn.k_proj.weight"
    sd[key][3, 7] += 1.0
    (tmp_path / "hf2").mkdir()
    save_file(sd, str(tmp_path / "hf2" / "model.safetensors"))
    assert main(["diff", str(tmp_path / "ours"), str(tmp_path / "hf2"), "--preset", "llama",
                 "--model-config", str(tmp_path / "hf" / "config.json"), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    (changed,) = rep["changed"]
    assert changed["key"] == key and changed["num_different"] == 1, changed

    assert main(["diff", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 1  # stored names: qkv_proj vs q_proj
    assert "only in" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "hf"), str(tmp_path / "hf2"), "--preset", "llama"]) == 2
    assert "neither A nor B is an oarlock checkpoint" in capsys.readouterr().err


def test_a_corrupted_byte_is_an_error_not_a_difference(tmp_path, capsys):
    """A save and a copy of it; a byte of the copy's data flipped on disk afterwards. diff hashes the compared files against
    their recorded checksums first: the corruption is a ChecksumError naming B's file (CLI exit 2), while
    ``verify_checksums=False`` compares the bytes as they are and finds the one changed element."""
    from oarlock.checkpoint.integrity import ChecksumError

    t = {"a": torch.arange(1000, dtype=torch.float32)}
    save_state_dict(t, tmp_path / "x")
    shutil.copytree(tmp_path / "x", tmp_path / "y")  # a copy: its recorded checksums equal x's
    f = tmp_path / "y" / "rank-00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0xFF  # inside the last element's bytes
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"y/rank-00000.safetensors: block\(s\) \[0\]"):
        diff_checkpoints(tmp_path / "x", tmp_path / "y")
    rep = diff_checkpoints(tmp_path / "x", tmp_path / "y", verify_checksums=False)
    assert [(d.key, d.num_different) for d in rep.changed] == [("a", 1)]
    assert main(["diff", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "do not match the checksums recorded at save" in capsys.readouterr().err
    # the recorded checksums of both sides are equal and untouched: --no-verify must not trust them either
    assert main(["diff", str(tmp_path / "x"), str(tmp_path / "y"), "--no-verify"]) == 1
    assert "1/1000 elements differ" in capsys.readouterr().out
