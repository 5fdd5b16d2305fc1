"""A disk cache of ATen lowerings, so a warm run does not trace each dynamo graph through make_fx again.

The ATen graph that `lower_to_aten` makes is a function of the dynamo graph (its nodes, targets,
constant arguments and the module paths / stack traces it carries), the inputs' metadata (type,
shape, stride, offset, dtype, device, requires_grad, aliasing), the global state that decides
decompositions (grad and inference mode, autocast, default dtype, SDPA backends, the GPU model),
and the versions of torch, Python and this lowering code. The key hashes all of these; anything
it cannot describe exactly (a call of user code, a tensor constant held by the graph, a Python
object as an argument, a pytree codegen) makes the graph uncacheable and it is lowered as always.

An entry is a header line (format, key, sha256 of the rest) and JSON (no pickle: nothing in the
cache directory is executed). The checksum is verified before anything is decoded: an entry edited
or damaged on disk (a changed eps decodes fine and would compute something else) is dropped with a
warning and the graph lowered again. The JSON holds for every node its op,
name, target, arguments and the metadata the planner and the rewrite use: `val` (rebuilt as a
fake tensor of the same shape, stride, offset, dtype, device and requires_grad),
`nn_module_stack` (module paths and classes) and `stack_trace`. make_fx's other bookkeeping
(`tensor_meta`, `seq_nr`, `source_fn_stack`, `from_node`, `original_aten`) is not kept: nothing
downstream reads it. A missing, stale, unreadable or corrupted entry is a miss: the caller lowers
the graph and writes the entry again.

On a Qwen3-4B dynamo graph (3194 nodes -> 2051 ATen nodes) make_fx took 1.6-2.0 s of a 6-7 s
capture on the 2-core CPU dev box (torch 2.13); reading the entry back (1.4 MB) took 0.2-0.35 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import operator
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module

FORMAT = 3  # 2: the lowering moved to capture/lower.py; 3: a checksummed header line before the JSON
# the code whose behaviour an entry depends on: the lowering and this file
_SOURCES = ("lower.py", "cache.py")  # the lowering and this file: what changes an entry
_ATEN_NAMESPACES = ("aten", "prims")
# Python callables a dynamo graph may call whose lowering depends only on torch's version
_TORCH_MODULES = ("torch", "_operator", "operator", "math", "builtins")


class Uncacheable(Exception):
    """The graph holds something the key or the entry cannot describe exactly."""


def _source_hash() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


_SOURCE_HASH: str | None = None


def _versions() -> tuple[Any, ...]:
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        _SOURCE_HASH = _source_hash()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (FORMAT, _SOURCE_HASH, torch.__version__, torch.version.cuda, cudnn, sys.version_info[:2])


def _global_state(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The process state that changes what make_fx records for the same graph and inputs."""
    state: list[Any] = [
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(), str(torch.get_default_dtype()),
        torch.are_deterministic_algorithms_enabled(),
        # autocast outside the compiled region inserts casts while tracing
        [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")],
    ]
    cuda = sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
    if cuda:
        # which fused SDPA kernel the op lowers to depends on the GPU and the enabled backends
        b = torch.backends.cuda
        state.append([(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in cuda])
        state.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
                      b.cudnn_sdp_enabled(), torch.backends.cudnn.enabled))
        if hasattr(torch._C, "_get_sdp_priority_order"):
            state.append(tuple(int(x) for x in torch._C._get_sdp_priority_order()))
    return tuple(state)


def _input_signature(inputs: Sequence[Any]) -> list[Any]:
    sig: list[Any] = []
    storages: dict[int, int] = {}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            kind = type(x)
            if kind not in (torch.Tensor, torch.nn.Parameter, FakeTensor) or x.layout != torch.strided:
                raise Uncacheable(f"input {i} is a {kind.__name__} ({x.layout})")
            # aliasing between inputs changes the graph (views, in-place ops): name each storage
            # by the first input that uses it
            alias = storages.setdefault(x.untyped_storage()._cdata, i)
            sig.append(("T", kind is torch.nn.Parameter, tuple(x.shape), tuple(x.stride()), x.storage_offset(),
                        str(x.dtype), str(x.device), x.requires_grad, alias))
        elif isinstance(x, bool | int | float) or x is None:
            sig.append(("C", type(x).__name__, repr(x)))
        else:
            raise Uncacheable(f"input {i} is a {type(x).__name__}")
    return sig


def _target_key(node: fx.Node) -> str:
    t = node.target
    if node.op in ("placeholder", "output", "call_method"):
        return str(t)
    if node.op != "call_function":
        raise Uncacheable(f"{node.op} node {node.name}")
    if isinstance(t, torch._ops.HigherOrderOperator):  # its body is user code (a subgraph)
        raise Uncacheable(f"higher-order op {t.name()}")
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        ns = t.namespace if isinstance(t, torch._ops.OpOverload) else t._qualified_op_name.partition("::")[0]
        if ns not in _ATEN_NAMESPACES:  # a user's op may decompose through Python code
            raise Uncacheable(f"op {t} outside {_ATEN_NAMESPACES}")
        return f"op:{t}"
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if not name or "<" in name or module.split(".")[0] not in _TORCH_MODULES:
        raise Uncacheable(f"call of {module}.{name}")
    return f"fn:{module}.{name}"


def _stack_key(node: fx.Node) -> Any:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    # the dict's keys are ids of module objects, different in every process: not part of the key
    return tuple((path, _class_name(cls)) for path, cls in stack.values())


def _class_name(cls: Any) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}:{cls.__qualname__}"


def graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The cache key of lowering `gm` on `example_inputs` now; raises Uncacheable."""
    h = hashlib.sha256()

    def put(obj: Any) -> None:
        h.update(repr(obj).encode())
        h.update(b"\x00")

    put(_versions())
    put(_global_state(example_inputs))
    put(_input_signature(example_inputs))
    for node in gm.graph.nodes:
        put((node.op, node.name, _target_key(node), _encode(node.args), _encode(node.kwargs),
             _stack_key(node), node.meta.get("stack_trace")))
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# values <-> JSON. A plain JSON value (int, float, bool, None, str) stands for itself; everything
# else is a one-key object naming its kind.

_ENUMS: dict[str, tuple[type, Any]] = {
    "dtype": (torch.dtype, lambda s: getattr(torch, s)),
    "layout": (torch.layout, lambda s: getattr(torch, s)),
    "memory_format": (torch.memory_format, lambda s: getattr(torch, s)),
}


def _encode(a: Any) -> Any:
    if a is None or isinstance(a, bool | int | str):
        return a
    if isinstance(a, float):
        # strict JSON has no inf/nan: spell them out (every other float round-trips exactly)
        return a if a == a and a not in (float("inf"), float("-inf")) else {"float": repr(a)}
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, torch.Size):
        return {"size": [_encode(x) for x in a]}
    if isinstance(a, tuple):
        return {"tuple": [_encode(x) for x in a]}
    if isinstance(a, list):
        return {"list": [_encode(x) for x in a]}
    if isinstance(a, dict):
        if not all(isinstance(k, str) for k in a):
            raise Uncacheable("a dict argument with non-string keys")
        return {"dict": [[k, _encode(v)] for k, v in a.items()]}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, slice):
        return {"slice": [_encode(a.start), _encode(a.stop), _encode(a.step)]}
    if a is Ellipsis:
        return {"ellipsis": None}
    for kind, (cls, _) in _ENUMS.items():
        if isinstance(a, cls):
            return {kind: str(a).removeprefix("torch.")}
    raise Uncacheable(f"an argument of type {type(a).__name__}")


def _decode(a: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(a, dict):
        return a
    ((kind, v),) = a.items()
    if kind == "node":
        return nodes[v]
    if kind == "tuple":
        return tuple(_decode(x, nodes) for x in v)
    if kind == "list":
        return [_decode(x, nodes) for x in v]
    if kind == "size":
        return torch.Size(_decode(x, nodes) for x in v)
    if kind == "dict":
        return {k: _decode(x, nodes) for k, x in v}
    if kind == "float":
        return float(v)
    if kind == "device":
        return torch.device(v)
    if kind == "slice":
        return slice(*(_decode(x, nodes) for x in v))
    if kind == "ellipsis":
        return Ellipsis
    if kind in _ENUMS:
        out = _ENUMS[kind][1](v)
        if not isinstance(out, _ENUMS[kind][0]):
            raise ValueError(f"{v!r} is not a torch {kind}")
        return out
    raise ValueError(f"unknown value kind {kind!r}")


def _encode_val(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if not isinstance(v, FakeTensor) or v.layout != torch.strided:
            raise Uncacheable(f"a node value of type {type(v).__name__}")
        return {"tensor": [list(v.shape), list(v.stride()), v.storage_offset(), str(v.dtype).removeprefix("torch."),
                           str(v.device), v.requires_grad]}
    if isinstance(v, tuple | list):
        return {"tuple" if isinstance(v, tuple) else "list": [_encode_val(x) for x in v]}
    if v is None or isinstance(v, bool | int | float):
        return _encode(v)
    raise Uncacheable(f"a node value of type {type(v).__name__}")


def _decode_val(v: Any, fake_mode: FakeTensorMode) -> Any:
    if not isinstance(v, dict):
        return v
    ((kind, x),) = v.items()
    if kind == "tensor":
        shape, stride, offset, dtype, device, requires_grad = x
        dt = getattr(torch, dtype)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"{dtype!r} is not a dtype")
        meta = torch.empty_strided(shape, stride, dtype=dt, device="meta")
        if offset:
            meta = meta.as_strided(shape, stride, offset)
        if requires_grad:
            meta.requires_grad_(True)
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, torch.device(device))
    if kind in ("tuple", "list"):
        items = [_decode_val(i, fake_mode) for i in x]
        return tuple(items) if kind == "tuple" else items
    return _decode(v, {})


def _resolve_op(name: str) -> Any:
    """'aten::add.Tensor' -> torch.ops.aten.add.Tensor; 'operator.getitem' -> operator.getitem."""
    if name.startswith("py:"):
        module, _, attr = name[3:].rpartition(".")
        if module not in ("operator", "_operator"):
            raise ValueError(f"unexpected Python target {name!r}")
        return getattr(operator, attr)
    ns, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


def _encode_target(node: fx.Node) -> str:
    t = node.target
    if node.op in ("placeholder", "output"):
        return str(t)
    if node.op != "call_function":
        raise Uncacheable(f"{node.op} node {node.name} in the ATen graph")
    if isinstance(t, torch._ops.OpOverload):
        return t.name() if "." in t.name().partition("::")[2] else f"{t.name()}.default"
    if t is operator.getitem:
        return "py:operator.getitem"
    raise Uncacheable(f"ATen graph target {t}")


_CLASSES: dict[str, Any] = {}


def _resolve_class(name: str) -> Any:
    cls = _CLASSES.get(name)
    if cls is None:
        module, _, qualname = name.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        cls = _CLASSES[name] = obj
    return cls


def encode_graph(aten: fx.GraphModule) -> dict[str, Any]:
    """The JSON form of a lowered graph; raises Uncacheable."""
    if type(aten.graph._codegen) is not fx.graph.CodeGen:
        raise Uncacheable(f"graph codegen {type(aten.graph._codegen).__name__}")
    stacks: dict[Any, int] = {}
    traces: dict[str, int] = {}
    nodes = []
    for node in aten.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        stack_id = None
        if stack is not None:
            items = tuple((k, path, _class_name(cls)) for k, (path, cls) in stack.items())
            for _, _, cls_name in items:
                if "<" in cls_name:  # a class defined inside a function cannot be imported back
                    raise Uncacheable(f"module class {cls_name}")
            stack_id = stacks.setdefault(items, len(stacks))
        trace = node.meta.get("stack_trace")
        nodes.append({
            "op": node.op, "name": node.name, "target": _encode_target(node),
            "args": _encode(node.args), "kwargs": _encode(node.kwargs),
            "val": _encode_val(node.meta["val"]) if "val" in node.meta else "absent",
            "stack": stack_id, "trace": traces.setdefault(trace, len(traces)) if trace is not None else None,
        })
    return {"format": FORMAT, "nodes": nodes, "stacks": [list(map(list, s)) for s in stacks],
            "traces": list(traces)}


def decode_graph(data: dict[str, Any], fake_mode: FakeTensorMode) -> fx.GraphModule:
    """The GraphModule an entry describes; raises on anything malformed."""
    if data.get("format") != FORMAT:
        raise ValueError(f"entry format {data.get('format')!r}, expected {FORMAT}")
    stacks = [{k: (path, _resolve_class(cls)) for k, path, cls in s} for s in data["stacks"]]
    traces = data["traces"]
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for rec in data["nodes"]:
        op = rec["op"]
        target = rec["target"] if op in ("placeholder", "output") else _resolve_op(rec["target"])
        node = graph.create_node(op, target, _decode(rec["args"], env), _decode(rec["kwargs"], env), name=rec["name"])
        if node.name != rec["name"]:
            raise ValueError(f"node {rec['name']!r} came back as {node.name!r}")
        if rec["val"] != "absent":
            node.meta["val"] = _decode_val(rec["val"], fake_mode)
        if rec["stack"] is not None:
            node.meta["nn_module_stack"] = dict(stacks[rec["stack"]])
        if rec["trace"] is not None:
            node.meta["stack_trace"] = traces[rec["trace"]]
        env[node.name] = node
    graph.lint()
    # the class make_fx gives (a lazy GraphModule: its code is generated on first use, and the
    # passes after capture change the graph and generate it again anyway)
    return _make_graph_module(torch.nn.Module(), graph)


class ChecksumMismatch(ValueError):
    """An entry's contents are not what was written."""


def pack(key: str, data: dict[str, Any]) -> bytes:
    """An entry's bytes: a header line (format, key, sha256 of the payload), then the payload."""
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    header = {"format": FORMAT, "key": key, "sha256": hashlib.sha256(payload).hexdigest()}
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload


def unpack(raw: bytes, key: str) -> dict[str, Any]:
    """The payload of an entry of `key`, checked against its header; raises ChecksumMismatch or
    ValueError."""
    head, sep, payload = raw.partition(b"\n")
    header = json.loads(head.decode()) if sep else None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"not an entry of format {FORMAT}")
    if header.get("key") != key:
        raise ValueError("the entry belongs to another key")
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise ChecksumMismatch("does not match its checksum (edited or damaged)")
    data = json.loads(payload.decode())
    if not isinstance(data, dict):
        raise ValueError("the payload is not an object")
    return data


@dataclass
class LoweringCache:
    """Entries under `directory` (one JSON file per key). Counts what happened, for the report."""

    directory: Path
    hits: int = 0
    misses: int = 0
    stored: int = 0
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).expanduser()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key[:40]}.json"

    def key(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
        try:
            return graph_key(gm, example_inputs)
        except Uncacheable as e:
            self.problems.append(f"not cacheable: {e}")
        except Exception as e:  # a key we cannot compute is a miss, never a failed capture
            self.problems.append(f"cache key failed: {type(e).__name__}: {e}")
        return None

    def load(self, key: str, fake_mode: FakeTensorMode) -> fx.GraphModule | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as e:
            self.misses += 1
            self.problems.append(f"cannot read {path}: {e}")
            return None
        try:
            data = unpack(raw, key)
            gm = decode_graph(data, fake_mode)
        except ChecksumMismatch as e:  # edited or damaged on disk: never used, said at once
            self.misses += 1
            self.problems.append(f"ignored a broken entry {path.name}: {e}")
            print(f"solforge: warning: lowering cache entry {path} {e}: lowered again", file=sys.stderr, flush=True)
            return None
        except Exception as e:  # corrupted or from an incompatible writer: lower again, overwrite
            self.misses += 1
            self.problems.append(f"ignored a broken entry {path.name}: {type(e).__name__}: {e}")
            return None
        self.hits += 1
        with contextlib.suppress(OSError):  # last use, for `solforge db prune --lowered --older-than`
            os.utime(path)
        return gm

    def prune(self, *, older_than_days: float | None = None, dry_run: bool = False,
              now: float | None = None) -> list[tuple[Path, int]]:
        """Remove the entries not read or written for more than `older_than_days` days (every
        entry without it), leftover temporary files of killed writers included. A removed entry
        only costs its graph's lowering again. -> (path, bytes) of each file removed (or that
        would be, with dry_run)."""
        if older_than_days is not None and older_than_days < 0:
            raise ValueError("older_than_days must be at least 0")
        if not self.directory.is_dir():
            return []
        cutoff = None if older_than_days is None else (time.time() if now is None else now) - older_than_days * 86400
        doomed = []
        for path in sorted(self.directory.glob("*.json")):  # pathlib's * matches the .tmp- files too
            try:
                st = path.stat()
            except OSError:  # removed by another process meanwhile
                continue
            if cutoff is None or st.st_mtime < cutoff:
                doomed.append((path, st.st_size))
        if not dry_run:
            for path, _ in doomed:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return doomed

    def save(self, key: str, aten: fx.GraphModule) -> None:
        try:
            data = encode_graph(aten)
        except Uncacheable as e:
            self.problems.append(f"not cacheable: {e}")
            return
        except Exception as e:  # never let the cache fail a capture that worked
            self.problems.append(f"cannot encode the graph: {type(e).__name__}: {e}")
            return
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # write then rename: a reader never sees half an entry, concurrent writers do not mix
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "wb") as f:
                f.write(pack(key, data))
            os.replace(tmp, self._path(key))
            self.stored += 1
        except Exception as e:
            self.problems.append(f"cannot write the lowering cache in {self.directory}: {type(e).__name__}: {e}")
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
