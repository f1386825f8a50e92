"""AOA compile time on a DeepSeek-V3-sized key set, next to a plain-Python anchor.

Key set: 61 layers x (256 routed experts x 3 weights + MLA attention, norms, router, shared experts) plus
embeddings/head: ~48,000 source keys with DeepSeek-V3 shapes (metadata only, no tensor is allocated).
Config: PaddleFormers-style statements with $LAYER_ID / $EXPERT_ID, ^T, fused gate/up, router cast.

Anchor: build the same checkpoint-key -> model-key rename dict with a plain Python loop and ``re`` (what a
hand-written conversion script does; no shapes, no slicing, no checks).

Run: ``python benchmarks/aoa_compile.py`` (pins itself to one core; times are CPU time of this process, best
of --repeat runs, so other load on the machine inflates them less). Appends to benchmarks/RESULTS.md with
``--record``. ``--smoke``: 2 layers of 8 experts, one run: checks the script runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from oarlock.checkpoint.aoa import compile_aoa  # noqa: E402
from oarlock.checkpoint.model.mapping import TensorSpec  # noqa: E402

LAYERS, EXPERTS, HID, MOE_INTER, INTER, VOCAB = 61, 256, 7168, 2048, 18432, 129280
Q_LORA, KV_LORA, HEADS, QK_HEAD, V_HEAD, ROPE = 1536, 512, 128, 192, 128, 64


def source_keys() -> dict[str, TensorSpec]:
    bf, f32 = "bfloat16", "float32"
    s = {"model.embed_tokens.weight": TensorSpec((VOCAB, HID), bf), "model.norm.weight": TensorSpec((HID,), bf),
         "lm_head.weight": TensorSpec((VOCAB, HID), bf)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = TensorSpec((HID,), bf)
        s[f"{p}.post_attention_layernorm.weight"] = TensorSpec((HID,), bf)
        s[f"{p}.self_attn.q_a_proj.weight"] = TensorSpec((Q_LORA, HID), bf)
        s[f"{p}.self_attn.q_a_layernorm.weight"] = TensorSpec((Q_LORA,), bf)
        s[f"{p}.self_attn.q_b_proj.weight"] = TensorSpec((HEADS * QK_HEAD, Q_LORA), bf)
        s[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = TensorSpec((KV_LORA + ROPE, HID), bf)
        s[f"{p}.self_attn.kv_a_layernorm.weight"] = TensorSpec((KV_LORA,), bf)
        s[f"{p}.self_attn.kv_b_proj.weight"] = TensorSpec((HEADS * (QK_HEAD - ROPE + V_HEAD), KV_LORA), bf)
        s[f"{p}.self_attn.o_proj.weight"] = TensorSpec((HID, HEADS * V_HEAD), bf)
        s[f"{p}.mlp.gate.weight"] = TensorSpec((EXPERTS, HID), bf)
        s[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec((EXPERTS,), f32)
        for n in ("gate_proj", "up_proj"):
            s[f"{p}.mlp.shared_experts.{n}.weight"] = TensorSpec((MOE_INTER, HID), bf)
        s[f"{p}.mlp.shared_experts.down_proj.weight"] = TensorSpec((HID, MOE_INTER), bf)
        for e in range(EXPERTS):
            for n in ("gate_proj", "up_proj"):
                s[f"{p}.mlp.experts.{e}.{n}.weight"] = TensorSpec((MOE_INTER, HID), bf)
            s[f"{p}.mlp.experts.{e}.down_proj.weight"] = TensorSpec((HID, MOE_INTER), bf)
    return s


L = "model.layers.$LAYER_ID"
E = f"{L}.mlp.experts.$EXPERT_ID"
CONFIG = [
    "model.embed_tokens.weight -> embed_tokens.weight",
    f"{L}.input_layernorm.weight -> layers.$LAYER_ID.input_layernorm.weight",
    f"{L}.post_attention_layernorm.weight -> layers.$LAYER_ID.post_attention_layernorm.weight",
    *[f"{L}.self_attn.{n}.weight^T -> layers.$LAYER_ID.self_attn.{n}.weight"
      for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")],
    *[f"{L}.self_attn.{n}.weight -> layers.$LAYER_ID.self_attn.{n}.weight" for n in ("q_a_layernorm",
                                                                                     "kv_a_layernorm")],
    f"{L}.mlp.gate.weight^T -> layers.$LAYER_ID.mlp.gate.weight, dtype='float32'",
    f"{L}.mlp.gate.e_score_correction_bias -> layers.$LAYER_ID.mlp.gate.e_score_correction_bias",
    f"{L}.mlp.shared_experts.gate_proj.weight^T, {L}.mlp.shared_experts.up_proj.weight^T -> "
    "layers.$LAYER_ID.mlp.shared_experts.up_gate_proj.weight, fused_ffn",
    f"{L}.mlp.shared_experts.down_proj.weight^T -> layers.$LAYER_ID.mlp.shared_experts.down_proj.weight",
    f"{E}.gate_proj.weight^T, {E}.up_proj.weight^T -> layers.$LAYER_ID.mlp.experts.$EXPERT_ID.up_gate_proj.weight, "
    "axis=1",
    f"{E}.down_proj.weight^T -> layers.$LAYER_ID.mlp.experts.$EXPERT_ID.down_proj.weight",
    "model.norm.weight -> norm.weight",
]


def anchor(keys) -> dict[str, str]:
    """Plain loop + re: checkpoint key -> model key (what the AOA statements rename), no shapes."""
    rules = [(re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up)_proj\.weight"),
              r"layers.\1.mlp.experts.\2.up_gate_proj.weight"),
             (re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up)_proj\.weight"),
              r"layers.\1.mlp.shared_experts.up_gate_proj.weight"),
             (re.compile(r"model\.layers\.(\d+)\.(.*)"), r"layers.\1.\2"),
             (re.compile(r"model\.(embed_tokens|norm)\.weight"), r"\1.weight")]
    out = {}
    for k in keys:
        for rx, repl in rules:
            m = rx.fullmatch(k)
            if m:
                out[k] = m.expand(repl)
                break
    return out


def best_of(fn, n):
    ts = []
    for _ in range(n):
        gc.collect()  # start every run from the same collector state (garbage of the previous run collected)
        t0 = time.process_time()
        r = fn()
        ts.append(time.process_time() - t0)
    return min(ts), r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    ap.add_argument("--smoke", action="store_true", help="2 layers of 8 experts, one run: checks the script runs")
    args = ap.parse_args(argv)
    global LAYERS, EXPERTS
    if args.smoke:  # source_keys() reads them
        LAYERS, EXPERTS, args.repeat, args.record = 2, 8, 1, False
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    src = source_keys()
    t_anchor, renames = best_of(lambda: anchor(src), args.repeat)
    t_sinks, prog = best_of(lambda: compile_aoa(CONFIG, src), args.repeat)
    dst = {k: prog.destination_spec(k) for k in prog.destination_keys()}
    t_dst, prog2 = best_of(lambda: compile_aoa(CONFIG, src, dst), args.repeat)
    gc.collect()
    t0 = time.process_time()
    n_maps = sum(len(prog2.mappings_for(k)) for k in prog2.destination_keys())
    t_maps = time.process_time() - t0
    assert set(renames) == set(src) - {"lm_head.weight"}
    lines = [
        f"source keys: {len(src)}, destination keys: {len(dst)}, primitive statements: {len(prog2.statements)}, "
        f"slice mappings: {n_maps}",
        f"anchor (plain loop + re rename dict):       {t_anchor:8.3f} s",
        f"compile_aoa, destination = sinks:           {t_sinks:8.3f} s  ({t_sinks / t_anchor:5.1f}x anchor)",
        f"compile_aoa, destination = model keys:      {t_dst:8.3f} s  ({t_dst / t_anchor:5.1f}x anchor)",
        f"all mappings_for() after compile:           {t_maps:8.3f} s",
        f"compile + all mappings (model keys):        {t_dst + t_maps:8.3f} s  (target < 2 s on one core)",
    ]
    print("\n".join(lines))
    if args.record:
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "AOA compile, DeepSeek-V3-sized key set (issue 4)", ""
                    "Command: `python benchmarks/aoa_compile.py --record` (one core, best of "
                    f"{args.repeat})\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
