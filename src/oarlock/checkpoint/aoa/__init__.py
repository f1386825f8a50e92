"""AOA ("All in One Arrow"): declare how checkpoint tensors become model tensors.

The language reference, with torch ``[out, in]`` examples, is docs/aoa.md.

A config is ``{"aoa_statements": [str, ...], "aoa_config_reverse": bool}`` (or a plain list of strings). Each
string holds statements separated by newlines; left of ``->`` are source (checkpoint) names, right destination
(model) names::

    statement := names "->" names ["," attr {"," attr}]     attr := name "=" (NUMBER | 'STRING')

Primitive statements (after macro expansion):

* ``a -> b``                      rename (fan-out allowed: ``embed.weight -> lm_head.weight``)
* ``a -> b, c, axis=k``           equal split along axis k;   ``a, b -> c, axis=k``   concat
* ``a -> b, permute='[2, 0, 1]'`` permute axes (``'[]'`` reverses all axes)
* ``a -> b, dtype='float32'``     cast; ``src_dtype='float16', dst_dtype='float32'`` a cast reversible in
  reverse mode
* ``a -> b, reshape=[2, -1]``     row-major reshape (``src_shape=`` names the input shape for reverse-mode
  exports); may be combined with ``permute=``/``dtype=`` in one statement, applied in the written order
* ``a -> _``  drop a source;  ``_ -> b``  destination without source (keeps its initial value)

Macros, expanded in this order: ``$LAYER_ID_OFFSET`` (layer L -> L-1), ``$LAYER_ID``/``$EXPERT_ID`` (one
statement per id tuple found jointly in the source keys), ``name[a:b]`` (``name_a, ..., name_{b-1}``),
``prefix*suffix`` (all matching keys in numeric order), ``prefix**suffix`` (every key no other statement reads;
an extension: ``model.** -> **``), ``x^T`` (reverse all axes of ``x``), and the fused
layouts ``fused_qkv`` (GQA-grouped Q/K/V interleave; ``num_heads=``, ``num_key_value_groups=`` = KV heads),
``fused_qkv_old`` and ``fused_ffn`` (TP-blocked layouts that depend on the source and destination TP degrees).
Negative axes are an extension. Statements are written for model keys; optimizer states
``<key>.moment1_0``/``.exp_avg``/... follow them. ``aoa_config_reverse=True`` inverts the program (export).

TP-degree-dependent layouts a writer recorded (``AOAProgram.tp_layouts`` in ``metadata.json``) are re-laid out at
load by :func:`relayout_config`. Ready-made configs for HF architectures: :mod:`oarlock.checkpoint.aoa.presets`.

Entry point: :func:`compile_aoa` -> :class:`AOAProgram` (a ``MappingProgram`` of box-to-box slice mappings).
"""

from oarlock.checkpoint.aoa.engine import (AOAProgram, Primitive, TensorDesc, compile_aoa, expand_statements,
                                           shard_counts, source_specs)
from oarlock.checkpoint.aoa.errors import AOAError, AOASyntaxError
from oarlock.checkpoint.aoa.layout import relayout_config
from oarlock.checkpoint.aoa.lexer import Token, tokenize
from oarlock.checkpoint.aoa.macros import OPTIMIZER_SUFFIXES, split_optimizer_suffix
from oarlock.checkpoint.aoa.parser import Expr, parse_statements

__all__ = ["compile_aoa", "expand_statements", "shard_counts", "source_specs", "AOAProgram", "AOAError", "AOASyntaxError",
           "OPTIMIZER_SUFFIXES", "split_optimizer_suffix", "tokenize", "Token", "parse_statements", "Expr",
           "Primitive", "TensorDesc", "relayout_config"]
