"""Probe: are Triton's tl.sin / tl.cos as accurate as torch's for large arguments on this GPU?

Decided (H100, 2026-11-27, bench/results/2026-11-27-h100-trig-probe.txt): yes, the same results as
torch's to the bit up to |x| = 8192 (rope's angles at 8K positions): codegen keeps tl.sin/tl.cos.

    python tools/trig_probe.py
"""
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, c_ptr, s_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(c_ptr + o, tl.cos(x), mask=m)
    tl.store(s_ptr + o, tl.sin(x), mask=m)


out = {}
for hi in (3.2, 100.0, 1000.0, 8192.0):
    x = torch.linspace(-hi, hi, 1 << 20, device="cuda", dtype=torch.float32)
    c, s = torch.empty_like(x), torch.empty_like(x)
    _k[(triton.cdiv(x.numel(), 1024),)](x, c, s, x.numel(), BLOCK=1024)
    xd = x.double()
    out[f"|x|<={hi}"] = {"tl.cos_max_abs_err_vs_fp64": float((c.double() - xd.cos()).abs().max()),
                         "torch.cos_max_abs_err_vs_fp64": float((x.cos().double() - xd.cos()).abs().max()),
                         "tl.sin_max_abs_err_vs_fp64": float((s.double() - xd.sin()).abs().max()),
                         "torch.sin_max_abs_err_vs_fp64": float((x.sin().double() - xd.sin()).abs().max()),
                         "bf16_cos_differs_from_torch": float((c.bfloat16() != x.cos().bfloat16()).float().mean())}
print(json.dumps(out, indent=1))
