"""Single-process optimizer-state tests: exact resume (torch AdamW/Adam/SGD), an AOA change of fused-QKV layout
between the saving and the loading model (HF separate q/k/v -> oarlock fused, and back in reverse mode), bad
input, and flattened reassembly against a full-tensor oracle (hypothesis)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oarlock.checkpoint import (OptimizerHyperparameterWarning, OptimizerStateError, ShardDesc,
                                load_sharded_optimizer_state_dict, plan_load, save_state_dict,
                                sharded_optimizer_state_dict, sharded_state_dict)
from oarlock.checkpoint.runtime.executor import execute_items
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.models.llama import Llama, LlamaConfig, causal_lm_loss, hf_aoa_config

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=5000.0)


def batches(n, seed=7, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 13), generator=g) for _ in range(n)]


def llama(seed):
    torch.manual_seed(seed)
    return Llama(CFG)


def step(model, opt, ids, logits_of=lambda m, x: m(x)):
    opt.zero_grad()
    loss = causal_lm_loss(logits_of(model, ids[:, :-1]), ids[:, 1:])
    loss.backward()
    opt.step()
    return loss.item()


def assert_losses(got, ref):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0), f"step {i}: {a} vs uninterrupted {b}"


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=3e-3, amsgrad=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9, dampening=0.5),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_exact_for_torch_optimizers(tmp_path, name):
    make = OPTIMIZERS[name]
    data = batches(5)
    ref_model = llama(0)
    ref_opt = make(ref_model.parameters())
    ref = [step(ref_model, ref_opt, x) for x in data]

    model = llama(0)
    opt = make(model.parameters())
    got = [step(model, opt, x) for x in data[:3]]
    msd = sharded_state_dict(model)
    osd = sharded_optimizer_state_dict(opt, msd)
    assert osd["optimizer.algorithm"] == type(opt).__name__
    save_state_dict({**msd, **osd}, tmp_path / "ck")

    model2 = llama(1)  # other weights, no optimizer state yet: everything must come from the checkpoint
    opt2 = make(model2.parameters())
    rep = load_sharded_optimizer_state_dict(opt2, sharded_state_dict(model2), tmp_path / "ck", load_model=True)
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    for (k1, p1), p2 in zip(model.named_parameters(), model2.parameters()):
        for s, v in opt.state[p1].items():
            assert torch.equal(opt2.state[p2][s], v), (k1, s)
    got += [step(model2, opt2, x) for x in data[3:]]
    assert_losses(got, ref)
    assert got[3:] == ref[3:]  # same layout: bit-identical


def test_keys_suffixes_and_hyperparameters(tmp_path):
    model = llama(0)
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "norm" not in n]},
                             {"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0}],
                            lr=1e-3)
    msd = sharded_state_dict(model)
    osd = sharded_optimizer_state_dict(opt, msd)  # before any step: lazy states created as zeros
    tensor_keys = {k for k in osd if not k.startswith("optimizer.")}
    params = [k for k, _ in model.named_parameters()]
    assert tensor_keys == {f"{k}{s}" for k in params for s in (".exp_avg", ".exp_avg_sq", ".step")}
    assert osd["layers.0.self_attn.qkv_proj.weight.exp_avg"].global_shape == (32 + 2 * 16, 32)
    groups = osd["optimizer.param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[0]["betas"] == [0.9, 0.999]
    assert sorted(groups[0]["params"] + groups[1]["params"]) == sorted(params)
    assert all(float(osd[f"{k}.step"].local_tensor) == 0.0 for k in params)


def test_bad_input_errors_and_hyperparameter_warning(tmp_path):
    model = llama(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, sgd, batches(1)[0])
    msd = sharded_state_dict(model)
    save_state_dict({**msd, **sharded_optimizer_state_dict(sgd, msd)}, tmp_path / "sgd")
    save_state_dict(msd, tmp_path / "model_only")

    model2 = llama(1)
    adamw = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    msd2 = sharded_state_dict(model2)
    with pytest.raises(OptimizerStateError, match=r"saved by SGD, this optimizer is AdamW; parameter 'embed_tokens"):
        load_sharded_optimizer_state_dict(adamw, msd2, tmp_path / "sgd")
    with pytest.raises(OptimizerStateError, match=r"states missing for parameter 'embed_tokens.weight' \(step, "
                                                  r"exp_avg, exp_avg_sq\)"):
        load_sharded_optimizer_state_dict(adamw, msd2, tmp_path / "model_only")
    # A subset of states missing (a checkpoint from a model with one parameter less).
    part = {k: v for k, v in {**msd, **sharded_optimizer_state_dict(sgd, msd)}.items()
            if not k.startswith("norm.weight.")}
    save_state_dict(part, tmp_path / "partial")
    sgd2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(OptimizerStateError, match=r"missing for parameter 'norm.weight' \(momentum_buffer\)"):
        load_sharded_optimizer_state_dict(sgd2, msd2, tmp_path / "partial")
    # Another learning rate and momentum: warning lists both values; kept by default, restored on request.
    sgd3 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.8)
    with pytest.warns(OptimizerHyperparameterWarning, match=r"group 0 lr: saved 0.1, current 0.05.*momentum: "
                                                            r"saved 0.9, current 0.8"):
        load_sharded_optimizer_state_dict(sgd3, msd2, tmp_path / "sgd")
    assert sgd3.param_groups[0]["lr"] == 0.05
    p0 = next(model.parameters())
    assert torch.equal(sgd3.state[next(model2.parameters())]["momentum_buffer"], sgd.state[p0]["momentum_buffer"])
    with pytest.warns(OptimizerHyperparameterWarning, match="restored the saved values"):
        load_sharded_optimizer_state_dict(sgd3, msd2, tmp_path / "sgd", restore_hyperparameters=True)
    assert (sgd3.param_groups[0]["lr"], sgd3.param_groups[0]["momentum"]) == (0.1, 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_sharded_optimizer_state_dict(sgd3, msd2, tmp_path / "sgd")  # same values now: no warning
    # Through AOA the stored keys are only known after compiling: the same error comes after the load.
    with pytest.raises(OptimizerStateError, match=r"states missing for parameter 'embed_tokens.weight'"):
        load_sharded_optimizer_state_dict(adamw, msd2, tmp_path / "model_only",
                                          aoa_config=["norm.weight -> norm.weight"])
    with pytest.raises(OptimizerStateError, match="not supported"):
        sharded_optimizer_state_dict(torch.optim.RMSprop(model2.parameters()), msd2)
    with pytest.raises(OptimizerStateError, match=r"parameter #0 of param group 0 .* not in model_sharded_state_dict"):
        sharded_optimizer_state_dict(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0), msd2)


# ---------------------------------------------------------------- AOA: fused QKV layout changes between A and B

transformers = pytest.importorskip("transformers")


def hf_llama(seed):
    hc = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(hc)
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return m


def hf_logits(m, x):
    return m(x).logits


@pytest.mark.filterwarnings("ignore:AOA.*gathers several sources")
def test_aoa_fused_qkv_moments_follow_the_weights(tmp_path):
    """A: HF Llama (separate q/k/v, gate/up) with AdamW; B: oarlock Llama (fused qkv_proj, gate_up_proj) loading
    A's checkpoint through hf_aoa_config. B's resumed losses equal A's uninterrupted ones; then B saves and A
    resumes from it through the same statements in reverse mode."""
    data = batches(7, seed=3)
    ref_model = hf_llama(0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3)
    ref = [step(ref_model, ref_opt, x, hf_logits) for x in data]

    a = hf_llama(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=3e-3)
    losses = [step(a, opt_a, x, hf_logits) for x in data[:3]]
    msd_a = sharded_state_dict(a)
    save_state_dict({**msd_a, **sharded_optimizer_state_dict(opt_a, msd_a)}, tmp_path / "hf")

    cfg = LlamaConfig.from_hf(a.config)
    b = Llama(cfg)
    opt_b = torch.optim.AdamW(b.parameters(), lr=3e-3)
    stmts = hf_aoa_config(cfg)
    load_sharded_optimizer_state_dict(opt_b, sharded_state_dict(b), tmp_path / "hf", aoa_config=stmts,
                                      load_model=True)
    # the fused moment is the concatenation of the separate ones in the fused_qkv order (per KV group: q heads, k, v)
    st_a = {n: opt_a.state[p] for n, p in a.named_parameters()}
    st_b = {n: opt_b.state[p] for n, p in b.named_parameters()}
    att = "model.layers.0.self_attn"
    q, k, v = (st_a[f"{att}.{x}_proj.weight"]["exp_avg_sq"] for x in "qkv")
    d = cfg.head_dim
    expect = torch.cat([torch.cat([q[2 * g * d:(2 * g + 2) * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                        for g in range(2)])
    assert torch.equal(st_b["layers.0.self_attn.qkv_proj.weight"]["exp_avg_sq"], expect)
    assert float(st_b["layers.0.self_attn.qkv_proj.weight"]["step"]) == 3.0
    losses += [step(b, opt_b, x) for x in data[3:5]]

    msd_b = sharded_state_dict(b)
    save_state_dict({**msd_b, **sharded_optimizer_state_dict(opt_b, msd_b)}, tmp_path / "ours")
    c = hf_llama(5)
    opt_c = torch.optim.AdamW(c.parameters(), lr=3e-3)
    load_sharded_optimizer_state_dict(opt_c, sharded_state_dict(c), tmp_path / "ours", load_model=True,
                                      aoa_config={"aoa_statements": stmts, "aoa_config_reverse": True})
    losses += [step(c, opt_c, x, hf_logits) for x in data[5:]]
    assert_losses(losses, ref)


# ---------------------------------------------------------------- flattened reassembly (hypothesis)

class _MemReader:
    """Stands in for a CheckpointReader over in-memory stored arrays (what the load executor calls)."""

    def __init__(self, arrays, dtype):
        self.arrays = arrays
        self.metadata = type("M", (), {"tensors": {"w": TensorMeta("w", (), dtype)}})()

    def read_box(self, key, file, name, flat_start, shape, box, out=None):
        n = math.prod(shape)
        arr = self.arrays[(file, name)].reshape(-1)[flat_start:flat_start + n].view(shape)
        t = arr[tuple(slice(a, b) for a, b in box)]
        if out is None:
            return t.clone()
        out.copy_(t)
        return out


def _grid(shape, parts):
    """Boxes of a product grid with ``parts[d]`` near-equal pieces per dim (torch.chunk-like split)."""
    cuts = []
    for n, k in zip(shape, parts):
        step_ = -(-n // k) if n else 1
        cuts.append([(a, min(a + step_, n)) for a in range(0, n, step_)] or [(0, 0)])
    boxes = [()]
    for c in cuts:
        boxes = [b + (x,) for b in boxes for x in c]
    return boxes


def _zero_ranges(n, dp, pad_before):
    """ZeRO-style: the box's flattening (after ``pad_before`` elements of other parameters) in a flat buffer padded
    to a multiple of ``dp``; rank r owns ``[r * per, (r + 1) * per)``; returns each rank's range inside the box."""
    per = max(1, -(-(n + pad_before) // dp))
    out = []
    for r in range(dp):
        lo, hi = r * per - pad_before, (r + 1) * per - pad_before
        a, b = min(max(lo, 0), n), min(max(hi, 0), n)
        out.append((a, b))
    return out


@st.composite
def layouts(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(nd))

    def side():
        parts = tuple(draw(st.integers(1, 2)) for _ in range(nd))
        dp = draw(st.integers(1, 5))  # 1 = regular (unflattened) shards of the grid
        pad = draw(st.integers(0, 7))
        return parts, dp, pad
    return shape, side(), side()


def _shards(shape, parts, dp, pad):
    """[(offset, local_shape, flattened_range or None)] covering the tensor."""
    out = []
    for box in _grid(shape, parts):
        off, ext = tuple(a for a, _ in box), tuple(b - a for a, b in box)
        if dp == 1:
            out.append((off, ext, None))
        else:
            for a, b in _zero_ranges(math.prod(ext), dp, pad):
                out.append((off, ext, (a, b)))
    return out


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_flattened_reassembly_matches_full_tensor(lay):
    """Stored shards: TP-style grid boxes, each flattened over a ZeRO DP degree with padding (slices that start
    and stop anywhere, also mid-row of 3-D boxes); requested: another grid and DP degree, flattened or regular.
    Every requested element must equal the full tensor's (the oracle: plain torch indexing)."""
    shape, (sp, sdp, spad), (dpp, ddp, dpad) = lay
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.5 + 1
    meta = CheckpointMetadata("oarlock", tensors={"w": TensorMeta("w", shape, "float64")})
    arrays = {}
    for i, (off, ext, fr) in enumerate(_shards(shape, sp, sdp, spad)):
        if fr is not None and fr[0] == fr[1]:
            continue  # empty ranges are not saved
        box = full[tuple(slice(o, o + e) for o, e in zip(off, ext))]
        data = box.reshape(-1)[fr[0]:fr[1]] if fr else box
        if data.numel() == 0:
            continue
        name = f"r{i}"
        meta.tensors["w"].shards.append(ShardMeta(off, ext, "f", name, fr))
        arrays[("f", name)] = data.clone()
    reader = _MemReader(arrays, "float64")
    for off, ext, fr in _shards(shape, dpp, ddp, dpad):
        req = ShardDesc("w", ext, shape, off, "float64", fr)
        plan = plan_load(meta, [req])
        box = full[tuple(slice(o, o + e) for o, e in zip(off, ext))]
        expect = box.reshape(-1)[fr[0]:fr[1]] if fr else box
        target = torch.full_like(expect, float("nan"))
        execute_items(reader, target, plan.items)
        assert torch.equal(target, expect), (shape, off, ext, fr)
