"""The preset tables (the data behind :mod:`oarlock.checkpoint.aoa.presets`): :class:`Row` s grouped per HF
architecture (:data:`ARCHITECTURES`), the TP rules that split the training layouts, and what a table needs from a
model's ``config.json`` (:func:`params_from_config`, :func:`read_model_config`)."""

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
    ``fused_qkv_old``: per TP rank its own ``[q_r; k_r; v_r]`` rows, whose degree is the number of shards the
    destination asks for). For vLLM's parameters (global layouts that do not depend on the TP degree, each worker
    asking for its rows as boxes): ``"qkv_cat3"`` (separate q, k, v -> HF's ``[q; k; v]`` concatenation, through
    head pieces so that reverse mode splits it back), ``"cat"`` (separate gate, up -> ``[gate; up]``),
    ``"grouped_ffn"`` (grouped-GEMM ``w1``, ``w3`` ``[E, hidden, I]`` -> ``[E, 2 * I, hidden]``, expert e's
    ``[gate_e; up_e]``) and ``"grouped"`` (grouped-GEMM ``w2`` ``[E, I, hidden]`` -> ``[E, hidden, I]``).
    ``when``: a feature of :class:`Params` that must hold (``"qkv_bias"``, ``"o_bias"``, ``"mlp_bias"``,
    ``"untied"``, ``"gemma2"``, ``"stacked_experts"``, ``"experts_modules"`` / ``"experts_stacked"`` /
    ``"experts_grouped"`` (how the HF side holds its experts), ``"dense_layers"`` (some layers of an MoE model
    have a dense MLP), ...), ``"!feature"`` one that must not, ``None`` = always.
    """

    op: str
    hf: tuple[str, ...]
    model: str
    when: str | None = None


@dataclass(frozen=True)
class Params:
    """What a table needs from ``config.json``: query heads ``h``, KV heads ``g``, feature flags, and for stacked
    experts the layer count, expert count, expert intermediate size, hidden size and the layers that hold experts
    (``moe_layers``; Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` leave some dense)."""

    h: int
    g: int
    features: frozenset[str]
    layers: int = 0       # the sizes below are needed by the stacked-experts rows only
    experts: int = 0
    expert_ffn: int = 0
    hidden: int = 0
    moe_layers: tuple[int, ...] = ()


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

# vLLM's own parameters (oarlock.integrations.vllm, docs/vllm.md): HF names kept (with the ``model.`` prefix) except
# for vLLM's fused tensors, each described by a global layout that does not depend on the TP degree, HF's tensors
# concatenated: ``qkv_proj`` = ``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``, the experts of a layer stacked as
# ``w13_weight`` ``[E, 2 * I, hidden]`` (expert e's ``[gate_e; up_e]``, vLLM's order: w1 then w3) and ``w2_weight``
# ``[E, hidden, I]``. A worker asks for the rows it holds as boxes of that global tensor: its q heads, the KV heads
# it holds (replicated when the TP degree exceeds the KV heads: those ranks ask for the same box), its gate and up
# rows of every expert (TP-split experts) or its experts whole (expert parallel). One config serves every degree.
_VA = "model.layers.{L}.self_attn."
_VM = "model.layers.{L}.mlp."


def _vllm_dense_mlp(when: str | None) -> tuple[Row, ...]:
    return (_r("cat", (_M + "gate_proj.weight", _M + "up_proj.weight"), _VM + "gate_up_proj.weight", when),
            _r("cat", (_M + "gate_proj.bias", _M + "up_proj.bias"), _VM + "gate_up_proj.bias",
               "mlp_bias" if when is None else when))


VLLM_ATTENTION = (
    # a tied lm_head is a parameter of its own in vLLM's CPU path (each layer packs its own copy): fed from the embedding
    _r("rename", "embed_tokens.weight", "lm_head.weight", "!untied"),
    _r("rename", "embed_tokens.weight", "model.embed_tokens.weight", "!untied"),
    _r("qkv_cat3", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), _VA + "qkv_proj.weight"),
    _r("qkv_cat3", (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), _VA + "qkv_proj.bias", "qkv_bias"),
)
VLLM_DECODER = VLLM_ATTENTION + _vllm_dense_mlp(None)


def _vllm_experts(hf_modules: tuple[str, str, str], model: str) -> tuple[Row, ...]:
    """vLLM's stacked experts (``model`` + ``w13_weight`` / ``w2_weight``) from the three ways an HF-named trainer
    holds them: one module per expert (``hf_modules``: gate, up and down templates with ``{E}``; checkpoints,
    transformers < 5), stacked (transformers >= 5 in memory: ``mlp.experts.gate_up_proj`` ``[E, 2 * I, hidden]``,
    ``down_proj`` ``[E, hidden, I]``: vLLM's global layout already) or grouped-GEMM (torchtitan style
    ``mlp.experts.w1``, ``w3`` ``[E, hidden, I]``, ``w2`` ``[E, I, hidden]``)."""
    gate, up, down = hf_modules
    return (
        _r("experts_ffn", (gate, up), model + "w13_weight", "experts_modules"),
        _r("experts", down, model + "w2_weight", "experts_modules"),
        _r("rename", _M + "experts.gate_up_proj", model + "w13_weight", "experts_stacked"),
        _r("rename", _M + "experts.down_proj", model + "w2_weight", "experts_stacked"),
        _r("grouped_ffn", (_M + "experts.w1", _M + "experts.w3"), model + "w13_weight", "experts_grouped"),
        _r("grouped", _M + "experts.w2", model + "w2_weight", "experts_grouped"),
    )


VLLM_QWEN3_MOE = VLLM_ATTENTION + _vllm_dense_mlp("dense_layers") + _vllm_experts(
    (_X + "gate_proj.weight", _X + "up_proj.weight", _X + "down_proj.weight"), _VM + "experts.routed_experts.")
_VB = "model.layers.{L}.block_sparse_moe."
VLLM_MIXTRAL = VLLM_ATTENTION + (
    # transformers >= 5 names Mixtral's block ``mlp`` in memory; checkpoints keep ``block_sparse_moe`` (vLLM's name)
    _r("rename", _M + "gate.weight", _VB + "gate.weight", "!experts_modules"),
) + _vllm_experts((_B + "experts.{E}.w1.weight", _B + "experts.{E}.w3.weight", _B + "experts.{E}.w2.weight"),
                  _VB + "experts.routed_experts.")
# How `oarlock aoa explain --tp N` / `convert --tp N` split vLLM's global tensors: the stacked experts on the expert
# axis (an expert-parallel engine's layout), vocabulary and row-parallel tensors as vLLM splits them; qkv_proj and
# gate_up_proj stay whole (a TP worker asks for its q/k/v or gate/up rows as separate boxes, which one axis rule
# cannot show).
VLLM_TP_RULES = tuple([(p, 0) for p in ["*experts.routed_experts.w13_weight", "*experts.routed_experts.w2_weight"]
                       + _VOCAB]
                      + [(p, None) for p in ["*qkv_proj.weight", "*qkv_proj.bias", "*gate_up_proj.weight",
                                             "*gate_up_proj.bias"]]
                      + [(p, 1) for p in ["*o_proj.weight", "*down_proj.weight"]])
#: how a trainer with HF names holds its experts (``preset(..., experts=)``); :func:`experts_format` tells them apart
EXPERT_FORMATS = ("modules", "stacked", "grouped")
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
    Architecture("vllm_llama", ("llama", "mistral"), "model.", VLLM_DECODER, VLLM_TP_RULES),
    Architecture("vllm_qwen2", ("qwen2",), "model.", VLLM_DECODER, VLLM_TP_RULES, features=("qkv_bias",)),
    Architecture("vllm_qwen3_moe", ("qwen3_moe",), "model.", VLLM_QWEN3_MOE, VLLM_TP_RULES,
                 features=("stacked_experts",)),
    Architecture("vllm_mixtral", ("mixtral",), "model.", VLLM_MIXTRAL, VLLM_TP_RULES, features=("stacked_experts",)),
)}
ALIASES = {"mistral": "llama", "smollm2": "llama", "smollm": "llama", "qwen2-moe": "qwen2_moe",
           "deepseek-v3": "deepseek_v3", "minilm": "bert", "vllm_mistral": "vllm_llama",
           "vllm_qwen3-moe": "vllm_qwen3_moe"}
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


def params_from_config(arch: Architecture, cfg: Mapping[str, Any], stacked_experts: bool = False,
                       experts: str = "modules") -> Params:
    """Head counts and features of an HF ``config.json`` dict for ``arch``; with ``stacked_experts`` (always for
    the vLLM MoE presets) also the sizes the stacked-experts rows need (``num_hidden_layers``,
    ``num_local_experts`` or ``num_experts``, ``moe_intermediate_size`` or ``intermediate_size``, ``hidden_size``)
    and the layers that hold experts. ``experts``: how the HF side holds them (:data:`EXPERT_FORMATS`; read by the
    vLLM MoE presets only).

    Raises:
        PresetError: head counts missing or inconsistent (naming the fields); stacked experts asked of an
            architecture without experts, or sizes missing; an unknown ``experts`` format.
    """
    h = cfg.get("num_attention_heads", cfg.get("n_head"))
    g = cfg.get("num_key_value_heads") or h
    if not isinstance(h, int) or not isinstance(g, int) or h <= 0 or g <= 0 or h % g:
        raise PresetError(f"preset {arch.name!r}: config.json needs positive num_attention_heads (or n_head) "
                          f"divisible by num_key_value_heads; got {h!r} and {g!r}")
    if experts not in EXPERT_FORMATS:
        raise PresetError(f"preset {arch.name!r}: experts={experts!r} is not one of {', '.join(EXPERT_FORMATS)}")
    features = _features(arch, cfg)
    stacked_experts = stacked_experts or "stacked_experts" in arch.features
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
    # Qwen-MoE: the layers in mlp_only_layers, and all but every decoder_sparse_step-th one, have a dense MLP
    dense = set(cfg.get("mlp_only_layers") or ())
    step = cfg.get("decoder_sparse_step") or 1
    moe_layers = tuple(i for i in range(sizes[0]) if i not in dense and (i + 1) % step == 0)
    if len(moe_layers) < sizes[0]:
        features |= {"dense_layers"}
    if "stacked_experts" in arch.features:  # the vLLM MoE presets: the trainer's experts format picks the rows
        features |= {f"experts_{experts}"}
    return Params(h, g, features | {"stacked_experts"}, *sizes, moe_layers=moe_layers)


def experts_format(keys: Any) -> str:
    """How a trainer with HF names holds its experts, from its parameter names: ``"stacked"`` (transformers >= 5
    in memory: ``...mlp.experts.gate_up_proj``), ``"grouped"`` (grouped-GEMM ``...mlp.experts.w1``), else
    ``"modules"`` (one module per expert, as checkpoints store them)."""
    names = list(keys)
    if any(k.endswith(".experts.gate_up_proj") for k in names):
        return "stacked"
    if any(k.endswith(".experts.w1") for k in names):
        return "grouped"
    return "modules"


def read_model_config(config: Any) -> dict[str, Any]:
    """A model's ``config.json`` as a dict, from a path (the file or its directory), a dict or a transformers config.

    Raises:
        PresetError: unreadable, not JSON, not an object, or of another type.
    """
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
