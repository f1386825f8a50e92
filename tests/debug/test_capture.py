"""capture() records what plain torch runs; diff() finds the true first divergence; region/module guards."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import oarlock.debug as od
from debug_model import BACKWARD_LINE, FC_LINE, make_inputs, train_step


class Reference(TorchDispatchMode):
    """Plain-torch reference: op names, output shapes, and the first op reading a given tensor."""

    def __init__(self, watch=None):
        super().__init__()
        self.ops, self.watch, self.first_reader = [], watch, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in list(args) + list(kwargs.values())
                for a in (a if isinstance(a, (list, tuple)) else [a])]
        if self.first_reader is None and any(a is self.watch for a in flat):
            self.first_reader = len(self.ops)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.ops.append((str(func), [list(o.shape) if isinstance(o, torch.Tensor) else None for o in outs],
                         torch._C._current_autograd_node() is not None))
        return out


def reference_ops(perturb=False, extra_in=None):
    model, x, y = make_inputs(perturb)
    ref = Reference(watch=model.layers[1].fc.weight)
    with ref:
        train_step(model, x, y, extra_in)
    return ref, model


def test_records_every_op_with_module_paths_and_stacks(run):
    path = run("a", checksum="md5")
    d = od.load_dump(path)
    ref, model = reference_ops()
    assert [(r["op"], [m and m[0] for m in r["out"]], r["ph"] == "b") for r in d.ops] == ref.ops
    # module paths: every Linear's addmm carries its own path; the parameters are named
    fwd = d.forward_ops()
    addmm = [r for r in fwd if r["op"] == "aten.addmm.default"]
    assert [r["mod"] for r in addmm] == ["layers.0.fc", "layers.1.fc", "layers.2.fc", "head"]
    assert "p:layers.1.fc.bias" in addmm[1]["src"]
    assert {r["mod"] for r in fwd if r["op"] == "aten.native_layer_norm.default"} == \
        {"layers.0.ln", "layers.1.ln", "layers.2.ln"}
    # md5 of the real outputs: the model's final logits (addmm of head) recomputed with plain torch
    logits = model(make_inputs()[1])
    import hashlib
    assert addmm[-1]["h"][0] == hashlib.md5(logits.detach().numpy().tobytes()).hexdigest()
    # forward stacks are full (torch's Linear.forward inside) and mark the test model's line as the user frame
    fc_frames = d.stack(addmm[1]["st"])
    assert fc_frames[0][0].endswith("torch/nn/modules/linear.py") and fc_frames[0][2] == "forward"
    user = d.user_frame(addmm[1]["st"])
    assert user[0].endswith("debug_model.py") and user[1] == FC_LINE
    assert fc_frames.index(user) == d.user_index[addmm[1]["st"]] > 0
    # producers: addmm's inputs come from the layer norm (op index) and the transposed weight
    ln = next(r for r in fwd if r["mod"] == "layers.1.ln")
    assert f"o{ln['i']}.0" in addmm[1]["src"]


def test_backward_ops_carry_forward_stack_of_their_producer(run):
    d = od.load_dump(run("a", checksum=None))
    bwd = d.backward_ops()
    assert bwd and all("h" not in r for r in d.ops)
    fc1 = [r for r in bwd if r["mod"] == "layers.1.fc" and r["nname"] in ("AddmmBackward0", "TBackward0")]
    assert {r["nname"] for r in fc1} == {"AddmmBackward0", "TBackward0"}  # TBackward0 is made inside F.linear
    for r in fc1:
        fst = d.user_frame(r["fst"])
        assert fst[0].endswith("debug_model.py") and fst[1] == FC_LINE, fst
        st = d.user_frame(r["st"])  # the backward-time stack: the loss.backward() line
        assert st[1] == BACKWARD_LINE
    # every backward op except AccumulateGrad's has a forward stack
    missing = [r["nname"] for r in bwd if "fst" not in r and r["nname"] != "torch::autograd::AccumulateGrad"]
    assert missing == []
    # AccumulateGrad ops are attributed to the parameter's module
    acc = [r for r in bwd if r["nname"] == "torch::autograd::AccumulateGrad"]
    assert len(acc) == sum(1 for _ in make_inputs()[0].parameters())
    assert all(r["mod"] is not None for r in acc)


def test_identical_runs_do_not_diverge(run):
    rep = od.diff(run("a"), run("b"))
    assert not rep.diverged and rep.mismatched == 0 and rep.structural == []
    assert rep.compared == rep.aligned > 50


def test_one_ulp_weight_change_is_found_exactly_and_tolerated_when_rounded(run):
    ref, model = reference_ops(perturb=True)
    rep = od.diff(run("a", save_tensors=4096), run("c", perturb=True, save_tensors=4096))
    assert rep.diverged and rep.structural == []
    d = rep.first
    assert d.a["i"] == d.b["i"] == ref.first_reader  # the first op reading the changed weight
    assert d.a["mod"] == "layers.1.fc" and d.a["ph"] == "f"
    assert "p:layers.1.fc.weight" in d.a["src"]
    # the reported difference is the one-ulp step itself
    w0 = make_inputs()[0].layers[1].fc.weight.detach()[2, 3]
    ulp = float(torch.nextafter(w0, torch.tensor(float("inf"))) - w0)
    assert d.outputs[0].max_abs == pytest.approx(ulp, rel=1e-6)
    assert d.outputs[0].max_rel == pytest.approx(ulp / abs(float(w0)), rel=1e-6)
    assert d.user_frames()["a"][1] == d.user_frames()["b"][1] == FC_LINE
    text = rep.format()
    assert text.count(f"debug_model.py:{FC_LINE} in forward") >= 2  # the user frame of both runs
    # the tolerant checksum does not flag it anywhere (forward or backward)
    rep3 = od.diff(run("a3", checksum="rounded:3"), run("c3", perturb=True, checksum="rounded:3"))
    assert not rep3.diverged and rep3.compared == rep3.aligned


def test_extra_op_is_aligned_and_true_divergence_found(run):
    ref, _ = reference_ops(perturb=True, extra_in=0)
    a, b = run("a"), run("d", perturb=True, extra_in=0)
    rep = od.diff(a, b)
    assert rep.diverged
    assert rep.first.b["i"] == ref.first_reader and rep.first.a["i"] == ref.first_reader - 1
    assert rep.first.a["mod"] == "layers.1.fc"
    extra = [r for s in rep.before_first for r in s.b_ops]
    assert [(r["op"], r["mod"]) for r in extra] == [("aten.mul.Tensor", "layers.0")]
    assert all(s.a_ops == [] for s in rep.before_first)
    # a position-by-position comparison (what DebugMode.check_hash_mismatches does) blames the wrong op
    da, db = od.load_dump(a), od.load_dump(b)
    positional = next(k for k, (x, y) in enumerate(zip(da.ops, db.ops)) if x["h"] != y["h"])
    assert positional < rep.first.a["i"] and da.ops[positional]["mod"].startswith("layers.0")
    # the report names both call stacks and the extra op
    text = rep.format()
    assert "first divergence" in text and "aten.mul.Tensor" in text and f"debug_model.py:{FC_LINE}" in text


def test_module_filter_and_region_guard(run, tmp_path):
    full = od.load_dump(run("full", checksum=None))
    only = od.load_dump(run("only", checksum=None, modules=["layers.1"]))
    want = [(r["op"], r["mod"], r["ph"]) for r in full.ops
            if r["mod"] is not None and (r["mod"] == "layers.1" or r["mod"].startswith("layers.1."))]
    assert [(r["op"], r["mod"], r["ph"]) for r in only.ops] == want
    assert {n["mod"] for n in only.nodes.values()} <= {"layers.1", "layers.1.fc", "layers.1.ln"}

    model, x, y = make_inputs()
    with od.capture(tmp_path / "region.jsonl", checksum=None, only_regions=True) as rec:
        h = model.layers[0](x)
        with rec.region("middle"):
            h = model.layers[1](h)
        loss = torch.nn.functional.cross_entropy(model.head(model.layers[2](h)), y)
        loss.backward()
    reg = od.load_dump(rec.path)
    assert reg.ops and all(r["rg"] == "middle" for r in reg.ops)
    # the region's forward ops and the backward ops of the autograd nodes created there (not AccumulateGrad)
    want = [(r["op"], r["ph"]) for r in full.ops if r["mod"] is not None and r["mod"].startswith("layers.1")
            and r.get("nname") != "torch::autograd::AccumulateGrad"]
    assert [(r["op"], r["ph"]) for r in reg.ops] == want


def test_bad_arguments():
    with pytest.raises(od.DebugError, match="checksum="):
        od.capture("x.jsonl", checksum="sha256")
    with pytest.raises(od.DebugError, match="save_tensors="):
        od.capture("x.jsonl", save_tensors=-1)
    with pytest.raises(od.DebugError, match="modules="):
        od.capture("x.jsonl", modules="layers.1")


def test_captures_do_not_nest(tmp_path):
    with od.capture(tmp_path / "outer.jsonl") as outer:
        torch.ones(2) + 1
        with pytest.raises(od.DebugError, match="do not nest"):
            with od.capture(tmp_path / "inner.jsonl"):
                pass
        torch.ones(2) * 3
    ops = [r["op"] for r in od.load_dump(outer.path).ops]
    assert ops == ["aten.ones.default", "aten.add.Tensor", "aten.ones.default", "aten.mul.Tensor"]
    with od.capture(tmp_path / "again.jsonl"):  # usable again afterwards
        pass


def test_fused_vs_unfused_region_is_one_replace_stretch(tmp_path):
    g = torch.Generator().manual_seed(5)
    x, w1, w2 = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
    paths = {}
    for fused in (True, False):
        w1_, w2_ = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        with od.capture(tmp_path / f"{fused}.jsonl") as rec:
            h = x @ w1_
            if fused:
                h = torch.nn.functional.gelu(h, approximate="tanh")
            else:  # the same function from elementary ops
                h = 0.5 * h * (1 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))
            (h @ w2_).sum().backward()
        paths[fused] = rec.path
    rep = od.diff(paths[True], paths[False])
    first = rep.structural[0]
    assert first.tag == "replace"
    assert [r["op"] for r in first.a_ops] == ["aten.gelu.default"]
    assert "aten.tanh.default" in [r["op"] for r in first.b_ops]
    # the matmul before the region is aligned and identical; anything reported diverges after the region
    da = od.load_dump(paths[True])
    assert da.ops[0]["op"] == "aten.mm.default" and rep.aligned >= 4
    if rep.first is not None:  # float rounding may differ between the two formulas: it shows after the region
        assert rep.first.a["i"] > first.a_ops[0]["i"] and rep.before_first[0] is first


def test_views_of_captured_outputs_record_their_geometry_and_are_still_compared(tmp_path):
    """A view of a tensor an op of the capture produced is not hashed again (its bytes are its base's): it
    records ``view:OFFSET:STRIDES``. Viewing other bytes of an equal base is still found at the view op; a
    view of an outside input is hashed like any output."""
    import hashlib

    x = torch.arange(24, dtype=torch.float32).view(4, 6)

    def step(path, start):
        with od.capture(path, checksum="md5", stacks=False):
            y = x * 2  # op output
            z = y[:, start:start + 3]  # view of it
            w = x.t()  # view of an outside input
            (z.sum() + w.sum()).item()
        return od.load_dump(path)

    da, db = step(tmp_path / "a.jsonl", 1), step(tmp_path / "b.jsonl", 2)
    sl = [r for r in da.ops if r["op"] == "aten.slice.Tensor"]
    assert sl and sl[0]["h"] == ["view:1:6,1"]  # storage offset 1, strides (6, 1), from torch's own view
    t = next(r for r in da.ops if r["op"] == "aten.t.default")
    assert t["h"] == [hashlib.md5(x.t().contiguous().numpy().tobytes()).hexdigest()]
    rep = od.diff(da.path, db.path)
    assert rep.diverged and rep.first.a["op"] == "aten.slice.Tensor"
    assert rep.first.outputs[0].hash_a == "view:1:6,1" and rep.first.outputs[0].hash_b == "view:2:6,1"
