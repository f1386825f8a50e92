"""The Megatron-Core GPT/Llama -> HF preset (``megatron_gpt``): :data:`MEGATRON_GPT`, its table, and the AOA statements
it gives for a target HF ``config.json`` and the checkpoint's own shapes (padded vocabulary, stacked layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from oarlock.checkpoint.aoa.preset_tables import (TP_RULES, Architecture, PresetError, params_from_config,
                                                  read_model_config)


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
    cfg = read_model_config(config)
    if cfg.get("model_type") not in MEGATRON_MODEL_TYPES:
        raise PresetError(f"preset {name!r} converts Megatron-Core GPT/Llama checkpoints to an HF model of "
                          f"model_type {', '.join(MEGATRON_MODEL_TYPES)}; the config says "
                          f"model_type={cfg.get('model_type')!r}")
    return {"aoa_statements": megatron_statements(cfg, _source_shapes(source)), "aoa_config_reverse": bool(reverse),
            "tp_rules": [list(r) for r in TP_RULES], "preset": "megatron_gpt"}
