"""AOA ``reshape=`` (issue 18 item 3; PaddlePaddle's post-3.3 primitive, ``reshape='[2, 3, 2, 2]'``): row-major
reshapes compiled to box-to-box slice mappings, composed with ``permute=`` and ``dtype=``, for model and optimizer
keys, forward and reverse, through sharded loads, ``oarlock convert`` and ``aoa explain``. Every expected value is
computed in the test with plain torch (``torch.reshape``, ``transpose``, HF's and GGUF's rotary formulas)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.aoa import AOAError, AOASyntaxError, compile_aoa
from oarlock.checkpoint.aoa import engine as aoa_engine
from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors
from oarlock.checkpoint.model.sharded import ShardedWeight
from oarlock.cli import main


def spec(t):
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def cuts(n, parts):
    step = -(-n // parts)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def shards_of(key, full, parts, axis=0):
    """TP-style shards of ``full`` along ``axis`` (values filled in)."""
    out = []
    for a, b in cuts(full.shape[axis], parts):
        off = [0] * full.dim()
        off[axis] = a
        local = full.narrow(axis, a, b - a).clone()
        out.append(ShardedWeight(key, local, tuple(local.shape), tuple(full.shape), tuple(off)))
    return out


def empty_shards(key, shape, parts, axis=0, dtype=torch.float32):
    ref = torch.empty(shape, dtype=dtype)
    return [ShardedWeight(key, torch.full(s.local_shape, float("nan"), dtype=dtype), s.local_shape, s.global_shape,
                          s.global_offset) for s in shards_of(key, ref, parts, axis)]


def assemble(shards):
    full = torch.full(shards[0].global_shape, float("nan"), dtype=shards[0].local_tensor.dtype)
    for s in shards:
        full[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = s.local_tensor
    return full


def run(config, src, dst=None):
    prog = compile_aoa(config, {k: spec(v) for k, v in src.items()},
                       None if dst is None else {k: spec(v) for k, v in dst.items()})
    return prog, execute_on_full_tensors(prog, src)


# ---------------------------------------------------------------- the primitive


def test_paddle_example_flattened_to_canonical_and_back():
    s0 = rand(6, 4)
    prog, out = run(["s0 -> d, reshape = '[2, 3, 2, 2]'"], {"s0": s0})
    assert torch.equal(out["d"], s0.reshape(2, 3, 2, 2))
    assert "reshape='[2, 3, 2, 2]'" in prog.explain()
    rev = {"aoa_statements": ["s0 -> d, reshape = '[2, 3, 2, 2]'"], "aoa_config_reverse": True}
    # reverse mode into a model that names s0: the destination gives the shape to go back to
    _, back = run(rev, {"d": out["d"]}, {"s0": s0})
    assert torch.equal(back["s0"], s0)
    # reverse export (no destination): the statement must say it, with src_shape (checked in forward mode)
    with pytest.raises(AOAError, match=r"src_shape='\[\.\.\.\]'"):
        run(rev, {"d": out["d"]})
    rev2 = {"aoa_statements": ["s0 -> d, reshape=[2, 3, 2, 2], src_shape=[6, -1]"], "aoa_config_reverse": True}
    _, back = run(rev2, {"d": out["d"]})
    assert torch.equal(back["s0"], s0)
    _, fwd = run(rev2["aoa_statements"], {"s0": s0})
    assert torch.equal(fwd["d"], s0.reshape(2, 3, 2, 2))
    with pytest.raises(AOAError, match=r"'s0' has shape \[6, 4\], but the statement says src_shape='\[4, 6\]'"):
        run(["s0 -> d, reshape=[2, 3, 2, 2], src_shape=[4, 6]"], {"s0": s0})


@pytest.mark.parametrize("L,n,m", [(3, 4, 5), (1, 7, 2), (4, 1, 3)])
def test_leading_axes_split_and_merge_keep_one_mapping_per_block(L, n, m):
    w = rand(L * n, m, seed=1)
    prog, out = run(["w -> s, reshape=[-1, %d, %d]" % (n, m)], {"w": w})
    assert torch.equal(out["s"], w.reshape(L, n, m))
    blocks = 1 if n == 1 else L  # whole [n, m] blocks (n = 1: the whole tensor up to a unit axis)
    assert len(prog.mappings_for("s")) == blocks
    prog, out = run(["s -> w, reshape=[%d, -1]" % (L * n)], {"s": out["s"]})
    assert torch.equal(out["w"], w) and len(prog.mappings_for("w")) == blocks
    # stacked layer axis dropped: slice one layer of [L, n, m], then remove the unit axis
    stacked = w.reshape(L, n, m)
    names = ", ".join(f"t{i}" for i in range(L))
    cfg = [f"s -> {names}, axis=0"] + [f"t{i} -> layer{i}, reshape=[{n}, {m}]" for i in range(L)]
    prog, out = run(cfg, {"s": stacked})
    assert all(torch.equal(out[f"layer{i}"], stacked[i]) for i in range(L))
    assert all(len(prog.mappings_for(f"layer{i}")) == 1 for i in range(L))


def test_compound_statement_permute_reshape_dtype_in_written_order():
    w = rand(4, 6, seed=2)
    # transpose, then flatten, then cast: one slice per source column (rows of the transposed tensor)
    prog, out = run(["w -> v, permute=[1, 0], reshape=[-1], dtype='bfloat16'"], {"w": w})
    assert torch.equal(out["v"], w.T.reshape(-1).to(torch.bfloat16))
    assert len(prog.mappings_for("v")) == 6
    # reshape first, then permute
    _, out = run(["w -> v, reshape='[2, 2, 6]', permute='[2, 0, 1]'"], {"w": w})
    assert torch.equal(out["v"], w.reshape(2, 2, 6).permute(2, 0, 1))
    # a reshape that scatters elements ([4, 6] rows viewed as [6, 4] after a transpose) is still exact
    _, out = run(["w^T -> v, reshape=[4, 6]"], {"w": w})
    assert torch.equal(out["v"], w.T.reshape(4, 6))
    # reverse of the compound statement restores w exactly (shapes determined by the statements themselves)
    rev = {"aoa_statements": ["w -> v, reshape=[4, 6], src_shape=[4, 6], permute=[1, 0], reshape=[2, 3, 4]"],
           "aoa_config_reverse": True}
    _, fwd = run(rev["aoa_statements"], {"w": w})
    assert torch.equal(fwd["v"], w.T.reshape(2, 3, 4))
    _, back = run(rev, {"v": fwd["v"]})
    assert torch.equal(back["w"], w)


def test_scattering_reshape_over_the_limit_fails_naming_shapes(monkeypatch):
    monkeypatch.setattr(aoa_engine, "MAX_RESHAPE_REFS", 5)
    w = rand(4, 6)
    with pytest.raises(AOAError, match=r"reshape of 'w_transpose_tmp' from \[6, 4\] to \[4, 6\] does not map to "
                                       r"boxes: it would need more than 5 slice mappings"):
        run(["w^T -> v, reshape=[4, 6]"], {"w": w})


def test_reshape_errors_name_statement_and_shapes():
    w = rand(4, 6)
    with pytest.raises(AOAError, match=r"cannot reshape 'w' of shape \[4, 6\] \(24 elements\) to \[5, 5\] \(25 "
                                       r"elements\): element counts differ") as e:
        run(["w -> v, reshape=[5, 5]"], {"w": w})
    assert "aoa_statements[0]" in str(e.value) and "w -> v, reshape=[5, 5]" in str(e.value)
    with pytest.raises(AOAError, match=r"to \[5, -1\]: 24 is not a multiple of 5"):
        run(["w -> v, reshape=[5, -1]"], {"w": w})
    with pytest.raises(AOASyntaxError, match=r"reshape='\[-1, -1\]': more than one -1"):
        run(["w -> v, reshape='[-1, -1]'"], {"w": w})
    with pytest.raises(AOASyntaxError, match=r"reshape='\[2, -3\]': sizes must be >= 0"):
        run(["w -> v, reshape='[2, -3]'"], {"w": w})
    with pytest.raises(AOASyntaxError, match="expected a non-empty list of integers"):
        run(["w -> v, reshape='2x3'"], {"w": w})
    with pytest.raises(AOAError, match="`nope` should be assigned before") as e:
        run(["nope -> v, reshape=[2, 12]"], {"w": w})
    assert "nope -> v, reshape=[2, 12]" in str(e.value)
    with pytest.raises(AOAError, match="src_shape goes with reshape="):
        run(["w -> v, src_shape=[4, 6]"], {"w": w})
    with pytest.raises(AOAError, match="needs exactly one attribute, an integer axis"):
        run(["w -> a, b, axis=0, reshape=[2, 6]"], {"w": w})


def test_optimizer_states_follow_a_reshape_and_can_be_named(tmp_path):
    sd = {"w": rand(6, 4, seed=3), "w.exp_avg": rand(6, 4, seed=4), "w.exp_avg_sq": rand(6, 4, seed=5),
          "w.step": torch.tensor(3.0)}
    save_state_dict(sd, tmp_path / "ck")
    got = {"v": torch.zeros(2, 3, 4), "v.exp_avg": torch.zeros(2, 3, 4), "v.exp_avg_sq": torch.zeros(24),
           "v.step": torch.zeros(())}
    load_state_dict(got, tmp_path / "ck", aoa_config=["w -> v, reshape=[2, 3, 4]",
                                                      "w.exp_avg_sq -> v.exp_avg_sq, reshape=[-1]"])
    assert torch.equal(got["v"], sd["w"].reshape(2, 3, 4))
    assert torch.equal(got["v.exp_avg"], sd["w.exp_avg"].reshape(2, 3, 4))
    assert torch.equal(got["v.exp_avg_sq"], sd["w.exp_avg_sq"].reshape(-1))
    assert torch.equal(got["v.step"], sd["w.step"])


# ---------------------------------------------------------------- rotary permutations (HF <-> Meta / GGUF)

def hf_to_meta(w, h):
    """GGUF's / Meta's interleaved rotary row order from HF's half-split order (the llama.cpp converter's
    ``reshape(n_head, 2, hd // 2, ...).swapaxes(1, 2)``)."""
    return w.view(h, 2, w.shape[0] // h // 2, -1).transpose(1, 2).reshape(w.shape)


def meta_to_hf(w, h):
    """HF's ``convert_llama_weights_to_hf`` permutation: ``view(h, hd // 2, 2, dim).transpose(1, 2)``."""
    return w.view(h, w.shape[0] // h // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def rotary_cfg(src, dst, h, hd, dim, to_hf):
    mid = f"[{h}, {hd // 2}, 2, {dim}]" if to_hf else f"[{h}, 2, {hd // 2}, {dim}]"
    return f"{src} -> {dst}, reshape='{mid}', permute='[0, 2, 1, 3]', reshape=[-1, {dim}]"


@pytest.mark.parametrize("to_hf", [True, False])
@pytest.mark.parametrize("h,kv,hd,dim", [(4, 2, 8, 32), (3, 3, 4, 12)])
def test_rotary_permutation_via_reshape_and_permute(to_hf, h, kv, hd, dim, tmp_path):
    q, k = rand(h * hd, dim, seed=10), rand(kv * hd, dim, seed=11)
    # the two directions are inverses, checked independently of AOA
    assert torch.equal(meta_to_hf(hf_to_meta(q, h), h), q)
    perm = meta_to_hf if to_hf else hf_to_meta
    cfg = [rotary_cfg("layers.$LAYER_ID.wq", "layers.$LAYER_ID.q_proj", h, hd, dim, to_hf),
           rotary_cfg("layers.$LAYER_ID.wk", "layers.$LAYER_ID.k_proj", kv, hd, dim, to_hf)]
    src = {"layers.0.wq": q, "layers.0.wk": k, "layers.1.wq": q * 2, "layers.1.wk": k * 3}
    prog, out = run(cfg, src)
    assert torch.equal(out["layers.0.q_proj"], perm(q, h)) and torch.equal(out["layers.1.q_proj"], perm(q * 2, h))
    assert torch.equal(out["layers.0.k_proj"], perm(k, kv)) and torch.equal(out["layers.1.k_proj"], perm(k * 3, kv))
    assert len(prog.mappings_for("layers.0.q_proj")) == h * hd  # one row each: a row permutation
    if to_hf:  # the GGUF reader's internal transform undoes the same permutation
        from oarlock.checkpoint.formats.gguf import unpermute_rotary

        assert torch.equal(unpermute_rotary(q, h), out["layers.0.q_proj"])
    # the same through the loader: sources saved as TP shards (plus first moments), destinations TP-sharded
    # along the rows and, for k, along the columns
    save_state_dict({"layers.0.wq": shards_of("layers.0.wq", q, 2),
                     "layers.0.wq.exp_avg": shards_of("layers.0.wq.exp_avg", q + 1, 2),
                     "layers.0.wk": shards_of("layers.0.wk", k, 3, axis=1)}, tmp_path / "ck")
    got = {"layers.0.q_proj": empty_shards("layers.0.q_proj", q.shape, 3),
           "layers.0.q_proj.exp_avg": empty_shards("layers.0.q_proj.exp_avg", q.shape, 3),
           "layers.0.k_proj": empty_shards("layers.0.k_proj", k.shape, 2, axis=1)}
    load_state_dict(got, tmp_path / "ck", aoa_config=cfg)
    assert torch.equal(assemble(got["layers.0.q_proj"]), perm(q, h))
    assert torch.equal(assemble(got["layers.0.q_proj.exp_avg"]), perm(q + 1, h))
    assert torch.equal(assemble(got["layers.0.k_proj"]), perm(k, kv))
    # reverse mode: the same statements take the permuted tensors back (destinations name the shapes)
    back = {"layers.0.wq": torch.zeros_like(q), "layers.0.wk": torch.zeros_like(k)}
    save_state_dict({"layers.0.q_proj": perm(q, h), "layers.0.k_proj": perm(k, kv)}, tmp_path / "perm")
    load_state_dict(back, tmp_path / "perm", aoa_config={"aoa_statements": cfg, "aoa_config_reverse": True})
    assert torch.equal(back["layers.0.wq"], q) and torch.equal(back["layers.0.wk"], k)


def test_reshape_into_flattened_targets_and_across_ranks_of_a_grid(tmp_path):
    """Stacked [L, out, in] source saved on a 2 x 2 grid; destinations are per-layer [out, in] tensors held as
    ZeRO-style flat ranges (including ranges that start and end inside rows)."""
    L, o, i = 3, 6, 5
    stacked = rand(L, o, i, seed=20)
    shards = []
    for a, b in cuts(o, 2):
        for c, d in cuts(i, 2):
            local = stacked[:, a:b, c:d].clone()
            shards.append(ShardedWeight("s", local, tuple(local.shape), (L, o, i), (0, a, c)))
    save_state_dict({"s": shards}, tmp_path / "ck")
    cfg = ["s -> t0, t1, t2, axis=0"] + [f"t{n} -> w{n}, reshape=[{o}, {i}]" for n in range(L)]
    bounds = [0, 7, 8, 19, 30]
    got = {f"w{n}": [ShardedWeight(f"w{n}", torch.full((b - a,), float("nan")), (o, i), (o, i), (0, 0),
                                   flattened_range=(a, b)) for a, b in zip(bounds, bounds[1:])] for n in range(L)}
    load_state_dict(got, tmp_path / "ck", aoa_config=cfg)
    for n in range(L):
        flat = torch.cat([s.local_tensor for s in got[f"w{n}"]])
        assert torch.equal(flat, stacked[n].reshape(-1)), n


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_property_reshape_permute_chains_match_torch(data):
    """Random shapes, a random permutation between two random reshapes: the compiled mappings give what torch
    computes, on whole tensors."""
    dims = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    total = 1
    for n in dims:
        total *= n
    w = torch.arange(total, dtype=torch.float32).reshape(dims)

    def factorisation(n):
        out = []
        while n > 1:
            f = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0 and d > 1]))
            out.append(f)
            n //= f
        if data.draw(st.booleans()):
            out.insert(data.draw(st.integers(0, len(out))), 1)
        return out or [1]

    mid = factorisation(total)
    perm = data.draw(st.permutations(range(len(mid))))
    end = factorisation(total)
    cfg = [f"w -> v, reshape={mid}, permute={list(perm)}, reshape={end}"]
    _, out = run(cfg, {"w": w})
    assert torch.equal(out["v"], w.reshape(mid).permute(*perm).reshape(end))


# ---------------------------------------------------------------- command line: convert and explain

def test_convert_and_explain_with_reshape(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    w = rand(8, 6, seed=30)
    save_file({"w": w, "b": rand(4, seed=31)}, str(src / "model.safetensors"))
    cfg = tmp_path / "r.json"
    cfg.write_text(json.dumps({"aoa_statements": ["w -> v, reshape=[2, 4, 6]", "b -> b2, reshape=[2, 2]"]}))
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"v": 1, "b2": 0}))  # TP 2: v split inside its rows, b2 by rows
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "oarlock", "--aoa", str(cfg), "--tp", "2",
                 "--tp-rules", str(rules)]) == 0
    got = {"v": torch.zeros(2, 4, 6), "b2": torch.zeros(2, 2)}
    load_state_dict(got, tmp_path / "out")
    assert torch.equal(got["v"], w.reshape(2, 4, 6)) and torch.equal(got["b2"], load_file(str(src / "model.safetensors"))["b"].reshape(2, 2))
    capsys.readouterr()
    assert main(["aoa", "explain", str(cfg), "--source", str(src)]) == 0
    text = capsys.readouterr().out
    assert "  w -> v, reshape='[2, 4, 6]'" in text
    assert "v  [2, 4, 6] float32\n  [0:1, 0:4, 0:6] <- w[0:4, 0:6]\n  [1:2, 0:4, 0:6] <- w[4:8, 0:6]" in text
    # and back to HF with the config reversed: v -> w, with src_shape absent the output shape is unknown
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "hf"), "--to", "hf", "--aoa", str(cfg),
                 "--reverse"]) == 2
    assert "src_shape" in capsys.readouterr().err
    cfg.write_text(json.dumps({"aoa_statements": ["w -> v, reshape=[2, 4, 6], src_shape=[8, 6]",
                                                  "b -> b2, reshape=[2, 2], src_shape=[4]"]}))
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "hf"), "--to", "hf", "--aoa", str(cfg),
                 "--reverse"]) == 0
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(back["w"], w) and back["w"].shape == (8, 6) and back["b"].shape == (4,)
