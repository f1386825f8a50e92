"""Record every aten op of a forward and backward pass, with module paths, call stacks and checksums.

How it works (see ``docs/memory-debug.md``):

- A ``TorchDispatchMode`` sees every aten op, forward and backward. For each op it records the op name,
  input/output shapes and dtypes, where each input came from (an earlier op's output, a named parameter),
  the module path (kept by global ``nn.Module`` forward hooks) and the output checksums.
- A ``TorchFunctionMode`` sees each user-level torch call (``F.linear``, ``x @ w``, ``loss.backward()``).
  It takes the Python call stack once per call (only the recorder's own frames dropped; the innermost
  frame of the user's code is marked so reports show it first), and after the call
  tags every autograd node the call created (``grad_fn`` plus the nodes reachable from it created after the
  capture started, e.g. the ``TBackward0`` inside ``F.linear``) by storing an id, the stack and the module
  path in ``node.metadata``. In backward, ``torch._C._current_autograd_node()`` names the node whose ops
  are running, so each backward op carries the forward stack and module of its producer.
- Records go to a JSONL file in batches: fast (device-side) checksums are read back once per batch, so a
  GPU run does not synchronise per op.

Dump format (one JSON object per line, ``"k"`` is the kind):

- ``header``: ``format``, ``version``, ``checksum`` (spec or null), ``stacks``, ``tensors`` (file of saved
  outputs or null), ``torch`` version.
- ``stack``: ``id``, ``frames`` = ``[[file, line, function], ...]`` innermost first, ``u`` = index in
  ``frames`` of the innermost user frame (outside torch/transformers/oarlock/stdlib/installed packages) or
  null.
- ``node`` (autograd node): ``id``, ``name``, ``mod``, ``st`` (forward stack id), ``next`` = one
  ``[node_id, input_nr]`` or null per ``next_functions`` entry, ``grads`` = ``[shape, dtype]`` of each gradient
  the node receives, ``param`` for ``AccumulateGrad``, ``ext`` for nodes created before the capture.
- ``op``: ``i`` (index), ``op`` (``aten.addmm.default``), ``ph`` (``"f"``/``"b"``), ``mod``, ``in``/``out``
  (``[shape, dtype]`` or null for non-tensors), ``src`` (per input: ``"o12.0"`` = output 0 of op 12,
  ``"p:layers.0.fc.weight"``, or null), ``h`` (per output checksum or null), ``st`` (call stack id),
  ``node``/``nname``/``fst`` for backward ops (autograd node id, name, forward stack id), ``rg`` (region),
  ``sv`` (saved tensor keys).
- ``end``: ``ops``, ``nodes``.

The dump is written to ``<path>.partial`` and renamed to ``path`` only when the ``with`` block and the
writing finished; a block that raised leaves ``<path>.partial`` (with an ``end`` record carrying ``error``)
and no ``path``. Full description: ``docs/memory-debug.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from oarlock.debug import checksum as _ck
from oarlock.debug.errors import DebugError

logger = logging.getLogger("oarlock.debug")

FORMAT = "oarlock-debug-capture"
VERSION = 1
_KEY = "oarlock.debug"  # grad_fn.metadata key holding (capture token, node id, stack id, module, region)
_FLUSH_EVERY = 2048
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE_DIR = os.path.dirname(__file__) + os.sep
_SKIP, _LIBRARY, _USER = 0, 1, 2  # frame kinds: recorder internals (dropped), library code, the user's code
_SKIP_NAMESPACES = ("profiler",)
_SAFETENSORS_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                       torch.int16, torch.int8, torch.uint8, torch.bool}
_ACC = "torch::autograd::AccumulateGrad"
_ACTIVE: "Capture | None" = None  # the capture running now (captures do not nest)


_DTYPE_STR: dict[torch.dtype, str] = {}
_OP_STR: dict[Any, str] = {}


def _dtype_str(dtype: torch.dtype) -> str:
    s = _DTYPE_STR.get(dtype)
    if s is None:
        s = _DTYPE_STR[dtype] = str(dtype).removeprefix("torch.")
    return s


def _op_str(func) -> str:
    s = _OP_STR.get(func)
    if s is None:
        s = _OP_STR[func] = str(func)
    return s


_IS_VIEW: dict[Any, bool] = {}


def _is_view(func) -> bool:
    """Whether an aten op returns views of an input without writing it (its schema's alias annotations)."""
    v = _IS_VIEW.get(func)
    if v is None:
        v = _IS_VIEW[func] = bool(getattr(func, "is_view", False))
    return v


def _meta(x: Any) -> list | None:
    if isinstance(x, torch.Tensor):
        return [list(x.shape), _dtype_str(x.dtype)]
    return None


def _tensors_in(args: Sequence, kwargs: dict) -> list:
    """Tensor arguments in order (lists of tensors such as ``cat``'s are expanded); non-tensors skipped."""
    out = []
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _outputs(out: Any) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def library_prefixes() -> tuple[str, ...]:
    """Directories whose frames count as library code in stacks: torch, transformers (when installed),
    oarlock and the Python standard library (installed packages count too, see ``_frame_kind``)."""
    import importlib.util
    import sysconfig

    dirs = [_TORCH_DIR, os.path.dirname(os.path.dirname(_HERE_DIR.rstrip(os.sep))) + os.sep]
    spec = importlib.util.find_spec("transformers") if "transformers" not in sys.modules else \
        sys.modules["transformers"].__spec__
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(spec.origin) + os.sep)
    for key in ("stdlib", "platstdlib"):
        d = sysconfig.get_paths().get(key)
        if d:
            dirs.append(d.rstrip(os.sep) + os.sep)
    return tuple(dict.fromkeys(dirs))


_LIBRARY_PREFIXES: tuple[str, ...] | None = None


def _frame_kind(filename: str) -> int:
    """_SKIP for the recorder's frames, _LIBRARY for torch/transformers/oarlock/stdlib or any installed
    package (site-packages, dist-packages), else _USER."""
    global _LIBRARY_PREFIXES
    if filename.startswith(_HERE_DIR):
        return _SKIP
    if _LIBRARY_PREFIXES is None:
        _LIBRARY_PREFIXES = library_prefixes()
    if (filename.startswith(_LIBRARY_PREFIXES) or filename.startswith("<frozen ")
            or f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}dist-packages{os.sep}" in filename):
        return _LIBRARY
    return _USER


class _FunctionTagger(TorchFunctionMode):
    """Takes the user's stack per torch call and tags the autograd nodes that call created."""

    def __init__(self, cap: "Capture"):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        cap = self.cap
        prev = cap._frame, cap._sid
        cap._frame, cap._sid = sys._getframe(1), None  # the stack is only walked if an op needs it
        try:
            out = func(*args, **(kwargs or {}))
            if torch.is_grad_enabled():
                for t in _outputs(out):
                    if isinstance(t, torch.Tensor):
                        fn = t.grad_fn
                        if fn is not None:
                            cap._tag_nodes(fn)
            return out
        finally:
            cap._frame, cap._sid = prev


class _OpRecorder(TorchDispatchMode):
    def __init__(self, cap: "Capture"):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace not in _SKIP_NAMESPACES:
            self.cap._record_op(func, args, kwargs, out)
        return out


class Capture:
    """Context manager returned by :func:`capture`; see there. Attributes after exit: ``path`` (the JSONL
    dump), ``tensors_path`` (saved outputs, or None), ``num_ops``, ``num_nodes``; ``partial_path``
    (``<path>.partial``) is where the dump is written until the block ends, and what remains when it raised."""

    def __init__(self, path: str | os.PathLike, checksum: str | None = "fast", stacks: bool = True, *,
                 save_tensors: int = 0, modules: Sequence[str] | None = None, only_regions: bool = False,
                 model: torch.nn.Module | None = None, stack_depth: int = 64):
        self.checksum, self._hash = _ck.hasher(checksum)
        if not isinstance(save_tensors, int) or isinstance(save_tensors, bool) or save_tensors < 0:
            raise DebugError(f"save_tensors={save_tensors!r}: expected the largest number of elements of an "
                             "output to save (0 = save none)")
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
            raise DebugError(f"modules={modules!r}: expected a list of module path prefixes such as ['layers.1']")
        if stack_depth < 1:
            raise DebugError(f"stack_depth={stack_depth}: must be at least 1")
        self.path = Path(path)
        self.stacks = bool(stacks)
        self.save_tensors = save_tensors
        self.tensors_path = self.path.with_name(self.path.name + ".safetensors") if save_tensors else None
        self.modules = tuple(modules) if modules is not None else None
        self.only_regions = only_regions
        self.stack_depth = stack_depth
        self._model = model
        self.num_ops = 0
        self.num_nodes = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Capture":
        global _ACTIVE
        if _ACTIVE is not None:
            # The outer capture's dispatch mode would also record this one's checksum ops.
            raise DebugError(f"a capture into {_ACTIVE.path} is already active; captures do not nest (use "
                             "modules=[...] or region() to narrow one capture instead)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A stale dump at path would look like this run's if the run fails: remove it (we were asked to write
        # path) and write next to it, renaming only on success.
        for p in (self.path, self.tensors_path):
            if p is not None and (p.is_file() or p.is_symlink()):
                p.unlink()
        self.partial_path = self.path.with_name(self.path.name + ".partial")
        self._file = open(self.partial_path, "w", encoding="utf-8")
        self._token = object()  # tags from other (earlier) captures are ignored
        self._buf: list[dict] = []
        self._pending: list[tuple[list, int, torch.Tensor, int]] = []
        self._saved: dict[str, torch.Tensor] = {}
        self._stack_ids: dict[tuple, int] = {}
        self._frame_kinds: dict[Any, int] = {}
        self._producer: dict[int, str] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._param_names: dict[int, str] = {}
        self._mod_names: dict[int, str] = {}
        self._mod_stack: list[str] = []
        self._regions: list[str] = []
        self._frame = None
        self._sid: int | None = None
        self.num_ops = self.num_nodes = 0
        if self._model is not None:
            self._add_root(self._model)
        with torch.enable_grad():  # the autograd sequence number separates new nodes from older ones
            self._seq0 = (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1
        self._emit({"k": "header", "format": FORMAT, "version": VERSION, "checksum": self.checksum,
                    "stacks": self.stacks, "torch": torch.__version__,
                    "tensors": self.tensors_path.name if self.tensors_path else None,
                    "modules": list(self.modules) if self.modules is not None else None})
        from torch.nn.modules import module as _m

        self._hooks = [_m.register_module_forward_pre_hook(self._pre_hook),
                       _m.register_module_forward_hook(self._post_hook, always_call=True)]
        self._fmode, self._dmode = _FunctionTagger(self), _OpRecorder(self)
        self._fmode.__enter__()
        self._dmode.__enter__()
        _ACTIVE = self
        logger.info("capture started: %s (checksum=%s, stacks=%s)", self.path, self.checksum, self.stacks)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._dmode.__exit__(exc_type, exc, tb)
        self._fmode.__exit__(exc_type, exc, tb)
        global _ACTIVE
        for h in self._hooks:
            h.remove()
        _ACTIVE = None
        ok = False
        try:
            end = {"k": "end", "ops": self.num_ops, "nodes": self.num_nodes}
            if exc_type is not None:
                end["error"] = f"{exc_type.__name__}: {exc}"[:500]
            self._emit(end)
            self._flush()
            self._file.close()
            if exc_type is None:
                if self.tensors_path is not None:
                    from safetensors.torch import save_file

                    tmp = self.tensors_path.with_name(self.tensors_path.name + ".partial")
                    save_file(self._saved, str(tmp))
                    os.replace(tmp, self.tensors_path)
                os.replace(self.partial_path, self.path)  # last: a dump at path means a complete capture
                ok = True
        finally:
            self._file.close()
            self._saved, self._producer, self._refs = {}, {}, {}
            if ok:
                logger.info("capture written: %s (%d ops, %d autograd nodes)", self.path, self.num_ops,
                            self.num_nodes)
            else:
                logger.warning("capture into %s did not complete (%s); the ops recorded so far are in %s",
                               self.path, end.get("error") if exc_type is not None else "writing failed",
                               self.partial_path)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Mark a region: its forward ops, and the backward ops of the autograd nodes created inside it,
        carry ``rg=name``. With ``capture(..., only_regions=True)`` only such ops are recorded (the "region
        guard", like Paddle's ``capture_backward_subgraph_guard``)."""
        self._regions.append(str(name))
        try:
            yield
        finally:
            self._regions.pop()

    # ------------------------------------------------------------------ modules and stacks
    def _add_root(self, root: torch.nn.Module) -> None:
        for name, m in root.named_modules():
            self._mod_names.setdefault(id(m), name)
        for name, p in itertools.chain(root.named_parameters(), root.named_buffers()):
            self._param_names.setdefault(id(p), name)

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = self._mod_names.get(id(module))
        if name is None:
            if self._mod_stack:  # a module outside its parent's tree (built on the fly): parent + class
                name = f"{self._mod_stack[-1]}.{type(module).__name__}".lstrip(".")
            else:
                self._add_root(module)
                name = ""
        self._mod_stack.append(name)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._mod_stack:
            self._mod_stack.pop()

    def _stack_id(self, frame) -> int | None:
        """Id of the Python call stack starting at ``frame``: up to ``stack_depth`` frames innermost first
        (the recorder's own frames dropped), always including the innermost user frame (outside torch,
        transformers, oarlock and the standard library), whose index is stored as ``u``."""
        key = []
        kinds = self._frame_kinds
        depth = self.stack_depth
        user_at = None
        f = frame
        while f is not None:
            code = f.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = _frame_kind(code.co_filename)
            if kind:
                if kind == _USER and user_at is None:
                    user_at = len(key)
                    key.append((code, f.f_lineno))
                elif len(key) < depth:
                    key.append((code, f.f_lineno))
                elif user_at is not None:
                    break
            f = f.f_back
        key = tuple(key)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._stack_ids[key] = len(self._stack_ids)
            self._emit({"k": "stack", "id": sid, "u": user_at,
                        "frames": [[c.co_filename, line, c.co_name] for c, line in key]})
        return sid

    def _current_sid(self) -> int | None:
        if not self.stacks:
            return None
        if self._frame is None:  # an op outside any torch-level call (e.g. torch.ops.aten.* directly)
            return self._stack_id(sys._getframe(1))
        if self._sid is None:
            self._sid = self._stack_id(self._frame)
        return self._sid

    # ------------------------------------------------------------------ autograd nodes
    def _tag_nodes(self, root) -> None:
        """Tag ``root`` and the untagged nodes reachable from it that were created during the capture."""
        token = self._token
        new = []
        todo = [root]
        while todo:
            node = todo.pop()
            md = node.metadata
            tag = md.get(_KEY)
            if tag is not None and tag[0] is token:
                continue
            nid = self.num_nodes
            self.num_nodes += 1
            name = node.name()
            if name == _ACC:
                var = node.variable
                pname = self._param_names.get(id(var))
                mod = pname.rpartition(".")[0] if pname is not None else None  # the parameter's module
                md[_KEY] = (token, nid, None, mod, None)
                new.append((node, {"k": "node", "id": nid, "name": "AccumulateGrad", "mod": mod,
                                   "param": pname, "grads": [_meta(var)]}))
            elif node._sequence_nr() < self._seq0:  # made before the capture: a boundary node
                md[_KEY] = (token, nid, None, None, None)
                new.append((node, {"k": "node", "id": nid, "name": name, "ext": True}))
            else:
                sid = self._current_sid()
                mod = self._mod_stack[-1] if self._mod_stack else None
                rg = self._regions[-1] if self._regions else None
                md[_KEY] = (token, nid, sid, mod, rg)
                rec = {"k": "node", "id": nid, "name": name, "mod": mod, "st": sid,
                       "grads": [[list(m.shape), _dtype_str(m.dtype)] for m in node._input_metadata]}
                if rg is not None:
                    rec["rg"] = rg
                new.append((node, rec))
                todo.extend(fn for fn, _ in node.next_functions if fn is not None)
        for node, rec in new:
            if not rec.get("ext") and rec["name"] != "AccumulateGrad":
                rec["next"] = [None if fn is None else [fn.metadata[_KEY][1], k]
                               for fn, k in node.next_functions]
            if self._keep_node(rec):
                self._emit(rec)

    def _keep(self, mod: str | None, rg: str | None) -> bool:
        if self.only_regions and rg is None:
            return False
        if self.modules is not None:
            if mod is None:
                return False
            return any(mod == p or mod.startswith(p + ".") for p in self.modules)
        return True

    def _keep_node(self, rec: dict) -> bool:
        if rec.get("ext"):
            return self.modules is None and not self.only_regions
        return self._keep(rec.get("mod"), rec.get("rg"))

    # ------------------------------------------------------------------ ops
    def _record_op(self, func, args, kwargs, out) -> None:
        node = torch._C._current_autograd_node()
        if node is None:
            mod = self._mod_stack[-1] if self._mod_stack else None
            rg = self._regions[-1] if self._regions else None
            rec = {"k": "op", "i": 0, "op": _op_str(func), "ph": "f", "mod": mod}
        else:
            tag = node.metadata.get(_KEY)
            if tag is not None and tag[0] is self._token:
                _, nid, fst, mod, rg = tag
            else:  # a node this capture never saw created (graph built before the capture)
                nid = fst = mod = rg = None
            rec = {"k": "op", "i": 0, "op": _op_str(func), "ph": "b", "mod": mod, "node": nid, "nname": node.name()}
            if fst is not None:
                rec["fst"] = fst
        if not self._keep(mod, rg):
            return
        i = rec["i"] = self.num_ops
        self.num_ops += 1
        ins = _tensors_in(args, kwargs)
        rec["in"] = [[list(t.shape), _dtype_str(t.dtype)] for t in ins]
        prod, pnames = self._producer, self._param_names
        rec["src"] = [prod.get(id(t)) or (("p:" + pnames[id(t)]) if id(t) in pnames else None) for t in ins]
        outs = _outputs(out)
        rec["out"] = [_meta(t) for t in outs]
        if self.stacks:
            rec["st"] = self._current_sid()
        if rg is not None:
            rec["rg"] = rg
        if self._hash is not None:
            hs = rec["h"] = [None] * len(outs)
        saved = None
        # a view of an op output of this capture is not hashed again (see docs); a view of a parameter or of an
        # outside input is: those bytes were never hashed
        view = _is_view(func) and bool(rec["src"]) and isinstance(rec["src"][0], str) \
            and rec["src"][0].startswith("o")
        for j, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            key = f"o{i}.{j}"
            tid = id(t)
            if tid not in self._refs:
                self._refs[tid] = weakref.ref(t, self._forget(tid))
            prod[tid] = key
            if self._hash is not None and view:
                # its bytes are its base's, hashed where the base was produced: record which bytes it sees
                # (a difference there is still found at this op) and skip re-reading (often copying) them
                hs[j] = f"view:{t.storage_offset()}:{','.join(map(str, t.stride()))}"
            elif self._hash is not None and _ck.hashable(t):
                h = self._hash(t)
                if isinstance(h, str):
                    hs[j] = h
                else:
                    self._pending.append((hs, j, h[0], h[1]))
            if (self.save_tensors and t.numel() <= self.save_tensors and t.dtype in _SAFETENSORS_DTYPES
                    and _ck.hashable(t)):
                self._saved[key] = t.detach().to("cpu", copy=True).contiguous()
                saved = saved or [None] * len(outs)
                saved[j] = key
        if saved is not None:
            rec["sv"] = saved
        self._emit(rec)

    def _forget(self, tid: int):
        def cb(_ref, producer=self._producer, refs=self._refs):
            producer.pop(tid, None)
            refs.pop(tid, None)
        return cb

    # ------------------------------------------------------------------ output
    def _emit(self, rec: dict) -> None:
        self._buf.append(rec)
        if len(self._buf) >= _FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            by_dev: dict[torch.device, list] = {}
            for item in self._pending:
                by_dev.setdefault(item[2].device, []).append(item)
            for items in by_dev.values():  # one device-to-host read per device and batch
                values = torch.stack([item[2] for item in items]).tolist()
                for (hs, j, _, n), v in zip(items, values):
                    hs[j] = _ck.format_hash(v, n)
            self._pending = []
        dumps = json.dumps
        self._file.write("".join(dumps(r, separators=(",", ":")) + "\n" for r in self._buf))
        self._buf = []


def capture(path: str | os.PathLike, checksum: str | None = "fast", stacks: bool = True, *,
            save_tensors: int = 0, modules: Sequence[str] | None = None, only_regions: bool = False,
            model: torch.nn.Module | None = None, stack_depth: int = 64) -> Capture:
    """Record every aten op run inside the ``with`` block, forward and backward, into a JSONL dump.

    Usage::

        with oarlock.debug.capture("run_a.jsonl", checksum="fast") as rec:
            loss = model(x).sum()
            loss.backward()

    Args:
        path: the JSONL dump to write (format in this module's docstring).
        checksum: output checksum per op: ``"fast"`` (device-side 64-bit fingerprint, the default), ``"md5"``
            (MD5 of raw bytes; host copy), ``"rounded:N"`` (fingerprint of values rounded to N decimals) or
            ``None`` (no checksums). See :mod:`oarlock.debug.checksum`.
        stacks: record the user's Python call stack of each forward op, and for backward ops the forward stack
            of the autograd node that produced them.
        save_tensors: also save every output with at most this many elements (copied to CPU) into
            ``<path>.safetensors``, so :func:`oarlock.debug.diff` can report max abs/rel differences.
        modules: record only ops whose module path (for backward ops: the producer's forward module) equals or
            lies under one of these prefixes, e.g. ``["layers.1"]``.
        only_regions: record only ops inside :meth:`Capture.region` blocks (and their backward ops).
        model: the root module used for module paths and parameter names; by default the first module called
            at top level becomes the root (its own path is ``""``).
        stack_depth: at most this many frames per stack (innermost first); the innermost frame of the
            user's own code (outside torch, transformers, oarlock, the standard library and installed
            packages) is always kept, even deeper.

    Raises:
        DebugError: a bad checksum spec, ``save_tensors``, ``modules`` or ``stack_depth``; on entering, when
            another capture is active (captures do not nest).

    Notes: the module paths come from global ``nn.Module`` forward hooks, so modules called from other threads
    during the capture are attributed too; ops run by ``torch.compile``-d code are not supported.
    """
    return Capture(path, checksum, stacks, save_tensors=save_tensors, modules=modules, only_regions=only_regions,
                   model=model, stack_depth=stack_depth)
