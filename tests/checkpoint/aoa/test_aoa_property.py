"""Property test: random chains of split/concat/permute/transpose/rename/cast over random shapes, compiled and
executed across random source and destination shardings, equal the same operations done on full tensors."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oarlock.checkpoint.aoa import compile_aoa
from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors

from aoa_shardsim import assert_shards_equal, grid_boxes, load_shards, shard


def spec(t):
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def random_cuts(draw, shape):
    return [draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2)) if n > 1 else [] for n in shape]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_chains_equal_full_tensor_ops(data):
    draw = data.draw
    n_src = draw(st.integers(1, 3))
    env: dict[str, torch.Tensor] = {}
    fresh: dict[str, None] = {}
    src = {}
    for i in range(n_src):
        shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * i
        src[f"s{i}"] = env[f"s{i}"] = t
        fresh[f"s{i}"] = None
    stmts = []
    counter = [0]

    def new():
        counter[0] += 1
        return f"t{counter[0]}"

    def read(n):
        fresh.pop(n, None)
        return env[n]

    def bind(n, t):
        env[n] = t
        fresh.pop(n, None)
        fresh[n] = None

    for _ in range(draw(st.integers(1, 7))):
        op = draw(st.sampled_from(["split", "concat", "permute", "transpose", "rename", "cast"]))
        name = draw(st.sampled_from(sorted(env)))
        t = env[name]
        nd = t.dim()
        if op == "split":
            axis = draw(st.integers(-nd, nd - 1))
            parts = [p for p in (2, 3) if t.shape[axis] % p == 0]
            if not parts:
                continue
            p = draw(st.sampled_from(parts))
            outs = [new() for _ in range(p)]
            stmts.append(f"{name} -> {', '.join(outs)}, axis={axis}")
            for o, piece in zip(outs, read(name).chunk(p, axis)):
                bind(o, piece)
        elif op == "concat":
            axis = draw(st.integers(-nd, nd - 1))
            ok = [n for n in sorted(env) if env[n].dim() == nd and env[n].dtype == t.dtype and all(
                a == b for i, (a, b) in enumerate(zip(env[n].shape, t.shape)) if i != axis % nd)]
            others = draw(st.lists(st.sampled_from(ok), min_size=1, max_size=2))
            names = [name] + others
            o = new()
            stmts.append(f"{', '.join(names)} -> {o}, axis={axis}")
            bind(o, torch.cat([read(n) for n in names], axis))
        elif op == "permute":
            perm = draw(st.permutations(list(range(nd))))
            o = new()
            stmts.append(f"{name} -> {o}, permute='{list(perm)}'")
            bind(o, read(name).permute(*perm))
        elif op == "transpose":
            o = new()
            stmts.append(f"{name}^T -> {o}")
            bind(o, read(name).permute(*reversed(range(nd))))
        elif op == "rename":
            o = draw(st.sampled_from([new(), name]))
            stmts.append(f"{name} -> {o}")
            bind(o, read(name))
        else:
            dt = draw(st.sampled_from(["float64", "float32"]))
            stmts.append(f"{name} -> {name}, dtype='{dt}'")
            bind(name, read(name).to(getattr(torch, dt)))
    expected = {n: env[n] for n in fresh}
    prog = compile_aoa(stmts, {k: spec(v) for k, v in src.items()})
    assert set(prog.destination_keys()) == set(expected), stmts
    full = execute_on_full_tensors(prog, src)
    for k, v in expected.items():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), (k, stmts)
    # sharded on both sides: random grids of source shards and of destination shards
    prog2 = compile_aoa(stmts, {k: spec(v) for k, v in src.items()}, {k: spec(v) for k, v in expected.items()})
    stored = {k: shard(v, grid_boxes(v.shape, random_cuts(draw, v.shape))) for k, v in src.items()}
    targets = {k: grid_boxes(v.shape, random_cuts(draw, v.shape)) for k, v in expected.items()}
    assert_shards_equal(load_shards(prog2, stored, targets), expected)
