"""GGUF files (llama.cpp's single-file format) read as HuggingFace-named tensors.

A GGUF file (``docs/foreign-formats.md``) holds key/value metadata and tensors in ggml block-quantised types
(``Q4_1``, ``Q8_0``, ...). The ``gguf`` package (maintained with llama.cpp) parses the file (memory-mapped, so one tensor's bytes are read at a
time) and dequantises each type; oarlock only maps names and undoes layout changes:

* names: llama.cpp's converter renames HF keys (``model.layers.{i}.self_attn.q_proj.weight`` ->
  ``blk.{i}.attn_q.weight``, ...); :data:`LLAMA_NAMES` is the reverse table for the llama family (Llama,
  Mistral, SmolLM, ... all written with ``general.architecture = "llama"``).
* rotary permutation: for llama-family models the converter reorders the rows of ``q_proj``/``k_proj``
  (and their biases) within each head from HF's "rotate half" order to ggml's interleaved-pair order:
  ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)`` with ``d`` the head dim and ``n_head`` the query heads
  for Q, the key/value heads for K. :func:`unpermute_rotary` applies the inverse.
* shapes: GGUF lists dimensions fastest-first (``ne[0]`` = columns); torch shapes are the reverse.

Quantised tensors come out as float32 (the dequantised values); F32/F16/BF16 tensors keep their dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import CheckpointReader, box_of_stored, register_format
from oarlock.checkpoint.storage.files import local_path
from oarlock.checkpoint.storage.location import location, storage_key

GGUF_MAGIC = b"GGUF"

LLAMA_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Tensors llama.cpp adds that have no HF parameter (precomputed rope scaling factors).
_NO_HF = ("rope_freqs.weight",)
_ROTARY = {"attn_q": "head_count", "attn_k": "head_count_kv"}
_NATIVE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_ARCHITECTURES = ("llama",)


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        st, key = storage_key(path)
        return st.read_head(key, 4)[0] == GGUF_MAGIC
    except (OSError, CheckpointError):
        return False


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight ``[n_head * d, in]`` or bias
    ``[n_head * d]``): rows ``(h, j, i)`` with ``j < d/2``, ``i < 2`` (ggml's interleaved pairs) go back to
    ``(h, i, j)`` (HF's rotate-half halves). Returns a new contiguous tensor of the same shape."""
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise CheckpointFormatError(f"cannot undo the rotary permutation: {rows} rows are not a multiple of "
                                    f"2 x {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _hf_name(gguf_name: str) -> tuple[str | None, str]:
    """HF name and the table pattern it matched (None for tensors without an HF parameter)."""
    if gguf_name in _NO_HF:
        return None, gguf_name
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) >= 3 and parts[1].isdigit():
        pattern = "blk.{i}." + ".".join(parts[2:])
        hf = LLAMA_NAMES.get(pattern)
        return (hf.format(i=int(parts[1])) if hf else None), pattern
    return LLAMA_NAMES.get(gguf_name), gguf_name


class GgufFile:
    """One GGUF file opened for reading HF-named tensors.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (only ``"llama"`` is mapped).
        fields: scalar metadata values (``{"llama.block_count": 30, ...}``; token lists are left out).
        tensors: HF name -> ``(gguf tensor, rotary heads or 0, torch dtype, torch shape)``.

    Raises:
        CheckpointFormatError: not a GGUF file, truncated, an architecture without a name table, or a tensor
            name that has no HF counterpart (naming it).
    """

    def __init__(self, path: str | Path):
        self.path = location(path)
        try:
            from gguf import GGUFReader
        except ImportError:
            raise CheckpointFormatError(f"{self.path}: reading GGUF needs the 'gguf' package (pip install gguf)") from None
        if not is_gguf_file(self.path):
            raise CheckpointFormatError(f"{self.path}: not a GGUF file (no GGUF magic bytes)")
        mapped = local_path(self.path)  # the gguf package memory-maps the file
        if mapped is None:
            raise CheckpointFormatError(f"{self.path}: GGUF files are read memory-mapped from a local filesystem; "
                                        "copy it to a local file first")
        try:
            self._reader = GGUFReader(str(mapped), "r")
        except Exception as e:  # truncated files and bad offsets surface as ValueError/IndexError/struct errors
            raise CheckpointFormatError(f"{self.path}: unreadable GGUF file ({type(e).__name__}: {e})") from None
        self.fields: dict[str, Any] = {}
        for k, f in self._reader.fields.items():
            if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.bos_token_id",
                                                             "tokenizer.ggml.eos_token_id",
                                                             "tokenizer.ggml.padding_token_id",
                                                             "tokenizer.ggml.unknown_token_id"):
                continue
            try:
                self.fields[k] = f.contents()
            except Exception:
                continue
        self.architecture = str(self.fields.get("general.architecture", ""))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointFormatError(f"{self.path}: GGUF architecture {self.architecture!r} has no HF name table "
                                        f"in oarlock (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        arch = self.architecture
        self.tensors: dict[str, tuple[Any, int, torch.dtype, tuple[int, ...]]] = {}
        self.skipped: list[str] = []
        for t in self._reader.tensors:
            hf, pattern = _hf_name(t.name)
            if hf is None:
                if t.name in _NO_HF:
                    self.skipped.append(t.name)
                    continue
                raise CheckpointFormatError(f"{self.path}: GGUF tensor {t.name!r} has no HuggingFace name in the "
                                            f"{arch} table")
            shape = tuple(int(x) for x in reversed([int(n) for n in t.shape]))
            while len(shape) > 1 and shape[0] == 1 and len(t.shape) > 2:
                shape = shape[1:]
            heads = 0
            stem = pattern.split(".")[-2] if pattern.startswith("blk.") else ""
            if stem in _ROTARY:
                heads = int(self.fields.get(f"{arch}.attention.{_ROTARY[stem]}", 0))
                if heads <= 0:
                    raise CheckpointFormatError(f"{self.path}: {t.name!r} needs {arch}.attention.{_ROTARY[stem]} "
                                                "to undo the rotary permutation, and the file lacks it")
            dtype = _NATIVE.get(t.tensor_type.name, torch.float32)
            self.tensors[hf] = (t, heads, dtype, shape)

    def read(self, name: str) -> torch.Tensor:
        """The HF tensor ``name``: dequantised (float32) or native, in torch shape, rotary order undone."""
        entry = self.tensors.get(name)
        if entry is None:
            raise CheckpointFormatError(f"{self.path}: no tensor {name!r}")
        t, heads, dtype, shape = entry
        try:
            from gguf import dequantize

            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointFormatError(f"{self.path}: cannot dequantise {t.name!r} ({t.tensor_type.name}): "
                                        f"{type(e).__name__}: {e}") from None
        import numpy as np

        if not arr.flags.writeable or not arr.flags.c_contiguous:  # native tensors come back as views of the mmap
            arr = np.array(arr, copy=True, order="C")
        if t.tensor_type.name == "BF16":
            out = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(arr).to(dtype)
        if out.numel() != torch.Size(shape).numel():
            raise CheckpointFormatError(f"{self.path}: {t.name!r} dequantises to {out.numel()} values, expected "
                                        f"shape {list(shape)}")
        out = out.reshape(shape)
        if heads:
            out = unpermute_rotary(out, heads)
        return out

    def metadata(self) -> CheckpointMetadata:
        """One whole-tensor shard per HF name; ``extra["gguf"]`` holds the scalar fields and the HF config."""
        from oarlock.utils import dtype_name

        meta = CheckpointMetadata("gguf")
        for name, (_, _, dtype, shape) in self.tensors.items():
            meta.tensors[name] = TensorMeta(name, shape, dtype_name(dtype),
                                            [ShardMeta((0,) * len(shape), shape, self.path.name, name)])
        meta.extra["gguf"] = {"architecture": self.architecture, "skipped": self.skipped,
                              "hf_config": self.hf_config(),
                              "fields": {k: v for k, v in self.fields.items() if isinstance(v, (int, float, str))}}
        return meta

    def hf_config(self) -> dict[str, Any]:
        """A transformers ``config.json`` for the model (``LlamaForCausalLM``), from the GGUF metadata."""
        a, f = self.architecture, self.fields

        def need(k: str) -> Any:
            if f"{a}.{k}" not in f:
                raise CheckpointFormatError(f"{self.path}: GGUF metadata lacks {a}.{k}")
            return f[f"{a}.{k}"]

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        emb = self.tensors.get("model.embed_tokens.weight")
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": int(f.get(f"{a}.vocab_size", emb[3][0] if emb else 0)),
            "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(f.get(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(f.get(f"{a}.attention.key_length", f.get(f"{a}.rope.dimension_count", hidden // heads))),
            "max_position_embeddings": int(need("context_length")),
            "rms_norm_eps": float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(f.get(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.tensors,
            "hidden_act": "silu", "torch_dtype": "float32",
        }
        for k in ("bos", "eos", "padding", "unknown"):
            v = f.get(f"tokenizer.ggml.{k}_token_id")
            if v is not None:
                cfg[{"padding": "pad", "unknown": "unk"}.get(k, k) + "_token_id"] = int(v)
        return cfg


@register_format
class GgufReader(CheckpointReader):
    """Reader of one GGUF file (the root is the file): HF-named tensors, dequantised on read.

    A box of a tensor dequantises the whole tensor (ggml blocks span rows) and keeps it until another tensor is
    read, so the pieces one tensor feeds cost one dequantisation; memory holds one tensor.
    ``metadata.extra["hf_config"]`` is the transformers ``config.json`` that HF export writes next to the weights.
    """

    format = "gguf"
    priority = 4
    hint = "*.gguf"

    def __init__(self, path: Path, gguf_file: GgufFile):
        meta = gguf_file.metadata()
        meta.extra["hf_config"] = meta.extra["gguf"]["hf_config"]
        super().__init__(path, meta)
        self.gguf = gguf_file
        self._last: tuple[str, torch.Tensor] | None = None

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is None and (path.suffix == ".gguf" or is_gguf_file(path)) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False) -> "GgufReader":
        return cls(path, GgufFile(path))

    def close(self) -> None:
        self._last = None
        super().close()

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before dequantising the next
            self._last = (name, self.gguf.read(name))
            if file not in self.files_opened:
                self.files_opened.append(file)
        return box_of_stored(self._last[1], flat_start, shape, box, out)

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        return None
