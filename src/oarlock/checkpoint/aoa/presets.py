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

The tables themselves live in :mod:`oarlock.checkpoint.aoa.preset_tables`, the Megatron-Core preset in
:mod:`oarlock.checkpoint.aoa.preset_megatron`; their names are importable from here too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from oarlock.checkpoint.aoa.preset_megatron import (MEGATRON_ALIASES, MEGATRON_GPT, MEGATRON_MODEL_TYPES,
                                                    MEGATRON_PRESETS, MegatronRow, megatron_preset,
                                                    megatron_statements)
from oarlock.checkpoint.aoa.preset_tables import (ALIASES, ARCHITECTURES, ATTENTION, BERT, DECODER_BASE, DEEPSEEK_V3,
                                                  DENSE_MLP, EXPERT_FORMATS, GPT2, MIXTRAL_MOE, PHI3, QWEN_MOE,
                                                  QWEN_SHARED, TP_RULES, VLLM_AUTO, VLLM_DECODER, VLLM_MIXTRAL,
                                                  VLLM_QWEN3_MOE, VLLM_TP_RULES, Architecture, Params, PresetError,
                                                  Row, experts_format, params_from_config, read_model_config)

__all__ = ["ALIASES", "ARCHITECTURES", "ATTENTION", "Architecture", "BERT", "DECODER_BASE", "DEEPSEEK_V3", "DENSE_MLP",
           "EXPERT_FORMATS", "GPT2", "MEGATRON_ALIASES", "MEGATRON_GPT", "MEGATRON_MODEL_TYPES", "MEGATRON_PRESETS",
           "MIXTRAL_MOE", "MegatronRow", "PHI3", "Params", "PresetError", "QWEN_MOE", "QWEN_SHARED", "Row", "TP_RULES",
           "VLLM_AUTO", "VLLM_DECODER", "VLLM_MIXTRAL", "VLLM_QWEN3_MOE", "VLLM_TP_RULES", "architecture",
           "experts_format", "export_statements", "megatron_preset", "megatron_statements", "params_from_config",
           "preset", "reference_convert", "rotary_permutation_statements", "row_export_statements", "row_statements",
           "statements"]


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


#: ops whose statement is one statement both ways -> the fused macro they name ("" for none)
_ONE_STATEMENT_OPS = {"rename": "", "T": "", "qkv": "fused_qkv", "qkv_tp": "fused_qkv_old", "ffn": "fused_ffn",
                      "ffn_fused": "fused_ffn", "cat": "", "grouped": ""}
#: the attributes of the one-statement ops that are no fused macro
_PLAIN_ATTRS = {"cat": ", axis=0", "grouped": ", permute='[0, 2, 1]'"}


def _one_statement(row: Row, prefix: str, p: Params, export: bool) -> str:
    """The statement of a row in :data:`_ONE_STATEMENT_OPS`: HF -> training layout, or with ``export`` its inverse
    (the sides swapped; a ``T`` row transposes whichever side it reads)."""
    hf = ", ".join(_expand(n, prefix) for n in (row.hf if row.op in ("qkv", "qkv_tp", "ffn", "cat") else row.hf[:1]))
    m = _model_name(row.model)
    macro = _ONE_STATEMENT_OPS[row.op]
    attrs = f", {macro}, num_heads={p.h}, num_key_value_groups={p.g}, axis=0" if macro.startswith("fused_qkv") \
        else f", {macro}, axis=0" if macro else _PLAIN_ATTRS.get(row.op, "")
    src, dst = (m, hf) if export else (hf, m)
    return f"{src}{'^T' if row.op == 'T' else ''} -> {dst}{attrs}"


def row_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """The AOA statements (HF -> training layout) of one row."""
    if row.op in _ONE_STATEMENT_OPS:
        return [_one_statement(row, prefix, p, export=False)]
    if row.op in ("qkv_cat", "qkv_cat_T"):
        natural, order = _gqa_pieces(_model_name(row.model), p)
        t = "^T" if row.op == "qkv_cat_T" else ""
        return [f"{_expand(row.hf[0], prefix)}{t} -> {', '.join(natural)}, axis=0",
                f"{', '.join(order)} -> {_model_name(row.model)}, axis=0"]
    if row.op in ("experts_ffn", "experts"):
        return _stacked_statements(row, prefix, p)
    if row.op == "qkv_cat3":
        return _qkv_cat3_statements(row, prefix, p)
    if row.op == "grouped_ffn":  # [E, hidden, I] each -> [E, I, hidden] each -> [E, 2I, hidden], [gate_e; up_e]
        m = _model_name(row.model)
        (w1, w3) = (_expand(n, prefix) for n in row.hf)
        return [f"{w1} -> {m}.gate, permute='[0, 2, 1]'", f"{w3} -> {m}.up, permute='[0, 2, 1]'",
                f"{m}.gate, {m}.up -> {m}, axis=1"]
    raise AssertionError(row.op)


def _qkv_cat3_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """Separate q, k, v -> HF's ``[q; k; v]`` concatenation. q, k and v are cut into head pieces (equal sizes)
    and the pieces concatenated, so that reverse mode (a concatenation inverts into a split in equal parts) gives
    q, k and v back; one head needs no split."""
    m = _model_name(row.model)
    out, pieces = [], []
    for name, tag, n in zip(row.hf, "qkv", (p.h, p.g, p.g)):
        parts = [f"{m}.{tag}_{i}" for i in range(n)]
        out.append(f"{_expand(name, prefix)} -> {', '.join(parts)}" + (", axis=0" if n > 1 else ""))
        pieces += parts
    out.append(f"{', '.join(pieces)} -> {m}, axis=0")
    return out


def _stacked_statements(row: Row, prefix: str, p: Params) -> list[str]:
    """Stacked experts: per layer and expert, ``[gate; up]`` (or the one tensor) gets a leading expert axis
    (``reshape=`` with ``src_shape=``, so reverse mode restores HF's shape), then the experts are concatenated on
    it. Layers and experts are enumerated from the config (the temporaries carry no placeholders)."""
    out = []
    ffn = row.op == "experts_ffn"
    shape = [2 * p.expert_ffn, p.hidden] if ffn else [p.hidden, p.expert_ffn]
    for layer in p.moe_layers or range(p.layers):
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
    if row.op in _ONE_STATEMENT_OPS:
        return [_one_statement(row, prefix, p, export=True)]
    if row.op in ("experts_ffn", "experts"):  # the inverse statements, in reverse order
        out = []
        ffn = row.op == "experts_ffn"
        shape = [2 * p.expert_ffn, p.hidden] if ffn else [p.hidden, p.expert_ffn]
        for layer in p.moe_layers or range(p.layers):
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
           source: Any = None, stacked_experts: bool = False, experts: str | None = None) -> dict[str, Any]:
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
            padded vocabulary and the stacked layer count; the vLLM MoE presets read how its experts are held
            from its keys (a mapping or a list of key names, e.g. a trainer's ``named_parameters``) when
            ``experts`` is not given; the other HF presets ignore it.
        stacked_experts: ``qwen2_moe``, ``mixtral``: stack each layer's experts into
            ``layers.N.mlp.experts.gate_up_proj.weight`` ``[E, 2 * I, hidden]`` (expert e's ``[gate; up]``) and
            ``layers.N.mlp.experts.down_proj.weight`` ``[E, hidden, I]``, split on the expert axis by the TP rules.
        experts: ``vllm_qwen3_moe``, ``vllm_mixtral``: how the HF side holds its experts: ``"modules"`` (one
            module per expert, as checkpoints store them; the default), ``"stacked"`` (transformers >= 5 in memory:
            ``mlp.experts.gate_up_proj`` ``[E, 2 * I, hidden]``, ``down_proj``) or ``"grouped"`` (grouped-GEMM
            ``mlp.experts.w1``, ``w3`` ``[E, hidden, I]``, ``w2`` ``[E, I, hidden]``). The vLLM side always holds
            them stacked (``w13_weight``, ``w2_weight``; docs/vllm.md).

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
    cfg = read_model_config(config)
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
    if experts is None:
        experts = experts_format(source) if isinstance(source, (Mapping, list, tuple, set)) else "modules"
    p = params_from_config(arch, cfg, stacked_experts, experts)
    return {"aoa_statements": statements(arch, p), "aoa_config_reverse": bool(reverse),
            "tp_rules": [list(r) for r in arch.tp_rules], "preset": arch.name}


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
            elif row.op in ("qkv_cat3", "cat"):  # vLLM's TP-independent [q; k; v], [gate; up]
                val = torch.cat(src)
            elif row.op == "grouped_ffn":
                val = torch.cat([x.transpose(1, 2) for x in src], 1)
            elif row.op == "grouped":
                val = src[0].transpose(1, 2)
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
