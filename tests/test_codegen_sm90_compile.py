"""Generated kernels compile for an H100 (sm_90) without a GPU: the CPU tests run them in Triton's
interpreter, which is Python and accepts what Triton's compiler may refuse (types a loop carries,
constexpr misuse, layouts); here each sampled schedule of regions of every kind goes through
Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, its bundled ptxas) for
GPUTarget("cuda", 90, 32). Skipped where Triton's NVIDIA backend cannot compile here."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import trace

from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen.lower import Lowered
from solforge.codegen.triton_gen import KERNEL, generate, needs_index64, passes

triton = pytest.importorskip("triton")

_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
       torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
       torch.bool: "i1"}


# Run in a process of its own, with TRITON_INTERPRET=0 and no solforge import: in this one Triton was
# imported for the interpreter, and its own @jit helpers (tl.sum's combine) are interpreted functions
_COMPILE = r"""
import importlib.util, json, sys, traceback
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for k, item in enumerate(json.loads(Path(sys.argv[1]).read_text())):
    path = Path(sys.argv[1]).parent / f"k{k}.py"
    path.write_text(item["src"])
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ptx = []
        for consts in item["constexprs"]:
            ck = triton.compile(ASTSource(fn=mod.generated_kernel, signature=item["sig"],
                                          constexprs={tuple(c[0]): c[1] for c in consts},
                                          attrs={tuple(a[0]): a[1] for a in item.get("attrs", [])}),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": item.get("num_warps", 4)})
            ptx.append(ck.asm["ptx"])
        out.append({"ptx": ptx} if item.get("ptx") else None)
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}"[:3000])
print(json.dumps(out))
"""


def _item(low: Lowered, sched: SC.Schedule) -> dict[str, Any]:
    """The kernel source, its signature for triton.compile and the constexprs of each launch (a
    split's phases)."""
    src = generate(low, sched)
    ir = low.ir
    ptrs = [m.dtype for m in ir.inputs] + [ir.out_meta(r).dtype for r in ir.outputs]
    index = "i64" if needs_index64(low) else "i32"
    head = next(line for line in src.splitlines() if line.startswith(f"def {KERNEL}("))
    names = [a.split(":")[0].strip() for a in head[len(f"def {KERNEL}("):-2].split(",")]
    sig: dict[str, str] = {}
    for name in names:
        if name == "PHASE":
            sig[name] = "constexpr"
        elif name == "ws":
            sig[name] = "*fp32"
        elif name.startswith(("in", "out")) and name[2 if name.startswith("in") else 3:].isdigit():
            k = int(name[2:]) if name.startswith("in") else len(ir.inputs) + int(name[3:])
            sig[name] = "*" + _TT[ptrs[k]]
        else:
            sig[name] = index
    at = names.index("PHASE") if "PHASE" in names else -1  # triton.compile keys a constexpr by its position
    phases = [[[[at], p]] for p in range(1, len(passes(low, sched)) + 2)] if sched.splits > 1 else [[]]
    return {"src": src, "sig": sig, "constexprs": phases}


def sm90_compile(items: list[dict[str, Any]]) -> list[Any]:
    """Each item compiled for sm_90 in one process; per item None or the compiler's error (with
    `"ptx": True` in the item, {"ptx": [each launch's PTX]} where it compiled)."""
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "items.json"
        spec.write_text(json.dumps(items))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TRITON_INTERPRET": "0"}
        proc = subprocess.run([sys.executable, "-c", _COMPILE, str(spec)], capture_output=True, text=True,
                              env=env, timeout=600, check=False)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def backend() -> None:
    """Triton's NVIDIA backend compiles here (its LLVM and ptxas), or the test has nothing to say."""
    src = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef generated_kernel(x):\n"
           "    tl.store(x + tl.arange(0, 16), tl.sum(tl.arange(0, 16).to(tl.float32), axis=0))\n")
    try:
        (err,) = sm90_compile([{"src": src, "sig": {"x": "*fp32"}, "constexprs": [[]]}])
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        pytest.skip(f"Triton cannot compile for sm_90 here: {err[:300]}")


def _as_launched(low: Lowered, sched: SC.Schedule, tensors: list[torch.Tensor], aligns: Any) -> dict[str, Any]:
    """The item of `_item` for a launch on `tensors` as Triton's launcher specializes it: pointers
    16-byte aligned, an integer argument equal to 1 a constant, one divisible by 16 marked so; the
    kernel generated with the stride hints `aligns` (None: none)."""
    from solforge.codegen.triton_gen import _arg_names

    item = _item(low, sched)
    item["src"] = generate(low, sched, None, aligns)
    names = _arg_names(low, sched)
    values = [st for t in tensors for n, st in zip(t.shape, t.stride(), strict=True) if n != 1]
    consts, attrs = [], []
    strides = iter(values)
    for i, name in enumerate(names):
        if name.startswith(("in", "out", "ws")) and not name.startswith("s_"):
            attrs.append([[i], [["tt.divisibility", 16]]])
        elif name.startswith("s_"):
            v = next(strides)
            if v == 1:
                item["sig"][name] = "constexpr"
                consts.append([[i], 1])
            elif v % 16 == 0:
                attrs.append([[i], [["tt.divisibility", 16]]])
    item["constexprs"] = [c + consts for c in item["constexprs"]]
    return {**item, "attrs": attrs, "num_warps": sched.num_warps, "ptx": True}


def test_stride_hints_make_the_transposing_tiles_stores_16_bytes_wide(backend: None) -> None:
    """An NCHW output of H*W = 4 x 5 (20: 4 mod 16, which Triton's launcher does not mark) stored
    along H*W by a transposing tile: scalar stores without the hint, 16-byte ones with it (the
    loads along C are 16 bytes wide either way)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(x) * 3.0).contiguous()

    x = _r(2, 64, 4, 5).contiguous(memory_format=torch.channels_last)
    (fr,) = RG.form_regions(trace(f, x).graph)
    low = fr.lowered
    sched = SC.Schedule("tiles", 64, 1, 4, 1, 32)  # 64 channels x 32 of H*W (20 of them)
    assert SC.is_valid(sched, low)
    tensors = [x, RT.empty_outputs(low, "cpu")[0]]
    hinted = RT.stride_aligns(tensors)
    got = sm90_compile([_as_launched(low, sched, tensors, None), _as_launched(low, sched, tensors, hinted)])
    plain, hint = ([re.findall(r"st\.global\S*", p) for p in g["ptx"]][0] for g in got)
    assert plain and not any(".v4" in st for st in plain), plain
    assert hint and all(".v4" in st for st in hint), hint


def test_stride_hints_make_a_rows_loads_16_bytes_wide(backend: None) -> None:
    """Rows of 4100 values (4 mod 16) in 1024-wide chunks: each row's start is a multiple of 4
    values, which the kernel is told: scalar loads and stores without the hint, 16-byte ones with it."""
    x = _r(6, 4100)
    (fr,) = RG.form_regions(trace(lambda x: x - x.mean(-1, keepdim=True), x).graph)
    low = fr.lowered
    sched = SC.Schedule("looped", 1024, 1, 4, 1)
    assert SC.is_valid(sched, low)
    tensors = [x, RT.empty_outputs(low, "cpu")[0]]
    got = sm90_compile([_as_launched(low, sched, tensors, a) for a in (None, RT.stride_aligns(tensors))])
    for g, vector in zip(got, (False, True), strict=True):
        ptx = g["ptx"][0]
        ops = re.findall(r"(?:ld|st)\.global\S*", ptx)
        assert ops and all((".v4" in op) == vector for op in ops), ops


def _ln(x: torch.Tensor) -> torch.Tensor:
    v, m = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - m) * torch.rsqrt(v + 1e-5)


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


CASES: dict[str, tuple[Callable[..., Any], Callable[[], list[torch.Tensor]]]] = {
    # rows the chunks do not tile (peeled), one-pass statistics, splits
    "layernorm_300": (_ln, lambda: [_r(5, 300)]),
    "layernorm_bf16_4096": (lambda x: _ln(x.float()).to(torch.bfloat16), lambda: [_r(6, 4096, dtype=torch.bfloat16)]),
    "softmax_333": (lambda x: torch.softmax(x, -1) * 2, lambda: [_r(7, 333)]),
    "log_softmax_long": (lambda x: F.log_softmax(x, -1), lambda: [_r(3, 70000)]),
    # tiles: statistics of a channels-last tensor, a sum over dim 0
    "batchnorm_nhwc": (lambda x: x - x.mean((0, 2, 3), keepdim=True), lambda: [_r(4, 9, 11, 6).permute(0, 3, 1, 2)]),
    "layernorm_w_ndhwc": (lambda x: F.gelu(_ln(x.contiguous())), lambda: [_r(2, 3, 4, 5, 64).permute(0, 4, 1, 2, 3)]),
    # transposing pointwise tiles over the outputs' run
    "nhwc_to_nchw": (lambda x, b: (torch.tanh(x) + b.view(1, -1, 1, 1)).contiguous(),
                     lambda: [_r(2, 5, 7, 37).permute(0, 3, 1, 2), _r(37)]),
    # a scan, an arg reduction, a plain pointwise chain
    "cumsum": (lambda x: torch.cumsum(x, -1) * 0.5, lambda: [_r(3, 1000)]),
    "argmax": (lambda x: torch.argmax(x * 2, -1), lambda: [_r(4, 3000)]),
    "pointwise": (lambda x, y: F.silu(x) * y + 1, lambda: [_r(3, 1001), _r(3, 1001)]),
    # NaN-keeping max/min (helper combine functions for the reductions), C's fmod (float %), torch's
    # floor division and remainder
    "amax_amin_long": (lambda x: (x.amax(-1), x.amin(-1) * 2), lambda: [_r(2, 70001)]),
    "int_sums": (lambda x: (x.sum(-1), x.amax(-1), (x > 0).sum(-1), torch.div(x, 3, rounding_mode="floor")),
                 lambda: [torch.randint(-100, 100, (3, 3000))]),
    "clamp_fmod_floor": (lambda x: (torch.remainder(x.clamp(-1, 1), 0.3), torch.div(x, 0.7, rounding_mode="floor"),
                                    torch.fmod(F.hardswish(x), 0.2)), lambda: [_r(3, 1001)]),
    # two chained 3-D max pools (216 loads a point; before the code cap a 256 x 32 tile on 16 warps
    # kept ptxas busy for more than 6 minutes)
    "pools_chained": (lambda x: F.max_pool3d(F.max_pool3d(torch.softmax(x, 1), 3), 2),
                      lambda: [_r(2, 3, 13, 14, 15)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generated_kernels_compile_for_sm90(case: str, backend: None) -> None:
    fn, make = CASES[case]
    xs = make()
    regions = RG.form_regions(trace(fn, *xs).graph)
    assert regions
    rng = random.Random(0)
    items, names = [], []
    for fr in regions:
        low = fr.lowered
        space = SC.space(low)
        picks = [SC.heuristic(low)] + rng.sample(space, min(5, len(space)))
        for v in sorted({c.variant for c in space}):  # every variant of the space at least once
            picks.append(next(c for c in space if c.variant == v))
        for c in dict.fromkeys(picks):
            items.append(_item(low, c))
            names.append(c.encode())
    errors = {n: e for n, e in zip(names, sm90_compile(items), strict=True) if e is not None}
    assert not errors, f"{case}: {errors}"
