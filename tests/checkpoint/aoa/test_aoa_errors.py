"""Every row of the spec's error table (FlexCheckpoint spec 2.9) plus the macro-level errors of 2.5: the error
type, that it names the statement and column, and the macro expansion chain where macros were involved."""

import re

import pytest

from oarlock.checkpoint import CheckpointError
from oarlock.checkpoint.aoa import AOAError, AOASyntaxError, compile_aoa
from oarlock.checkpoint.model.mapping import TensorSpec
from oarlock.errors import OarlockError

F32 = "float32"


def S(*shape, dtype=F32):
    return TensorSpec(tuple(shape), dtype)


def err(exc, config, src, dst=None, **kw):
    with pytest.raises(exc) as e:
        compile_aoa(config, src, dst, **kw)
    return e.value


def test_error_classes_derive_from_checkpoint_error():
    assert issubclass(AOASyntaxError, AOAError) and issubclass(AOAError, CheckpointError)
    assert issubclass(AOAError, OarlockError)


def test_illegal_character_names_column():
    e = err(AOASyntaxError, ["a -> b", "a -> b; c"], {"a": S(2)})
    assert e.statement_index == 1 and e.column == 7 and "unexpected character ';'" in str(e)
    assert str(e).splitlines()[0].startswith("aoa_statements[1], column 7:")


def test_parse_errors():
    e = err(AOASyntaxError, ["a b -> c"], {"a": S(2)})
    assert "expected '->'" in str(e) and e.column == 3
    e = err(AOASyntaxError, ["a -> b, axis = c"], {"a": S(2)})
    assert "unexpected value" in str(e).lower() and e.column == 16
    e = err(AOASyntaxError, ["a -> "], {"a": S(2)})
    assert "tensor name" in str(e)
    e = err(AOASyntaxError, ["a, b"], {"a": S(2)})
    assert "'->'" in str(e)


def test_multi_var_needs_exactly_one_axis():
    src = {"s0": S(2, 2), "s1": S(2, 2)}
    assert "only support one attr named `axis`" in str(err(AOAError, ["s0, s1 -> s"], src))
    e = err(AOAError, ["s0, s1 -> s, axis=0, axis=1"], src)
    assert "only support one attr named `axis`" in str(e) and e.column is not None
    assert "only support one attr" in str(err(AOAError, ["s0 -> a, b, dtype='float16'"], src))


def test_n_to_m_statement_is_syntax_error():
    e = err(AOASyntaxError, ["s0, s1 -> a, b, axis=0"], {"s0": S(2), "s1": S(2)})
    assert "unexpected split/concat statement" in str(e)


def test_split_not_divisible():
    e = err(AOAError, ["x -> a, b, axis=1"], {"x": S(2, 3)})
    assert "not divisible" in str(e) and "[2, 3]" in str(e) and e.column == 1


def test_concat_dtype_and_shape_mismatch():
    e = err(AOAError, ["a, b -> c, axis=0"], {"a": S(2, 2), "b": S(2, 2, dtype="float16")})
    assert "All tensors must have the same dtype" in str(e) and e.column == 4
    e = err(AOAError, ["a, b -> c, axis=0"], {"a": S(2, 2), "b": S(2, 3)})
    assert "cannot concatenate" in str(e) and "[2, 3]" in str(e)


def test_unknown_attribute_and_two_operators_on_one_to_one():
    e = err(AOASyntaxError, ["a -> b, scale=2"], {"a": S(2)})
    assert "Unsupported attribute 'scale'" in str(e) and e.column == 9
    e = err(AOAError, ["a -> b, axis=0, dtype='float16'"], {"a": S(2)})
    assert "one operator" in str(e)
    assert "dtype" in str(err(AOAError, ["a -> b, dtype='float17'"], {"a": S(2)}))


def test_use_before_assignment_names_close_keys():
    e = err(AOAError, ["model.layer.0.weight -> w"], {"model.layers.0.weight": S(2)})
    assert "`model.layer.0.weight` should be assigned before!" in str(e)
    assert "model.layers.0.weight" in str(e) and e.column == 1
    # the temporaries macros create (``X^T`` -> ``X_transpose_tmp``) are never offered as names to use
    e = err(AOAError, ["model.0.weight^T -> w", "model.0.weigth -> v"], {"model.0.weight": S(2, 2)})
    assert "`model.0.weigth` should be assigned before!" in str(e)
    assert "model.0.weight" in str(e) and "_tmp" not in str(e)


def test_transpose_on_the_right():
    e = err(AOASyntaxError, ["a -> b^T"], {"a": S(2, 2)})
    assert "assign" in str(e) and "later statement" in str(e) and e.column == 6


def test_dtype_mismatch_without_cast():
    e = err(AOAError, ["a -> b"], {"a": S(2, dtype="bfloat16")}, {"b": S(2)})
    assert "direct assignment of tensors of different types is prohibited" in str(e) and "dtype='float32'" in str(e)
    # unmentioned keys too; allow_cast=True opts out
    err(AOAError, [], {"c": S(2, dtype="bfloat16")}, {"c": S(2)})
    prog = compile_aoa([], {"c": S(2, dtype="bfloat16")}, {"c": S(2)}, allow_cast=True)
    assert prog.mappings_for("c")[0].dtype == F32


def _ranges(msg):
    found = re.findall(r"slice range: (\((?:slice\(\d+, \d+\)(?:, )?)+,?\))", msg)
    return [tuple(tuple(int(x) for x in m) for m in re.findall(r"slice\((\d+), (\d+)\)", f)) for f in found]


def test_destination_outside_computed_tensor_reports_both_ranges():
    e = err(AOAError, ["a, b -> c, axis=1"], {"a": S(2, 2), "b": S(2, 2)}, {"c": S(2, 8)})
    assert "current model param slice range" in str(e) and "preloaded weights param slice range" in str(e)
    assert _ranges(str(e)) == [((0, 2), (0, 8)), ((0, 2), (0, 4))]
    # the forgotten ^T case
    e = err(AOAError, ["w -> w"], {"w": S(12, 6)}, {"w": S(6, 12)})
    assert _ranges(str(e)) == [((0, 6), (0, 12)), ((0, 12), (0, 6))]


def test_inconsistent_shard_counts_with_optimizer_states():
    src = {"w": S(4, 4), "w.moment1_0": S(4, 4)}
    e = err(AOAError, ["w -> w, fused_ffn"], src, source_shards={"w": 2, "w.moment1_0": 4})
    assert "inconsistent shard counts" in str(e) and "'w.moment1_0'" in str(e)


def test_rename_chain_cycle():
    e = err(AOAError, ["t1 -> t2", "t2 -> t1", "t1 -> y, fused_ffn"], {"x": S(4, 4)}, source_shards={"x": 2})
    assert "Infinite loop detected" in str(e) and e.statement_index == 2


def test_traceback_chain_through_macros():
    src = {f"model.layers.{i}.w": S(3, 2) for i in range(2)} | {"x": S(1)}
    e = err(AOAError, ["x -> y", "model.layers.$LAYER_ID.w^T -> out.$LAYER_ID, a, axis=1"], src)
    msg = str(e)
    assert e.statement_index == 1 and "not divisible" in msg
    assert [s for s, _ in e.chain] == ["statement", "$LAYER_ID/$EXPERT_ID", "transpose ^T"]
    assert "[statement] model.layers.$LAYER_ID.w^T -> out.$LAYER_ID, a, axis=1" in msg
    assert "[transpose ^T] model.layers.0.w_transpose_tmp -> out.0, a, axis=1" in msg
    # the column points at the failing name inside the expanded statement shown above the caret
    text = e.statement
    assert text[e.column - 1:].startswith("model.layers.0.w_transpose_tmp")


def test_zero_match_patterns_name_pattern_and_closest_keys():
    src = {"layers.2.experts.0.weight": S(2), "layers.2.experts.1.weight": S(2)}
    e = err(AOAError, ["layers.2.expert.*.weight -> f, axis=0"], src)
    assert "'layers.2.expert.*.weight' matches no source key" in str(e) and "layers.2.experts.0.weight" in str(e)
    e = err(AOAError, ["layers.$LAYER_ID.expert.0.weight -> f.$LAYER_ID"], src)
    assert "'layers.$LAYER_ID.expert.0.weight' matches no source key" in str(e)
    assert "layers.2.experts.0.weight" in str(e) and e.column == 1
    e = err(AOAError, ["a -> layers.*.w"], {"a": S(2)})
    assert "destination keys" in str(e)


def test_fused_macro_parameter_errors():
    src = {"x": S(4, 24)}
    assert "num_key_value_groups" in str(err(AOASyntaxError, ["x -> q, k, v, fused_qkv, num_heads=4"], src))
    assert "positive" in str(err(AOASyntaxError, ["x -> q, k, v, fused_qkv, num_heads=0, num_key_value_groups=1"],
                                 src))
    assert "not divisible" in str(err(AOASyntaxError,
                                      ["x -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=3"], src))
    assert "1 -> 3" in str(err(AOASyntaxError, ["x -> q, k, fused_qkv, num_heads=4, num_key_value_groups=2"], src))
    assert "fused_ffn takes" in str(err(AOASyntaxError, ["x -> a, b, c, fused_ffn"], src))
    e = err(AOAError, ["x -> y, fused_qkv_old, num_heads=4, num_key_value_groups=2"], src,
            source_shards={"x": 4})
    assert "4 TP shards" in str(e)
    e = err(AOAError, ["x.moment1_0 -> y, fused_ffn"], {"x": S(4, 4), "x.moment1_0": S(4, 4)})
    assert "automatically propagated to the optimizer state" in str(e)
    assert "unsupported attribute 'dtype'" in str(err(AOASyntaxError, ["x -> y, fused_ffn, dtype='float16'"], src))


def test_misc_binding_errors():
    assert "was deleted" in str(err(AOAError, ["a -> _", "a -> b"], {"a": S(2)}))
    assert "source-less" in str(err(AOAError, ["_ -> b", "b -> c"], {"a": S(2)}))
    assert "not a permutation" in str(err(AOAError, ["a -> b, permute='[0, 0]'"], {"a": S(2, 2)}))
    assert "out of range" in str(err(AOAError, ["a -> b, c, axis=2"], {"a": S(2, 2)}))
    assert "src_dtype='float16'" in str(err(AOAError, ["a -> b, src_dtype='float16', dst_dtype='float32'"],
                                           {"a": S(2)}))
    assert "aoa_statements" in str(err(AOASyntaxError, {"statements": []}, {}))
    assert "unknown placeholder" in str(err(AOASyntaxError, ["a.$LAYER -> b"], {"a.0": S(2)}))
    assert "array range" in str(err(AOASyntaxError, ["w[3:1] -> w, axis=0"], {"w_1": S(2)}))


def test_missing_destination_key_is_reported_not_mapped():
    prog = compile_aoa(["a -> b"], {"a": S(2)}, {"b": S(2), "c": S(3)})
    assert prog.destination_keys() == ["b"] and "c" in prog.missing
    with pytest.raises(AOAError, match="not a destination key"):
        prog.mappings_for("c")


def test_dtype_names_are_canonicalised_and_unknown_ones_named():
    prog = compile_aoa(["a, b -> c, axis=0"], {"a": S(2, dtype="F32"), "b": S(2, dtype="torch.float32")},
                       {"c": S(4, dtype="float")})
    assert prog.destination_spec("c") == S(4) and all(m.dtype is None for m in prog.mappings_for("c"))
    assert "source key 'a'" in str(err(AOAError, ["a -> b"], {"a": S(2, dtype="float33")}))
