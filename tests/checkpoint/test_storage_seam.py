"""The storage seam (issue 42 §1): a new store is one module. The in-memory store (``mem://``,
``oarlock.checkpoint.storage.memory``) registers itself and nothing else in the package knows of it; saves, resharded
loads, verification, the manager and exports then work on it through the storage protocol and the commit protocol
alone. The references are plain torch tensors, never oarlock's own reads. A count keeps the seam: no module outside
``storage/`` asks which kind of store a location is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from oarlock.checkpoint import CheckpointManager, ShardedWeight, load_state_dict, save_state_dict
from oarlock.checkpoint.errors import CheckpointDestinationError, CheckpointFormatError
from oarlock.checkpoint.storage import location, storage_key
from oarlock.checkpoint.storage.memory import MemoryStorage

PKG = Path(__file__).resolve().parents[2] / "src" / "oarlock" / "checkpoint"


@pytest.fixture(autouse=True)
def _empty_store():
    MemoryStorage.clear()
    yield
    MemoryStorage.clear()


def _objects(prefix: str) -> dict[str, int]:
    st, key = storage_key(location(prefix))
    return st.list(key)


def test_save_then_resharded_load_through_memory_store():
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    b = torch.linspace(-1, 1, 5, dtype=torch.float64)
    save_state_dict({"w": w, "b": b, "step": 7}, "mem://bkt/run/ckpt")
    names = _objects("mem://bkt/run/ckpt")
    assert {"metadata.json", "rank-00000.safetensors", ".oarlock-files"} <= set(names)
    assert ".oarlock-incomplete" not in names  # the marker goes once the commit record is written
    # a reshard: the rows 2..5 of w as one shard of a row-parallel layout, columns 1..4 of them
    part = torch.zeros(4, 3)
    out = {"w": ShardedWeight("w", part, (4, 3), (8, 6), (2, 1)), "b": torch.zeros(5, dtype=torch.float64), "step": 0}
    load_state_dict(out, "mem://bkt/run/ckpt")
    assert torch.equal(part, w[2:6, 1:4])
    assert torch.equal(out["b"], b) and out["step"] == 7
    # the data object is a plain safetensors file: the library parses it without oarlock, and it holds w's and
    # b's bytes
    st, key = storage_key(location("mem://bkt/run/ckpt/rank-00000.safetensors"))
    blob = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in st_load(st.read_bytes(key)).values())
    assert w.numpy().tobytes() in blob and b.numpy().tobytes() in blob


def test_flipped_byte_in_memory_store_fails_the_load_and_leaves_targets():
    w = torch.randn(64, 32)
    save_state_dict({"w": w}, "mem://bkt/ck")
    st, key = storage_key(location("mem://bkt/ck/rank-00000.safetensors"))
    data = bytearray(st.read_bytes(key))
    data[-7] ^= 0xFF  # a byte of w's data (the data section ends the file)
    st.put_bytes(key, bytes(data))
    out = {"w": torch.full((64, 32), 3.0)}
    with pytest.raises(Exception, match="checksum"):
        load_state_dict(out, "mem://bkt/ck")
    assert torch.equal(out["w"], torch.full((64, 32), 3.0))  # nothing was written before the verdict


def test_unfinished_save_in_memory_store_never_loads():
    st, _ = storage_key(location("mem://bkt/x"))
    st.put_bytes("half/.oarlock-incomplete", b'{"save_id": "0", "world": 1}')
    st.put_bytes("half/rank-00000.safetensors", b"partial")
    with pytest.raises(CheckpointFormatError, match="incomplete checkpoint"):
        load_state_dict({"w": torch.zeros(2)}, "mem://bkt/half")


def test_memory_store_destination_rule_keeps_foreign_objects():
    st, _ = storage_key(location("mem://bkt/x"))
    st.put_bytes("dst/notes.txt", b"mine")
    with pytest.raises(CheckpointDestinationError, match="notes.txt"):
        save_state_dict({"w": torch.ones(3)}, "mem://bkt/dst")
    save_state_dict({"w": torch.ones(3)}, "mem://bkt/dst", overwrite=True)
    assert st.read_bytes("dst/notes.txt") == b"mine"
    out = {"w": torch.zeros(3)}
    load_state_dict(out, "mem://bkt/dst")
    assert torch.equal(out["w"], torch.ones(3))


def test_manager_on_memory_store_keeps_last_and_resolves_latest():
    from oarlock.checkpoint.lifecycle.manager import resolve_manager_root

    m = CheckpointManager("mem://bkt/runs", keep_last=2)
    for step in (1, 2, 3):
        m.save(step, {"w": torch.full((4,), float(step))})
    assert m.steps() == [2, 3] and m.latest() == 3
    assert "step-00000001" not in _objects("mem://bkt/runs")  # deleted beyond keep_last
    out = {"w": torch.zeros(4)}
    assert m.load_latest(out) == 3 and torch.equal(out["w"], torch.full((4,), 3.0))
    path, name = resolve_manager_root("mem://bkt/runs")  # what the commands and the warm restart use
    assert name == "step-00000003" and str(path) == "mem://bkt/runs/step-00000003"
    # a killed save's step prefix (no commit record) is cleaned by the next save, the others stay
    st, _ = storage_key(location("mem://bkt/x"))
    st.put_bytes("runs/step-00000009/.oarlock-incomplete", b'{"save_id": "1", "world": 1}')
    st.put_bytes("runs/step-00000009/rank-00000.safetensors", b"junk")
    m.save(4, {"w": torch.full((4,), 4.0)})
    assert "step-00000009" not in _objects("mem://bkt/runs") and m.latest() == 4


def test_hf_export_from_and_to_memory_store_matches_the_tensors():
    from oarlock.checkpoint import export_hf

    sd = {"model.embed.weight": torch.randn(10, 4), "model.norm.weight": torch.rand(4)}
    save_state_dict(sd, "mem://bkt/src")
    export_hf("mem://bkt/src", "mem://bkt/hf")
    st, _ = storage_key(location("mem://bkt/x"))
    names = _objects("mem://bkt/hf")
    assert "model.safetensors" in names and ".oarlock-incomplete" not in names
    got = st_load(st.read_bytes("hf/model.safetensors"))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_verify_checkpoint_on_memory_store():
    from oarlock.checkpoint.integrity import verify_checkpoint

    save_state_dict({"w": torch.randn(16, 16)}, "mem://bkt/v")
    assert verify_checkpoint("mem://bkt/v").intact
    st, key = storage_key(location("mem://bkt/v/rank-00000.safetensors"))
    data = bytearray(st.read_bytes(key))
    data[-1] ^= 1
    st.put_bytes(key, bytes(data))
    rep = verify_checkpoint("mem://bkt/v")
    assert not rep.intact and any("checksum mismatch" in p.message for p in rep.problems)


# ---------------------------------------------------------------- the seam, counted

_STORE_KIND = {"is_object_path", "ObjectPath", "S3Storage", "LocalStorage", "MemoryStorage"}
_FS_CALLS = {"os": {"open", "pread", "preadv", "pwrite", "pwritev", "replace", "rename", "remove", "unlink", "rmdir",
                    "makedirs", "mkdir", "listdir", "scandir", "fsync", "stat", "lstat", "posix_fadvise",
                    "copy_file_range"},
             "shutil": None}  # every shutil call


def _outside_storage() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "storage" not in p.relative_to(PKG).parts)


def _calls(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "open":
                out.append((node.lineno, "open("))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in _FS_CALLS:
                allowed = _FS_CALLS[f.value.id]
                if allowed is None or f.attr in allowed:
                    out.append((node.lineno, f"{f.value.id}.{f.attr}("))
    return out


def test_no_module_outside_storage_asks_which_store_a_location_is():
    """No ``is_object_path(...)`` call and no ``isinstance(..., <a store or store path class>)`` outside storage/:
    what differs between stores is asked of the store (its protocol methods and attributes)."""
    found = []
    for p in _outside_storage():
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            kinds = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))} if fname == "isinstance" and len(node.args) == 2 else set()
            if fname == "is_object_path" or kinds & _STORE_KIND:
                found.append(f"{p.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "store-kind branches outside storage/:\n" + "\n".join(found)


# Direct filesystem calls allowed outside storage/, per module: none (the format readers read through the
# protocol too). A module that ever needs an exception is listed here with its count, which may only go down.
FS_CALL_BUDGET: dict[str, int] = {}


def test_filesystem_calls_outside_storage_only_go_down():
    counts = {}
    for p in _outside_storage():
        n = len(_calls(ast.parse(p.read_text())))
        if n:
            counts[str(p.relative_to(PKG))] = n
    over = {m: (n, FS_CALL_BUDGET.get(m, 0)) for m, n in counts.items() if n > FS_CALL_BUDGET.get(m, 0)}
    assert not over, f"direct filesystem calls outside storage/ grew (module: (now, budget)): {over}"
    stale = {m: b for m, b in FS_CALL_BUDGET.items() if counts.get(m, 0) < b}
    assert not stale, f"lower FS_CALL_BUDGET to today's counts: {stale} -> {({m: counts.get(m, 0) for m in stale})}"
