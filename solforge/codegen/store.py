"""Regions by key: a RegionIR written once as JSON, content-addressed by its key, and read back on demand.

The custom op `solforge::generated` and the "generated" kernel family carry only a region's key
(ir.RegionIR.key, the sha256 of its canonical text). Whoever needs the region itself (a tuning
worker process, a later run warm from the kernel database, a graph that calls the op) gets it from
here: first this process's registry, then <codegen cache dir>/ir_<key>.json (runtime.cache_dir(),
next to the generated sources). A file is accepted only if the IR it decodes to has that very key,
so a damaged or foreign file is never used.

JSON, not pickle: nothing in the cache directory is executed. Values are tagged where JSON has no
type of their own (refs, tuples, dtypes, memory formats, layouts, devices); floats keep their exact
repr (json writes and reads them exactly, inf and nan included).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from solforge.codegen.ir import IR_VERSION, Op, Ref, RegionIR, TensorMeta
from solforge.codegen.lower import Lowered, prepare
from solforge.codegen.runtime import cache_dir

_IRS: dict[str, RegionIR] = {}
_LOWERED: dict[str, Lowered] = {}


def _enc(v: Any) -> Any:
    if isinstance(v, Ref):
        return {"ref": [v.src, v.i, v.item]}
    if isinstance(v, (tuple, list)):
        return {"tuple": [_enc(x) for x in v]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"solforge codegen store: cannot write a {type(v).__name__} argument")


def _dec(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag == "ref":
        return Ref(x[0], x[1], x[2])
    if tag == "tuple":
        return tuple(_dec(e) for e in x)
    if tag in ("dtype", "memory_format", "layout"):
        got = getattr(torch, x)
        if not isinstance(got, (torch.dtype, torch.memory_format, torch.layout)):
            raise ValueError(f"not a torch {tag}: {x}")
        return got
    if tag == "device":
        return torch.device(x)
    raise ValueError(f"unknown tag {tag}")


def _meta(m: TensorMeta) -> list[Any]:
    return [list(m.shape), list(m.stride), str(m.dtype).removeprefix("torch.")]


def _unmeta(x: list[Any]) -> TensorMeta:
    dtype = getattr(torch, x[2])
    assert isinstance(dtype, torch.dtype)
    return TensorMeta(tuple(x[0]), tuple(x[1]), dtype)


def to_json(ir: RegionIR) -> str:
    return json.dumps({
        "version": IR_VERSION, "device": ir.device, "inputs": [_meta(m) for m in ir.inputs],
        "ops": [{"target": op.target, "args": _enc(op.args), "kwargs": [[k, _enc(v)] for k, v in op.kwargs],
                 "out": [_meta(m) for m in op.out]} for op in ir.ops],
        "outputs": [_enc(r) for r in ir.outputs]})


def from_json(text: str) -> RegionIR:
    d = json.loads(text)
    if d.get("version") != IR_VERSION:
        raise ValueError(f"IR version {d.get('version')}, this generator writes {IR_VERSION}")
    ops = tuple(Op(o["target"], _dec(o["args"]), tuple((k, _dec(v)) for k, v in o["kwargs"]),
                   tuple(_unmeta(m) for m in o["out"])) for o in d["ops"])
    return RegionIR(tuple(_unmeta(m) for m in d["inputs"]), ops, tuple(_dec(r) for r in d["outputs"]), d["device"])


def path_of(key: str) -> Path:
    return cache_dir() / f"ir_{key}.json"


def _holds(path: Path, key: str) -> bool:
    try:
        return from_json(path.read_text()).key == key
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError):
        return False


def save(ir: RegionIR) -> str:
    """Keep `ir` in this process and on disk (written once, atomically); returns its key."""
    key = ir.key
    _IRS[key] = ir
    path = path_of(key)
    if not _holds(path, key):  # absent, or damaged / foreign: (re)written
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(to_json(ir))
        os.replace(tmp, path)
    return key


def load(key: str) -> RegionIR:
    """The region of `key`; a ValueError (one line) when no valid copy of it can be found."""
    ir = _IRS.get(key)
    if ir is not None:
        return ir
    path = path_of(key)
    try:
        ir = from_json(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"solforge generated: no region {key[:16]}... in this process or {path.parent}") from None
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise ValueError(f"solforge generated: {path} is unreadable ({type(e).__name__}: {e})") from None
    if ir.key != key:
        raise ValueError(f"solforge generated: {path} holds another region (key {ir.key[:16]}...)")
    _IRS[key] = ir
    return ir


def lowered(key: str) -> Lowered:
    """The region of `key`, lowered and analyzed (once per process)."""
    low = _LOWERED.get(key)
    if low is None:
        low = _LOWERED[key] = prepare(load(key))
    return low
