"""Decided not to ship TMA-pipelined norm backwards: a prototype against the shipped kernels
(bench/results/2026-11-23-h100-session9.md).

GPU probe: do TMA loads, pipelined by Triton's loop pipeliner, lift the norm backwards' streaming rate?

    python tools/tma_bwd_probe.py [--out FILE]

rmsnorm_bwd without the residual gradient and layernorm_bwd stream at ~85% of a copy's device rate
(2026-11-22, kernel_split.py): each program holds one row tile in registers (two with stages 2),
and a row must be reduced before its dx can be written. Triton's pipeliner does not pipeline plain
`tl.load`s in a loop without a dot (checked on the TTGIR), but it does pipeline tensor-descriptor
(TMA) loads: with `tl.range(..., num_stages=S)`, S - 1 tiles are in flight in shared memory while
one is computed. This times prototypes of both backwards built that way, for a grid of
(rows per tile, stages, warps), against the shipped launchers and a copy of the same bytes, at
16384 x 2560 bf16. Each prototype is checked against the family's reference first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import bench_us, provenance, write_json  # noqa: E402


@triton.jit
def _rms_part(dy, x, w, rstd, c):
    dn = dy * w
    return rstd * (dn - x * rstd * c), dy * x * rstd


@triton.jit
def _rms_kernel(xa, xb, dya, dyb, dxa, dxb, w_ptr, dx_ptr, dw_ptr, n_rows, n_iter, eps, H: tl.constexpr,
                R: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, L: tl.constexpr, NS: tl.constexpr,
                TMA_STORE: tl.constexpr):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    ca = tl.arange(0, CA)[:, None] * L + tl.arange(0, L)[None, :]
    cb = CA * L + tl.arange(0, CB)[:, None] * L + tl.arange(0, L)[None, :]
    wa = tl.load(w_ptr + ca).to(tl.float32)[None]
    wb = tl.load(w_ptr + cb).to(tl.float32)[None]
    dwa = tl.zeros([CA, L], dtype=tl.float32)
    dwb = tl.zeros([CB, L], dtype=tl.float32)
    for i in tl.range(0, n_iter, num_stages=NS):
        row = (pid + i * n_progs) * R
        x = xa.load([row, 0, 0]).to(tl.float32)
        dy = dya.load([row, 0, 0]).to(tl.float32)
        x2 = xb.load([row, CA, 0]).to(tl.float32)
        dy2 = dyb.load([row, CA, 0]).to(tl.float32)
        ss = tl.sum(tl.sum(x * x, 2), 1) + tl.sum(tl.sum(x2 * x2, 2), 1)
        dot = tl.sum(tl.sum(dy * wa * x, 2), 1) + tl.sum(tl.sum(dy2 * wb * x2, 2), 1)
        rstd1 = tl.rsqrt(ss / H + eps)
        rstd = rstd1[:, None, None]
        c = (dot * rstd1 / H)[:, None, None]
        da, pa = _rms_part(dy, x, wa, rstd, c)
        db, pb = _rms_part(dy2, x2, wb, rstd, c)
        if TMA_STORE:
            dxa.store([row, 0, 0], da.to(tl.bfloat16))
            dxb.store([row, CA, 0], db.to(tl.bfloat16))
        else:
            rows = row + tl.arange(0, R)[:, None, None]
            m = rows < n_rows
            base = dx_ptr + rows.to(tl.int64) * H
            tl.store(base + ca[None], da.to(tl.bfloat16), mask=m)
            tl.store(base + cb[None], db.to(tl.bfloat16), mask=m)
        dwa += tl.sum(pa, 0)
        dwb += tl.sum(pb, 0)
    tl.store(dw_ptr + pid * H + ca, dwa)
    tl.store(dw_ptr + pid * H + cb, dwb)


@triton.jit
def _ln_part(dy, d, w, rstd, c1, c2):
    n = d * rstd
    dn = dy * w
    return rstd * (dn - c1 - n * c2), dy * n


@triton.jit
def _ln_kernel(xa, xb, dya, dyb, dxa, dxb, w_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_iter, eps, H: tl.constexpr,
               R: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, L: tl.constexpr, NS: tl.constexpr,
               TMA_STORE: tl.constexpr):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    ca = tl.arange(0, CA)[:, None] * L + tl.arange(0, L)[None, :]
    cb = CA * L + tl.arange(0, CB)[:, None] * L + tl.arange(0, L)[None, :]
    wa = tl.load(w_ptr + ca).to(tl.float32)[None]
    wb = tl.load(w_ptr + cb).to(tl.float32)[None]
    dwa = tl.zeros([CA, L], dtype=tl.float32)
    dwb = tl.zeros([CB, L], dtype=tl.float32)
    dba = tl.zeros([CA, L], dtype=tl.float32)
    dbb = tl.zeros([CB, L], dtype=tl.float32)
    for i in tl.range(0, n_iter, num_stages=NS):
        row = (pid + i * n_progs) * R
        x = xa.load([row, 0, 0]).to(tl.float32)
        dy = dya.load([row, 0, 0]).to(tl.float32)
        x2 = xb.load([row, CA, 0]).to(tl.float32)
        dy2 = dyb.load([row, CA, 0]).to(tl.float32)
        mean = ((tl.sum(tl.sum(x, 2), 1) + tl.sum(tl.sum(x2, 2), 1)) / H)[:, None, None]
        d = x - mean
        d2 = x2 - mean
        var = (tl.sum(tl.sum(d * d, 2), 1) + tl.sum(tl.sum(d2 * d2, 2), 1)) / H
        rstd1 = tl.rsqrt(var + eps)
        dn = dy * wa
        dn2 = dy2 * wb
        s_dn = tl.sum(tl.sum(dn, 2), 1) + tl.sum(tl.sum(dn2, 2), 1)
        s_dnd = tl.sum(tl.sum(dn * d, 2), 1) + tl.sum(tl.sum(dn2 * d2, 2), 1)
        rstd = rstd1[:, None, None]
        c1 = (s_dn / H)[:, None, None]
        c2 = (s_dnd * rstd1 / H)[:, None, None]
        da, pa = _ln_part(dy, d, wa, rstd, c1, c2)
        db, pb = _ln_part(dy2, d2, wb, rstd, c1, c2)
        if TMA_STORE:
            dxa.store([row, 0, 0], da.to(tl.bfloat16))
            dxb.store([row, CA, 0], db.to(tl.bfloat16))
        else:
            rows = row + tl.arange(0, R)[:, None, None]
            m = rows < n_rows
            base = dx_ptr + rows.to(tl.int64) * H
            tl.store(base + ca[None], da.to(tl.bfloat16), mask=m)
            tl.store(base + cb[None], db.to(tl.bfloat16), mask=m)
        dwa += tl.sum(pa, 0)
        dwb += tl.sum(pb, 0)
        dba += tl.sum(dy, 0)
        dbb += tl.sum(dy2, 0)
    tl.store(dw_ptr + pid * H + ca, dwa)
    tl.store(dw_ptr + pid * H + cb, dwb)
    tl.store(db_ptr + pid * H + ca, dba)
    tl.store(db_ptr + pid * H + cb, dbb)


def _descs(t: torch.Tensor, R: int, CA: int, CB: int, L: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    v = t.view(t.shape[0], t.shape[1] // L, L)
    return (TensorDescriptor.from_tensor(v, [R, CA, L]), TensorDescriptor.from_tensor(v, [R, CB, L]))


def prototype(kind: str, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, *, R: int, NS: int,
              warps: int, progs: int, tma_store: bool) -> Callable[[], tuple[torch.Tensor, ...]]:
    from solforge.kernels.reduce import sum_rows

    n_rows, H = x.shape
    L, CA, CB = 256, 8, 2
    assert H == (CA + CB) * L
    n_tiles = triton.cdiv(n_rows, R)
    grid = min(n_tiles, progs * torch.cuda.get_device_properties(x.device).multi_processor_count)
    n_iter = triton.cdiv(n_tiles, grid)
    dx = torch.empty_like(x)
    segs = 2 if kind == "ln" else 1
    part = torch.empty(segs * grid, H, device=x.device, dtype=torch.float32)
    outs = tuple(torch.empty(H, device=x.device, dtype=w.dtype) for _ in range(segs))
    d = (*_descs(x, R, CA, CB, L), *_descs(dy, R, CA, CB, L), *_descs(dx, R, CA, CB, L))
    meta = dict(H=H, R=R, CA=CA, CB=CB, L=L, NS=NS, TMA_STORE=tma_store, num_warps=warps)

    def run() -> tuple[torch.Tensor, ...]:
        if kind == "rms":
            _rms_kernel[(grid,)](*d, w, dx, part, n_rows, n_iter, eps, **meta)
            sum_rows(part, (0, grid), outs)
        else:
            _ln_kernel[(grid,)](*d, w, dx, part, part[grid:], n_rows, n_iter, eps, **meta)
            sum_rows(part, (0, grid, 2 * grid), outs)
        return (dx, *outs)

    return run


def main() -> int:
    from solforge.kernels import layernorm_bwd as LB
    from solforge.kernels import rmsnorm_bwd as RB

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="a few configs only")
    p.add_argument("--grid", help="e.g. 'R=1,2 S=3,4 wp=4x2,8x1 ts=0,1' (wp: warps x programs per SM)")
    p.add_argument("--kinds", default="rms,ln")
    a = p.parse_args()

    def alloc(size: int, align: int, stream: Any) -> torch.Tensor:
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc)
    res: dict[str, Any] = {**provenance(), "cases": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(16384, 2560, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).to(torch.bfloat16)
    nbytes = 3 * x.numel() * 2
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    bench_us(lambda: dst.copy_(src))  # a discarded first timing (the first after idle reads slow)
    copy_us = bench_us(lambda: dst.copy_(src))
    res["copy_us"] = copy_us
    res["bytes"] = nbytes
    print(f"copy {copy_us:.2f} us = {nbytes / copy_us / 1e6:.3f} TB/s", flush=True)
    shipped = {
        "rms": lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6),
        "ln": lambda: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True),
    }
    refs = {
        "rms": RB.rmsnorm_bwd_ref(dy, x, w, 1e-6),
        "ln": LB.layernorm_bwd_ref(dy, x, w, 1e-5, bias_grad=True),
    }
    grid = [(R, NS, wp, pr, ts) for R in (1, 2, 4) for NS in (2, 3, 4)
            for wp, pr in ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2)) for ts in (False, True)]
    if a.quick:
        grid = [(R, NS, 8, 1, ts) for R in (1, 2) for NS in (3, 4) for ts in (False, True)]
    if a.grid:
        spec = dict(part.split("=") for part in a.grid.split())
        grid = [(R, NS, int(wp.split("x")[0]), int(wp.split("x")[1]), bool(int(ts)))
                for R in map(int, spec["R"].split(",")) for NS in map(int, spec["S"].split(","))
                for wp in spec["wp"].split(",") for ts in spec["ts"].split(",")]
    for kind in a.kinds.split(","):
        case: dict[str, Any] = {"kind": kind, "configs": {}}
        ship_us = bench_us(shipped[kind])
        case["shipped_us"] = ship_us
        print(f"{kind} shipped {ship_us:.2f} us = {nbytes / ship_us / 1e6:.3f} TB/s", flush=True)
        for R, NS, wp, pr, ts in grid:
            # shared memory: NS - 1 tiles of x and dy in flight, and dx's store buffer
            if pr * R * 2560 * 2 * (2 * (NS - 1) + 1) > 228 * 1024:
                continue
            name = f"R={R}:S={NS}:w={wp}:p={pr}:tma_store={int(ts)}"
            try:
                fn = prototype(kind, dy, x, w, 1e-6 if kind == "rms" else 1e-5, R=R, NS=NS, warps=wp, progs=pr,
                               tma_store=ts)
                got = fn()
                errs = [((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                        for o, r in zip(got, refs[kind], strict=True)]
                if max(errs) > 2e-2:
                    case["configs"][name] = {"error": f"mismatch {errs}"}
                    print(name, "MISMATCH", errs, flush=True)
                    continue
                us = bench_us(fn)
            except Exception as e:  # noqa: BLE001  a config that does not build is data
                case["configs"][name] = {"error": str(e)[:300]}
                print(name, "ERROR", str(e)[:200], flush=True)
                continue
            case["configs"][name] = {"us": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                                     "max_rel_err": [round(e, 5) for e in errs]}
            print(f"{kind} {name} {us:.2f} us = {nbytes / us / 1e6:.3f} TB/s", flush=True)
        res["cases"].append(case)
        if a.out:  # after each kind: a run stopped at its limit keeps what it measured
            write_json(res, a.out)
    if not a.out:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
