"""Presets: ready-made AOA configs for HuggingFace architectures, one declarative table per architecture.

A preset maps the keys of a ``save_pretrained`` directory to a *training layout* -- Q/K/V fused per KV group
(AOA ``fused_qkv``), gate/up fused in the tensor-parallel-blocked ``fused_ffn`` layout, MoE experts' gate/up fused
per expert -- and carries the TP rules that split that layout (column-parallel fused projections on axis 0,
row-parallel output projections on axis 1, vocabulary-parallel embeddings). The same table read backwards
(``aoa_config_reverse``) exports it to HF keys again, bit for bit. Head counts, KV heads, biases and tied
embeddings come from the model's own ``config.json``.

A table is a list of :class:`Row` s. Each row names HF key templates (``{L}`` = ``$LAYER_ID``, ``{E}`` =
``$EXPERT_ID``; a leading ``/`` = outside the architecture's key prefix such as ``model.``), training-layout key
templates, an operation, and the config feature it depends on. Rows become AOA statements (:func:`statements`);
the explicit export statements (:func:`export_statements`) come from the same rows. The Llama family's training
layout is :class:`oarlock.models.llama.Llama` 's key set (no ``model.`` prefix); other architectures keep their
HF names except for the fused tensors, and every key no row names passes through unchanged.

Usage::

    load_state_dict(model.state_dict(), "hf_dir", aoa_config=preset("llama", "hf_dir"))
    convert_checkpoint("hf_dir", "ckpt", aoa_config=cfg := preset("hf_dir"), tp=2, tp_rules=cfg["tp_rules"])
    export_hf("ckpt", "hf_out", aoa_config=preset("hf_dir", reverse=True))

or ``oarlock convert SRC DST --preset NAME --tp N`` and ``oarlock aoa explain --preset NAME --source SRC``.
The language and the layouts are described in docs/aoa.md ("Presets").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from oarlock.checkpoint.errors import CheckpointError


class PresetError(CheckpointError):
    """A preset cannot be built: unknown name, unreadable ``config.json``, or a config of another architecture
    (the message names the preset, the ``model_type`` found and the presets that fit)."""


@dataclass(frozen=True)
class Row:
    """One mapping of a preset table.

    ``op``: ``"rename"`` (one HF key -> one key), ``"T"`` (HF stores ``[in, out]``: transposed), ``"qkv"``
    (separate q, k, v -> ``fused_qkv``), ``"ffn"`` (separate gate, up -> ``fused_ffn``), ``"ffn_fused"`` (an
    HF ``[gate; up]`` tensor -> the TP-blocked ``fused_ffn`` layout), ``"qkv_cat"`` / ``"qkv_cat_T"`` (an HF
    ``[Q; K; V]`` tensor, optionally ``[in, out]`` -> ``fused_qkv`` order), ``"experts_ffn"`` (every expert's
    gate and up -> one ``[E, 2 * I, hidden]`` tensor, expert e's ``[gate_e; up_e]`` at index e) and ``"experts"``
    (every expert's ``[hidden, I]`` tensor -> one ``[E, hidden, I]`` tensor); the two stacking ops add the expert
    axis with ``reshape=`` and concatenate on it, one statement set per layer; ``"qkv_tp"`` (separate q, k, v ->
    ``fused_qkv_old``: per TP rank its own ``[q_r; k_r; v_r]`` rows, vLLM's ``QKVParallelLinear`` layout, whose
    degree is the number of shards the destination asks for). ``when``: a feature of
    :class:`Params` that must hold (``"qkv_bias"``, ``"o_bias"``, ``"mlp_bias"``, ``"untied"``, ``"gemma2"``,
    ``"stacked_experts"``, ...), ``"!feature"`` one that must not, ``None`` = always.
    """

    op: str
    hf: tuple[str, ...]
    model: str
    when: str | None = None


@dataclass(frozen=True)
class Params:
    """What a table needs from ``config.json``: query heads ``h``, KV heads ``g``, feature flags, and for stacked
    experts the layer count, expert count, expert intermediate size and hidden size."""

    h: int
    g: int
    features: frozenset[str]
    layers: int = 0       # the sizes below are needed by the stacked-experts rows only
    experts: int = 0
    expert_ffn: int = 0
    hidden: int = 0


@dataclass(frozen=True)
class Architecture:
    """A preset: its name, the ``model_type`` values it accepts, the HF key prefix, the rows and the TP rules
    (``[(glob, axis or None)]``, first match wins, for :func:`oarlock.checkpoint.convert.resolve_tp_rules`)."""

    name: str
    model_types: tuple[str, ...]
    prefix: str
    rows: tuple[Row, ...]
    tp_rules: tuple[tuple[str, int | None], ...]
    features: tuple[str, ...] = ()  # features always on for this architecture (e.g. Qwen2's q/k/v biases)


def _r(op: str, hf: str | tuple[str, ...], model: str, when: str | None = None) -> Row:
    return Row(op, (hf,) if isinstance(hf, str) else tuple(hf), model, when)


def _same(*names: str, when: str | None = None) -> tuple[Row, ...]:
    return tuple(_r("rename", n, n, when) for n in names)


# ---------------------------------------------------------------- row groups (Llama-style decoders)
_A = "layers.{L}.self_attn."
_M = "layers.{L}.mlp."
DECODER_BASE = (
    *_same("embed_tokens.weight", "layers.{L}.input_layernorm.weight", "layers.{L}.post_attention_layernorm.weight",
           "norm.weight"),
    *_same("layers.{L}.pre_feedforward_layernorm.weight", "layers.{L}.post_feedforward_layernorm.weight",
           when="gemma2"),
    _r("rename", "/lm_head.weight", "lm_head.weight", "untied"),
)
ATTENTION = (
    _r("qkv", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), _A + "qkv_proj.weight"),
    _r("qkv", (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), _A + "qkv_proj.bias", "qkv_bias"),
    _r("rename", _A + "o_proj.weight", _A + "o_proj.weight"),
    _r("rename", _A + "o_proj.bias", _A + "o_proj.bias", "o_bias"),
)
DENSE_MLP = (
    _r("ffn", (_M + "gate_proj.weight", _M + "up_proj.weight"), _M + "gate_up_proj.weight"),
    _r("rename", _M + "down_proj.weight", _M + "down_proj.weight"),
    _r("ffn", (_M + "gate_proj.bias", _M + "up_proj.bias"), _M + "gate_up_proj.bias", "mlp_bias"),
    _r("rename", _M + "down_proj.bias", _M + "down_proj.bias", "mlp_bias"),
)
_X = _M + "experts.{E}."
_XS = _M + "experts."  # stacked experts: layers.N.mlp.experts.gate_up_proj.weight [E, 2I, hidden], down_proj
QWEN_MOE = (
    _r("rename", _M + "gate.weight", _M + "gate.weight"),
    _r("ffn", (_X + "gate_proj.weight", _X + "up_proj.weight"), _X + "gate_up_proj.weight", "!stacked_experts"),
    _r("rename", _X + "down_proj.weight", _X + "down_proj.weight", "!stacked_experts"),
    _r("experts_ffn", (_X + "gate_proj.weight", _X + "up_proj.weight"), _XS + "gate_up_proj.weight",
       "stacked_experts"),
    _r("experts", _X + "down_proj.weight", _XS + "down_proj.weight", "stacked_experts"),
)
_S = _M + "shared_expert."
QWEN_SHARED = (
    _r("ffn", (_S + "gate_proj.weight", _S + "up_proj.weight"), _S + "gate_up_proj.weight", "shared_expert"),
    _r("rename", _S + "down_proj.weight", _S + "down_proj.weight", "shared_expert"),
    _r("rename", _M + "shared_expert_gate.weight", _M + "shared_expert_gate.weight", "shared_expert"),
)
_B = "layers.{L}.block_sparse_moe."
MIXTRAL_MOE = (
    _r("rename", _B + "gate.weight", _M + "gate.weight"),
    _r("ffn", (_B + "experts.{E}.w1.weight", _B + "experts.{E}.w3.weight"), _X + "gate_up_proj.weight",
       "!stacked_experts"),
    _r("rename", _B + "experts.{E}.w2.weight", _X + "down_proj.weight", "!stacked_experts"),
    _r("experts_ffn", (_B + "experts.{E}.w1.weight", _B + "experts.{E}.w3.weight"), _XS + "gate_up_proj.weight",
       "stacked_experts"),
    _r("experts", _B + "experts.{E}.w2.weight", _XS + "down_proj.weight", "stacked_experts"),
)
PHI3 = (
    _r("qkv_cat", _A + "qkv_proj.weight", _A + "qkv_proj.weight"),
    _r("rename", _A + "o_proj.weight", _A + "o_proj.weight"),
    _r("ffn_fused", _M + "gate_up_proj.weight", _M + "gate_up_proj.weight"),
    _r("rename", _M + "down_proj.weight", _M + "down_proj.weight"),
)
_D = "model.layers.{L}."
_DS = _D + "mlp.shared_experts."
DEEPSEEK_V3 = (  # MLA projections keep their names (TP rules below); dense first layers and experts fuse gate/up
    _r("ffn", (_D + "mlp.gate_proj.weight", _D + "mlp.up_proj.weight"), _D + "mlp.gate_up_proj.weight"),
    _r("ffn", (_D + "mlp.experts.{E}.gate_proj.weight", _D + "mlp.experts.{E}.up_proj.weight"),
       _D + "mlp.experts.{E}.gate_up_proj.weight"),
    _r("ffn", (_DS + "gate_proj.weight", _DS + "up_proj.weight"), _DS + "gate_up_proj.weight"),
)
_G = "transformer.h.{L}."
GPT2 = (  # Conv1D weights are [in, out]: transposed into torch's [out, in]
    _r("qkv_cat_T", _G + "attn.c_attn.weight", _G + "attn.qkv_proj.weight"),
    _r("qkv_cat", _G + "attn.c_attn.bias", _G + "attn.qkv_proj.bias"),
    _r("T", _G + "attn.c_proj.weight", _G + "attn.o_proj.weight"),
    _r("rename", _G + "attn.c_proj.bias", _G + "attn.o_proj.bias"),
    _r("T", _G + "mlp.c_fc.weight", _G + "mlp.up_proj.weight"),
    _r("rename", _G + "mlp.c_fc.bias", _G + "mlp.up_proj.bias"),
    _r("T", _G + "mlp.c_proj.weight", _G + "mlp.down_proj.weight"),
    _r("rename", _G + "mlp.c_proj.bias", _G + "mlp.down_proj.bias"),
)
_E = "encoder.layer.{L}.attention.self."
BERT = (
    _r("qkv", (_E + "query.weight", _E + "key.weight", _E + "value.weight"), _E + "qkv_proj.weight"),
    _r("qkv", (_E + "query.bias", _E + "key.bias", _E + "value.bias"), _E + "qkv_proj.bias"),
)

# TP rules of the training layouts (torch [out, in] weights). Fused q/k/v and gate/up are split on axis 0: a
# fused_qkv row block holds whole KV groups per rank when tp divides the KV heads, and fused_ffn is written for tp.
_COLUMN = ["*qkv_proj.weight", "*qkv_proj.bias", "*gate_up_proj.weight", "*gate_up_proj.bias", "*up_proj.weight",
           "*up_proj.bias", "*q_b_proj.weight", "*kv_b_proj.weight", "*intermediate.dense.weight",
           "*intermediate.dense.bias"]
_ROW = ["*o_proj.weight", "*down_proj.weight", "*attention.output.dense.weight", "*layer.*.output.dense.weight"]
_VOCAB = ["*embed_tokens.weight", "lm_head.weight", "*.wte.weight", "*word_embeddings.weight"]
# stacked experts [E, out, in] split on the expert axis (expert parallel), before the per-expert rules match
_STACKED = ["*experts.gate_up_proj.weight", "*experts.down_proj.weight"]
TP_RULES = tuple([(p, 0) for p in _STACKED + _VOCAB + _COLUMN] + [(p, 1) for p in _ROW])

_LLAMA_LIKE = DECODER_BASE + ATTENTION + DENSE_MLP

# vLLM's own parameter layout (oarlock.integrations.vllm, docs/vllm.md): HF names kept (with the ``model.`` prefix),
# q/k/v fused into ``qkv_proj`` as vLLM's QKVParallelLinear holds them -- each TP rank's rows are its own
# ``[q_r; k_r; v_r]`` (AOA ``fused_qkv_old``) -- and gate/up into ``gate_up_proj`` as MergedColumnParallelLinear
# holds them -- each rank's ``[gate_r; up_r]`` (AOA ``fused_ffn``). Both layouts depend on the TP degree, which AOA
# takes from the number of shards the destination asks for (a live reshard gathers every worker's request).
# Every other key (embeddings, norms, o_proj, down_proj, an untied lm_head) has the same name on both sides.
_VA = "model.layers.{L}.self_attn."
_VM = "model.layers.{L}.mlp."
VLLM_DECODER = (
    # a tied lm_head is a parameter of its own in vLLM's CPU path (each layer packs its own copy): fed from the embedding
    _r("rename", "embed_tokens.weight", "lm_head.weight", "!untied"),
    _r("rename", "embed_tokens.weight", "model.embed_tokens.weight", "!untied"),
    _r("qkv_tp", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), _VA + "qkv_proj.weight"),
    _r("qkv_tp", (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), _VA + "qkv_proj.bias", "qkv_bias"),
    _r("ffn", (_M + "gate_proj.weight", _M + "up_proj.weight"), _VM + "gate_up_proj.weight"),
    _r("ffn", (_M + "gate_proj.bias", _M + "up_proj.bias"), _VM + "gate_up_proj.bias", "mlp_bias"),
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("llama", "mistral"), "model.", _LLAMA_LIKE, TP_RULES),
    Architecture("qwen2", ("qwen2",), "model.", _LLAMA_LIKE, TP_RULES, features=("qkv_bias",)),
    Architecture("qwen2_moe", ("qwen2_moe",), "model.", DECODER_BASE + ATTENTION + QWEN_MOE + QWEN_SHARED, TP_RULES,
                 features=("qkv_bias",)),
    Architecture("mixtral", ("mixtral",), "model.", DECODER_BASE + ATTENTION + MIXTRAL_MOE, TP_RULES),
    Architecture("gemma", ("gemma",), "model.", _LLAMA_LIKE, TP_RULES),
    Architecture("gemma2", ("gemma2",), "model.", _LLAMA_LIKE, TP_RULES, features=("gemma2",)),
    Architecture("phi3", ("phi3",), "model.", DECODER_BASE + PHI3, TP_RULES),
    Architecture("deepseek_v3", ("deepseek_v3",), "", DEEPSEEK_V3, TP_RULES),
    Architecture("gpt2", ("gpt2",), "", GPT2, TP_RULES),
    Architecture("bert", ("bert",), "", BERT, TP_RULES),
    # HF -> vLLM's parameters (the `oarlock` weight-transfer back end; after the training layouts, so that 'auto'
    # keeps picking those)
    Architecture("vllm_llama", ("llama", "mistral"), "model.", VLLM_DECODER, TP_RULES),
    Architecture("vllm_qwen2", ("qwen2",), "model.", VLLM_DECODER, TP_RULES, features=("qkv_bias",)),
)}
ALIASES = {"mistral": "llama", "smollm2": "llama", "smollm": "llama", "qwen2-moe": "qwen2_moe",
           "deepseek-v3": "deepseek_v3", "minilm": "bert", "vllm_mistral": "vllm_llama"}
#: ``preset("vllm", config)``: the vLLM preset whose architecture fits ``config``'s ``model_type``.
VLLM_AUTO = "vllm"


def _features(arch: Architecture, cfg: Mapping[str, Any]) -> frozenset[str]:
    f = set(arch.features)
    if cfg.get("attention_bias"):
        f |= {"qkv_bias", "o_bias"}
    if cfg.get("qkv_bias"):
        f.add("qkv_bias")
    if cfg.get("mlp_bias"):
        f.add("mlp_bias")
    if not cfg.get("tie_word_embeddings", arch.name in ("gemma", "gemma2", "gpt2", "bert")):
        f.add("untied")
    if cfg.get("shared_expert_intermediate_size"):
        f.add("shared_expert")
    return frozenset(f)


def params_from_config(arch: Architecture, cfg: Mapping[str, Any], stacked_experts: bool = False) -> Params:
    """Head counts and features of an HF ``config.json`` dict for ``arch``; with ``stacked_experts`` also the
    sizes the stacked-experts rows need (``num_hidden_layers``, ``num_local_experts`` or ``num_experts``,
    ``moe_intermediate_size`` or ``intermediate_size``, ``hidden_size``).

    Raises:
        PresetError: head counts missing or inconsistent (naming the fields); stacked experts asked of an
            architecture without experts, or sizes missing.
    """
    h = cfg.get("num_attention_heads", cfg.get("n_head"))
    g = cfg.get("num_key_value_heads") or h
    if not isinstance(h, int) or not isinstance(g, int) or h <= 0 or g <= 0 or h % g:
        raise PresetError(f"preset {arch.name!r}: config.json needs positive num_attention_heads (or n_head) "
                          f"divisible by num_key_value_heads; got {h!r} and {g!r}")
    features = _features(arch, cfg)
    if not stacked_experts:
        return Params(h, g, features)
    if not any(r.op.startswith("experts") for r in arch.rows):
        raise PresetError(f"preset {arch.name!r} has no experts to stack (stacked_experts applies to "
                          f"{', '.join(a.name for a in ARCHITECTURES.values() if any(r.op.startswith('experts') for r in a.rows))})")
    sizes = [cfg.get("num_hidden_layers"), cfg.get("num_local_experts", cfg.get("num_experts")),
             cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"), cfg.get("hidden_size")]
    if not all(isinstance(x, int) and x > 0 for x in sizes):
        raise PresetError(f"preset {arch.name!r} with stacked experts: config.json needs num_hidden_layers, "
                          f"num_local_experts (or num_experts), moe_intermediate_size (or intermediate_size) and "
                          f"hidden_size; got {sizes}")
    return Params(h, g, features | {"stacked_experts"}, *sizes)


def _expand(template: str, prefix: str) -> str:
    t = template.replace("{L}", "$LAYER_ID").replace("{E}", "$EXPERT_ID")
    return t[1:] if t.startswith("/") else prefix + t


def _model_name(template: str) -> str:
    return template.replace("{L}", "$LAYER_ID").replace("{E}", "$EXPERT_ID")


def _gqa_pieces(base: str, p: Params) -> tuple[list[str], list[str]]:
    """Temporaries for an HF ``[Q; K; V]`` tensor cut into head pieces: (natural order, fused_qkv order)."""
    names = [f"{base}.head_{i}" for i in range(p.h + 2 * p.g)]
    r = p.h // p.g
    order = []
    for j in range(p.g):
        order += names[j * r:(j + 1) * r] + [names[p.h + j], names[p.h + p.g + j]]
    return names, order


def row_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """The AOA statements (HF -> training layout) of one row."""
    hf = [_expand(n, prefix) for n in row.hf]
    m = _model_name(row.model)
    qkv = f"fused_qkv, num_heads={p.h}, num_key_value_groups={p.g}, axis=0"
    if row.op == "rename":
        return [f"{hf[0]} -> {m}"]
    if row.op == "T":
        return [f"{hf[0]}^T -> {m}"]
    if row.op == "qkv":
        return [f"{', '.join(hf)} -> {m}, {qkv}"]
    if row.op == "qkv_tp":
        return [f"{', '.join(hf)} -> {m}, fused_qkv_old, num_heads={p.h}, num_key_value_groups={p.g}, axis=0"]
    if row.op == "ffn":
        return [f"{', '.join(hf)} -> {m}, fused_ffn, axis=0"]
    if row.op == "ffn_fused":
        return [f"{hf[0]} -> {m}, fused_ffn, axis=0"]
    if row.op in ("qkv_cat", "qkv_cat_T"):
        natural, order = _gqa_pieces(m, p)
        t = "^T" if row.op == "qkv_cat_T" else ""
        return [f"{hf[0]}{t} -> {', '.join(natural)}, axis=0", f"{', '.join(order)} -> {m}, axis=0"]
    if row.op in ("experts_ffn", "experts"):
        return _stacked_statements(row, prefix, p)
    raise AssertionError(row.op)


def _stacked_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """Stacked experts: per layer and expert, ``[gate; up]`` (or the one tensor) gets a leading expert axis
    (``reshape=`` with ``src_shape=``, so reverse mode restores HF's shape), then the experts are concatenated on
    it. Layers and experts are enumerated from the config (the temporaries carry no placeholders)."""
    out = []
    ffn = row.op == "experts_ffn"
    shape = [2 * p.expert_ffn, p.hidden] if ffn else [p.hidden, p.expert_ffn]
    for layer in range(p.layers):
        m = row.model.replace("{L}", str(layer))
        parts = []
        for e in range(p.experts):
            hf = [_expand(n.replace("{L}", str(layer)).replace("{E}", str(e)), prefix) for n in row.hf]
            t = f"{m}.expert_{e}"
            if ffn:
                out.append(f"{', '.join(hf)} -> {t}, axis=0")
                out.append(f"{t} -> {t}, reshape=[1, {shape[0]}, {shape[1]}], src_shape={shape}")
            else:
                out.append(f"{hf[0]} -> {t}, reshape=[1, {shape[0]}, {shape[1]}], src_shape={shape}")
            parts.append(t)
        out.append(f"{', '.join(parts)} -> {m}, axis=0" if len(parts) > 1 else f"{parts[0]} -> {m}")
    return out


def row_export_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """The explicit inverse of :func:`row_statements` (training layout -> HF), for rows whose inverse is one
    statement (rename, T, qkv, qkv_tp, ffn, ffn_fused); ``aoa_config_reverse`` inverts every row."""
    hf = [_expand(n, prefix) for n in row.hf]
    m = _model_name(row.model)
    qkv = f"fused_qkv, num_heads={p.h}, num_key_value_groups={p.g}, axis=0"
    if row.op == "rename":
        return [f"{m} -> {hf[0]}"]
    if row.op == "T":
        return [f"{m}^T -> {hf[0]}"]
    if row.op == "qkv":
        return [f"{m} -> {', '.join(hf)}, {qkv}"]
    if row.op == "qkv_tp":
        return [f"{m} -> {', '.join(hf)}, fused_qkv_old, num_heads={p.h}, num_key_value_groups={p.g}, axis=0"]
    if row.op == "ffn":
        return [f"{m} -> {', '.join(hf)}, fused_ffn, axis=0"]
    if row.op == "ffn_fused":
        return [f"{m} -> {hf[0]}, fused_ffn, axis=0"]
    if row.op in ("experts_ffn", "experts"):  # the inverse statements, in reverse order
        out = []
        ffn = row.op == "experts_ffn"
        shape = [2 * p.expert_ffn, p.hidden] if ffn else [p.hidden, p.expert_ffn]
        for layer in range(p.layers):
            ml = row.model.replace("{L}", str(layer))
            parts = [f"{ml}.expert_{e}" for e in range(p.experts)]
            out.append(f"{ml} -> {', '.join(parts)}, axis=0" if len(parts) > 1 else f"{ml} -> {parts[0]}")
            for e, t in enumerate(parts):
                hfs = [_expand(n.replace("{L}", str(layer)).replace("{E}", str(e)), prefix) for n in row.hf]
                if ffn:
                    out += [f"{t} -> {t}, reshape={shape}", f"{t} -> {', '.join(hfs)}, axis=0"]
                else:
                    out.append(f"{t} -> {hfs[0]}, reshape={shape}")
        return out
    raise PresetError(f"row {row.op} of {row.hf[0]!r} has no single-statement inverse: use aoa_config_reverse")


def _rows(arch: Architecture, p: Params) -> list[Row]:
    return [r for r in arch.rows if r.when is None or (r.when[1:] not in p.features if r.when.startswith("!")
                                                          else r.when in p.features)]


def statements(arch: Architecture, p: Params) -> list[str]:
    """Every AOA statement (HF -> training layout) of ``arch`` for ``p``."""
    return [s for r in _rows(arch, p) for s in row_statements(r, arch.prefix, p)]


def export_statements(arch: Architecture, p: Params) -> list[str]:
    """The explicit export statements (training layout -> HF) of ``arch`` for ``p``."""
    return [s for r in _rows(arch, p) for s in row_export_statements(r, arch.prefix, p)]


def _read_config(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return dict(config.to_dict())
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise PresetError(f"{path}: cannot read the model config: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PresetError(f"{path}: not a JSON config.json: {e}") from None
        if not isinstance(data, dict):
            raise PresetError(f"{path}: config.json must hold a JSON object")
        return data
    raise PresetError(f"config must be a config.json path, a checkpoint directory, a dict or a transformers config; "
                      f"got {type(config).__name__}")


def architecture(name: str) -> Architecture:
    """The preset table called ``name`` (aliases: ``mistral``, ``smollm2`` -> ``llama``, ``minilm`` -> ``bert``).

    Raises:
        PresetError: unknown name, listing the known ones.
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key not in ARCHITECTURES:
        raise PresetError(f"unknown preset {name!r}; known presets: "
                          f"{', '.join(sorted(ARCHITECTURES) + list(MEGATRON_PRESETS))} "
                          f"(aliases: {', '.join(sorted(ALIASES))}), or 'auto' to use config.json's model_type")
    return ARCHITECTURES[key]


def preset(name: str | os.PathLike, config: Any = None, *, reverse: bool = False,
           source: Any = None, stacked_experts: bool = False) -> dict[str, Any]:
    """An AOA config for an HF architecture, built from the model's ``config.json``.

    Args:
        name: a preset name (see :data:`ARCHITECTURES`; ``"auto"`` = from ``config["model_type"]``; ``"vllm"`` =
            the ``vllm_*`` preset of that ``model_type``: HF keys -> vLLM's own parameters), or a
            checkpoint directory holding ``config.json`` (then ``config`` may be omitted: ``"auto"`` with it).
            ``"megatron_gpt"`` (aliases ``megatron``, ``megatron_llama``) maps a Megatron-Core GPT/Llama
            ``torch_dist`` checkpoint to HF Llama keys (:data:`MEGATRON_GPT`; ``config`` is then the target HF
            model's ``config.json``).
        config: ``config.json`` as a path (file or its directory), a dict, or a transformers config.
        reverse: the export direction (training layout -> HF): ``aoa_config_reverse`` set.
        source: the checkpoint the config will read (path or metadata); used by ``megatron_gpt`` for the
            padded vocabulary and the stacked layer count, ignored by the HF presets.
        stacked_experts: ``qwen2_moe``, ``mixtral``: stack each layer's experts into
            ``layers.N.mlp.experts.gate_up_proj.weight`` ``[E, 2 * I, hidden]`` (expert e's ``[gate; up]``) and
            ``layers.N.mlp.experts.down_proj.weight`` ``[E, hidden, I]``, split on the expert axis by the TP rules.

    Returns:
        ``{"aoa_statements": [...], "aoa_config_reverse": reverse, "tp_rules": [[glob, axis], ...],
        "preset": name}``: pass it as ``aoa_config=`` anywhere, and ``tp_rules`` to ``convert_checkpoint``.

    Raises:
        PresetError: unknown preset, unreadable config, or a config whose ``model_type`` this preset does not
            cover (the message names both and the preset that fits, if any).
    """
    mname = MEGATRON_ALIASES.get(str(name).lower(), str(name).lower())
    if mname in MEGATRON_PRESETS:
        if config is None:
            raise PresetError(f"preset {str(name)!r} needs the target HF model's config.json (config=PATH, dict or "
                              "transformers config; on the command line --model-config)")
        return megatron_preset(mname, config, source=source, reverse=reverse)
    if config is None and Path(name).is_dir():
        config, name = name, "auto"
    if config is None:
        raise PresetError(f"preset {str(name)!r} needs the model's config.json (config=PATH, dict or "
                          "transformers config)")
    cfg = _read_config(config)
    model_type = cfg.get("model_type")
    if str(name) == "auto":
        fits = [a for a in ARCHITECTURES.values() if model_type in a.model_types]
        if not fits:
            raise PresetError(f"no preset for model_type {model_type!r}; known presets: "
                              f"{', '.join(sorted(ARCHITECTURES))}")
        arch = fits[0]
    elif str(name).lower() == VLLM_AUTO:
        fits = [a for a in ARCHITECTURES.values() if a.name.startswith("vllm_") and model_type in a.model_types]
        if not fits:
            raise PresetError(f"no vLLM preset for model_type {model_type!r}; vLLM presets: "
                              f"{', '.join(sorted(a for a in ARCHITECTURES if a.startswith('vllm_')))}")
        arch = fits[0]
    else:
        arch = architecture(str(name))
        if model_type not in arch.model_types:
            fits = [a.name for a in ARCHITECTURES.values() if model_type in a.model_types]
            raise PresetError(f"preset {arch.name!r} is for model_type {', '.join(arch.model_types)}, but the config "
                              f"says model_type={model_type!r}" + (f": use preset {fits[0]!r}" if fits else ""))
    p = params_from_config(arch, cfg, stacked_experts)
    return {"aoa_statements": statements(arch, p), "aoa_config_reverse": bool(reverse),
            "tp_rules": [list(r) for r in arch.tp_rules], "preset": arch.name}


# ---------------------------------------------------------------- Megatron-Core GPT/Llama -> HF


@dataclass(frozen=True)
class MegatronRow:
    """One mapping of the Megatron-Core -> HF table (:data:`MEGATRON_GPT`).

    ``op``: ``"vocab"`` (a vocabulary-padded ``[V_padded, hidden]`` tensor -> its first ``vocab_size`` rows),
    ``"rename"``, ``"layer"`` (a tensor stacked on a leading layer axis -> one HF tensor per layer, the layer axis
    removed with ``reshape=``), ``"layer_qkv"`` (stacked ``linear_qkv`` in Megatron's per-query-group order
    ``[q heads of group g, k_g, v_g]``, which is AOA's ``fused_qkv`` -> q, k, v per layer) and ``"layer_split"``
    (stacked ``[gate; up]`` ``linear_fc1`` -> gate, up per layer). ``shape``: the per-layer shape as a template
    over ``{hidden}`` (one size may be -1). ``when``: a feature (``"untied"``, ``"qkv_bias"``) or None.
    """

    op: str
    megatron: str
    hf: tuple[str, ...]
    shape: str = "[-1]"
    when: str | None = None


def _m(op: str, megatron: str, hf: str | tuple[str, ...], shape: str = "[-1]", when: str | None = None) -> MegatronRow:
    return MegatronRow(op, megatron, (hf,) if isinstance(hf, str) else tuple(hf), shape, when)


_ML, _HL = "decoder.layers.", "model.layers.{L}."
MEGATRON_GPT = (
    _m("vocab", "embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    _m("vocab", "output_layer.weight", "lm_head.weight", when="untied"),
    _m("rename", "decoder.final_layernorm.weight", "model.norm.weight"),
    # Transformer Engine fuses the pre-attention / pre-MLP norms into linear_qkv / linear_fc1 (Megatron's local
    # layer spec saves them under the same names in torch_dist checkpoints)
    _m("layer", _ML + "self_attention.linear_qkv.layer_norm_weight", _HL + "input_layernorm.weight"),
    _m("layer_qkv", _ML + "self_attention.linear_qkv.weight",
       tuple(_HL + f"self_attn.{x}_proj.weight" for x in "qkv"), "[-1, {hidden}]"),
    _m("layer_qkv", _ML + "self_attention.linear_qkv.bias", tuple(_HL + f"self_attn.{x}_proj.bias" for x in "qkv"),
       when="qkv_bias"),
    _m("layer", _ML + "self_attention.linear_proj.weight", _HL + "self_attn.o_proj.weight", "[{hidden}, -1]"),
    _m("layer", _ML + "mlp.linear_fc1.layer_norm_weight", _HL + "post_attention_layernorm.weight"),
    _m("layer_split", _ML + "mlp.linear_fc1.weight", (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"),
       "[-1, {hidden}]"),
    _m("layer", _ML + "mlp.linear_fc2.weight", _HL + "mlp.down_proj.weight", "[{hidden}, -1]"),
)
MEGATRON_PRESETS = ("megatron_gpt",)
MEGATRON_ALIASES = {"megatron": "megatron_gpt", "megatron_llama": "megatron_gpt", "megatron-gpt": "megatron_gpt"}
MEGATRON_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _source_shapes(source: Any) -> dict[str, tuple[int, ...]]:
    """Global shapes of a checkpoint (a path, or metadata with ``tensors``); ``{}`` for None."""
    if source is None:
        return {}
    meta = getattr(source, "metadata", source)
    if not hasattr(meta, "tensors"):
        from oarlock.checkpoint.storage import open_checkpoint

        with open_checkpoint(source) as reader:
            meta = reader.metadata
    return {k: tuple(t.global_shape) for k, t in meta.tensors.items()}


def megatron_statements(cfg: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """The AOA statements of :data:`MEGATRON_GPT` (Megatron-Core GPT/Llama ``torch_dist`` keys -> HF Llama keys).

    Args:
        cfg: the HF ``config.json`` of the target model (``num_hidden_layers``, ``hidden_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, ``tie_word_embeddings``,
            ``attention_bias``); an optional ``padded_vocab_size`` when ``shapes`` is not given.
        shapes: global shapes of the Megatron checkpoint: its padded vocabulary (``embedding.word_embeddings``
            rows) and layer count (the stacked axis) win over ``cfg``.

    Raises:
        PresetError: sizes missing from ``cfg``, a layer count that disagrees with the checkpoint's stacked axis,
            or a padded vocabulary smaller than ``vocab_size``.
    """
    import math

    shapes = shapes or {}
    try:
        hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise PresetError(f"preset 'megatron_gpt': the HF config.json needs hidden_size, vocab_size and "
                          f"num_hidden_layers ({e})") from None
    arch = Architecture("megatron_gpt", MEGATRON_MODEL_TYPES, "", (), ())
    p = params_from_config(arch, cfg)
    features = set(p.features)
    if cfg.get("tie_word_embeddings", False):
        features.discard("untied")
    else:
        features.add("untied")
    if cfg.get("model_type") == "qwen2":
        features.add("qkv_bias")
    stacked = shapes.get(_ML + "self_attention.linear_qkv.weight")
    if stacked is not None and stacked[0] != layers:
        raise PresetError(f"preset 'megatron_gpt': config.json says num_hidden_layers={layers} but the checkpoint's "
                          f"stacked {_ML}self_attention.linear_qkv.weight has {stacked[0]} layers")
    emb = shapes.get("embedding.word_embeddings.weight")
    padded = emb[0] if emb is not None else int(cfg.get("padded_vocab_size") or vocab)
    if padded < vocab:
        raise PresetError(f"preset 'megatron_gpt': the checkpoint's vocabulary has {padded} rows, fewer than "
                          f"config.json's vocab_size={vocab}")
    qkv = f"fused_qkv, num_heads={p.h}, num_key_value_groups={p.g}, axis=0"
    out: list[str] = []
    for row in MEGATRON_GPT:
        if row.when is not None and row.when not in features:
            continue
        src = row.megatron
        if row.op == "rename":
            out.append(f"{src} -> {row.hf[0]}")
        elif row.op == "vocab":
            if padded == vocab:
                out.append(f"{src} -> {row.hf[0]}")
                continue
            step = math.gcd(vocab, padded)  # AOA splits are equal: cut into gcd-sized blocks, keep the first ones
            blocks = [f"{src}.vocab_{i}" for i in range(padded // step)]
            keep = vocab // step
            out += [f"{src} -> {', '.join(blocks)}, axis=0", f"{', '.join(blocks[:keep])} -> {row.hf[0]}, axis=0",
                    f"{', '.join(blocks[keep:])} -> _"]
        else:
            per_layer = [f"{src}.layer_{i}" for i in range(layers)]
            out.append(f"{src} -> {', '.join(per_layer)}, axis=0" if layers > 1 else f"{src} -> {per_layer[0]}")
            shape = row.shape.format(hidden=hidden)
            for i, t in enumerate(per_layer):
                hf = [h.replace("{L}", str(i)) for h in row.hf]
                if row.op == "layer":
                    out.append(f"{t} -> {hf[0]}, reshape='{shape}'")
                elif row.op == "layer_qkv":
                    out += [f"{t} -> {t}, reshape='{shape}'", f"{t} -> {', '.join(hf)}, {qkv}"]
                else:  # layer_split: [gate; up]
                    out += [f"{t} -> {t}, reshape='{shape}'", f"{t} -> {', '.join(hf)}, axis=0"]
    return out


def megatron_preset(name: str, config: Any, *, source: Any = None, reverse: bool = False) -> dict[str, Any]:
    """The Megatron-Core -> HF preset (see :func:`preset`); ``config`` is the target HF model's ``config.json``."""
    cfg = _read_config(config)
    if cfg.get("model_type") not in MEGATRON_MODEL_TYPES:
        raise PresetError(f"preset {name!r} converts Megatron-Core GPT/Llama checkpoints to an HF model of "
                          f"model_type {', '.join(MEGATRON_MODEL_TYPES)}; the config says "
                          f"model_type={cfg.get('model_type')!r}")
    return {"aoa_statements": megatron_statements(cfg, _source_shapes(source)), "aoa_config_reverse": bool(reverse),
            "tp_rules": [list(r) for r in TP_RULES], "preset": "megatron_gpt"}


def rotary_permutation_statements(source: str, destination: str, num_heads: int, head_dim: int, *,
                                  to_hf: bool = True) -> list[str]:
    """AOA statements that permute the rows of a q/k projection between Meta's interleaved rotary layout
    (``consolidated.pth``, GGUF) and HF's half-split layout, without a ``reshape=`` primitive: the rows are cut into
    single rows (``split``) and concatenated in the new order (``concat``), all on axis 0.

    HF's conversion script computes ``w.view(H, D // 2, 2, -1).transpose(1, 2).reshape(H * D, -1)`` (Meta -> HF):
    within each head, HF row ``i * D/2 + j`` is Meta row ``2 * j + i``. ``to_hf=False`` gives the inverse.
    ``source``/``destination`` may hold ``$LAYER_ID``. Shapes: ``[num_heads * head_dim, in]`` both sides.

    Raises:
        PresetError: an odd ``head_dim`` or non-positive sizes.
    """
    if num_heads <= 0 or head_dim <= 0 or head_dim % 2:
        raise PresetError(f"rotary permutation needs positive num_heads and an even head_dim, got {num_heads}, "
                          f"{head_dim}")
    rows = [f"{destination}.rotary_row_{r}" for r in range(num_heads * head_dim)]
    order = []
    half = head_dim // 2
    for h in range(num_heads):
        for i in range(2):
            for j in range(half):
                meta = h * head_dim + 2 * j + i  # HF row h*D + i*half + j comes from this Meta row
                order.append(meta)
    if not to_hf:  # the inverse permutation
        inv = [0] * len(order)
        for new, old in enumerate(order):
            inv[old] = new
        order = inv
    return [f"{source} -> {', '.join(rows)}, axis=0", f"{', '.join(rows[r] for r in order)} -> {destination}, axis=0"]


def reference_convert(arch: Architecture, p: Params, hf_state_dict: Mapping[str, Any], *,
                      tp: int = 1) -> dict[str, Any]:
    """Plain-torch execution of a preset table (the test oracle for its AOA statements): HF tensors -> the
    training layout whose TP-blocked ``fused_ffn`` tensors are laid out for degree ``tp``. Keys no row names pass
    through unchanged, as under AOA.

    Raises:
        PresetError: a row template that matches no key of ``hf_state_dict``.
    """
    import re

    import torch

    def regex(template: str) -> re.Pattern:
        t = re.escape(_expand(template, arch.prefix))
        return re.compile(t.replace(re.escape("$LAYER_ID"), r"(?P<L>\d+)").replace(re.escape("$EXPERT_ID"),
                                                                                      r"(?P<E>\d+)"))

    def fill(template: str, ids: Mapping[str, str]) -> str:
        return template.replace("{L}", ids.get("L", "{L}")).replace("{E}", ids.get("E", "{E}"))

    def blocked(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.cat([x for r in range(tp) for x in (gate.chunk(tp)[r], up.chunk(tp)[r])])

    def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs, ks, vs, r = q.chunk(p.h), k.chunk(p.g), v.chunk(p.g), p.h // p.g
        return torch.cat([x for j in range(p.g) for x in (*qs[j * r:(j + 1) * r], ks[j], vs[j])])

    out: dict[str, Any] = {}
    used: set[str] = set()
    stacks: dict[str, dict[int, Any]] = {}
    for row in _rows(arch, p):
        rx = regex(row.hf[0])
        matches = [m for k in hf_state_dict if (m := rx.fullmatch(k))]
        if not matches:
            raise PresetError(f"preset {arch.name!r}: no HF key matches {_expand(row.hf[0], arch.prefix)!r}")
        for m in matches:
            ids = {k: v for k, v in m.groupdict().items() if v is not None}
            names = [_expand(fill(t, ids), arch.prefix) for t in row.hf]
            src = [hf_state_dict[n] for n in names]
            used.update(names)
            if row.op == "rename":
                val = src[0]
            elif row.op == "T":
                val = src[0].T
            elif row.op == "qkv":
                val = gqa(*src)
            elif row.op == "qkv_tp":  # per rank its own q, k, v rows
                val = torch.cat([x.chunk(tp)[r] for r in range(tp) for x in src])
            elif row.op == "ffn":
                val = blocked(*src)
            elif row.op == "ffn_fused":
                val = blocked(*src[0].chunk(2))
            elif row.op in ("experts_ffn", "experts"):  # collected per layer, stacked below
                stacks.setdefault(fill(row.model, ids), {})[int(ids["E"])] = \
                    torch.cat(src) if row.op == "experts_ffn" else src[0]
                continue
            else:  # qkv_cat, qkv_cat_T: HF [Q; K; V] rows
                w = src[0].T if row.op == "qkv_cat_T" else src[0]
                d = w.shape[0] // (p.h + 2 * p.g)
                val = gqa(w[:p.h * d], w[p.h * d:(p.h + p.g) * d], w[(p.h + p.g) * d:])
            out[fill(row.model, ids)] = val
    for k, per_expert in stacks.items():
        out[k] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    for k, v in hf_state_dict.items():
        if k not in used:
            out.setdefault(k, v)
    return out
