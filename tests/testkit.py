"""Helpers shared by test modules (importable from every test directory: ``tests/`` is on ``sys.path`` through
``tests/conftest.py``): CLI runs, directory digests, independent safetensors reads, hand-made foreign
checkpoints."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
import types
from pathlib import Path

import torch


def run_cli(*args: object, cwd: str | Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m oarlock.cli ARGS`` in a fresh process (this checkout's code: conftest sets PYTHONPATH)."""
    return subprocess.run([sys.executable, "-m", "oarlock.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def load_benchmark(name: str) -> types.ModuleType:
    """The script ``benchmarks/<name>.py`` imported as module ``bench_<name>`` (benchmarks are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root``: relative path -> sha256 hex digest (to show a command wrote nothing there)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def seeded_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A reproducible test tensor: standard normal values cast to ``dtype``, or for int64 integers in
    ``[-10**12, 10**12)`` (beyond float precision, so a lossy path shows)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-10**12, 10**12, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def st_tensors(d: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of directory ``d``, read with ``safetensors.safe_open`` (the
    independent reader); a key stored in two files fails the test."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                assert k not in out, f"{k} is stored twice"
                out[k] = fh.get_tensor(k)
    return out


def _fake_paddle_module() -> types.ModuleType:
    """Classes pickled under Paddle's module path, as Paddle 3.3 writes them (NEWOBJ + dict state)."""
    mod = types.ModuleType("paddle.distributed.flex_checkpoint.dcp.metadata")
    for name in ("Metadata", "LocalTensorMetadata", "LocalTensorIndex"):
        cls = type(name, (), {"__module__": mod.__name__, "__hash__": lambda s: hash(repr(sorted(s.__dict__.items())))})
        setattr(mod, name, cls)
    return mod


def _make(cls: type, **kw: object) -> object:
    o = cls.__new__(cls)
    o.__dict__.update(kw)
    return o


def write_paddle_checkpoint(root: Path, tensors: dict, data_format: str = "distcp",
                            rank_of: dict | None = None) -> None:
    """A one-rank Paddle FlexCheckpoint of ``tensors`` (``{key: numpy array}``) in ``root``: ``0.metadata`` pickled
    with Paddle's record classes (stand-ins under Paddle's module path, Paddle is not needed) and ``0_0.distcp``
    (pickled arrays) or ``0_0.safetensors``. ``rank_of`` (``{key: r}``) puts keys into rank ``r``'s file
    ``r_0.*`` instead, as a job of several ranks saves them."""
    from safetensors.torch import save_file

    mod = _fake_paddle_module()
    saved = {m: sys.modules.get(m) for m in ["paddle", "paddle.distributed", "paddle.distributed.flex_checkpoint",
                                             "paddle.distributed.flex_checkpoint.dcp", mod.__name__]}
    for m in saved:
        sys.modules[m] = mod if m == mod.__name__ else types.ModuleType(m)
    try:
        fname = f"0_0.{data_format}"
        sdm, storage = {}, {}
        for k, arr in tensors.items():
            sdm[k] = [_make(mod.LocalTensorMetadata, global_offset=(0,) * arr.ndim, local_shape=arr.shape,
                            dtype=str(arr.dtype), global_shape=arr.shape, is_flattened=False, flattened_range=None)]
            storage[_make(mod.LocalTensorIndex, tensor_key=k, global_offset=(0,) * arr.ndim, is_flattened=False,
                          flattened_range=None, replica_id=None, local_shape=arr.shape)] = \
                f"{(rank_of or {}).get(k, 0)}_0.{data_format}"
        meta = _make(mod.Metadata, state_dict_metadata=sdm, storage_metadata=storage,
                     flat_mapping={k: (k,) for k in tensors})
        (root / "0.metadata").write_bytes(pickle.dumps(meta, protocol=4))
    finally:
        for m, v in saved.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v
    for r in sorted({(rank_of or {}).get(k, 0) for k in tensors}):
        part = {k: v for k, v in tensors.items() if (rank_of or {}).get(k, 0) == r}
        fname = f"{r}_0.{data_format}"
        if data_format == "distcp":
            (root / fname).write_bytes(pickle.dumps({**part, "StructuredToParameterName@@": {}}, protocol=4))
        else:
            save_file({k: torch.from_numpy(v) for k, v in part.items()}, root / fname)


class PickledCall:
    """Pickles as the call ``fn(*args)`` (``__reduce__``): what a hostile pickle holds, e.g.
    ``PickledCall(os.system, "touch MARKER")``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class TransposeSplit:
    """A hand-built mapping program (no AOA): ``w`` (4, 6) float32 -> ``a`` = ``w[:, :3]^T`` (3, 4) and ``b`` =
    ``w[:, 3:]`` cast to float64 (4, 3), ``b`` assembled from two row halves."""

    def destination_keys(self):
        return ["a", "b"]

    def destination_spec(self, key):
        from oarlock.checkpoint.model.mapping import TensorSpec

        return {"a": TensorSpec((3, 4), "float32"), "b": TensorSpec((4, 3), "float64")}[key]

    def mappings_for(self, key):
        from oarlock.checkpoint.model.mapping import SliceMapping

        if key == "a":
            return [SliceMapping("a", ((0, 3), (0, 4)), "w", ((0, 4), (0, 3)), permute=(1, 0))]
        return [SliceMapping("b", ((0, 2), (0, 3)), "w", ((0, 2), (3, 6)), dtype="float64"),
                SliceMapping("b", ((2, 4), (0, 3)), "w", ((2, 4), (3, 6)), dtype="float64")]


def listed_metadata(ckpt: str | Path) -> dict:
    """Rewrite ``ckpt/metadata.json`` with every shard listed (the version 1 form every reader accepts) and return
    the parsed object: for tests that edit shard records of checkpoints saved with grid records."""
    import json

    from oarlock.checkpoint.model.metadata import CheckpointMetadata

    path = Path(ckpt) / "metadata.json"
    meta = CheckpointMetadata.from_json(json.loads(path.read_text()))
    raw = meta.to_json(compact=False)
    path.write_text(json.dumps(raw, indent=1))
    return raw
