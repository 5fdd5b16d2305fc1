"""Decided kernels/rounding.py: bf16 is rounded in integer arithmetic, because the compiler folds a float round trip
into a bf16 fma.

GPU probe: does rounding an fp32 product to bf16 and back survive compilation? Compares
a*c - b*s computed by small Triton kernels (several spellings of the rounding) and by the rope kernel
with eager torch's bf16 ops, and counts the conversions in their PTX.

    python tools/round_probe.py
"""
import re

import torch
import triton
import triton.language as tl

from solforge.kernels import rope as R
from solforge.kernels.interp import round_bf16


@triton.jit
def k_cast(a_ptr, c_ptr, b_ptr, s_ptr, o_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m).to(tl.float32)
    c = tl.load(c_ptr + i, mask=m).to(tl.float32)
    b = tl.load(b_ptr + i, mask=m).to(tl.float32)
    s = tl.load(s_ptr + i, mask=m).to(tl.float32)
    if MODE == 0:  # round once
        y = a * c - b * s
    elif MODE == 1:  # .to(bf16).to(fp32)
        y = (a * c).to(tl.bfloat16).to(tl.float32) - (b * s).to(tl.bfloat16).to(tl.float32)
    elif MODE == 2:  # integer RNE
        y = round_bf16(a * c) - round_bf16(b * s)
    else:  # explicit rtne
        y = (a * c).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32) - \
            (b * s).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(o_ptr + i, y.to(tl.bfloat16), mask=m)


n = 1 << 20
g = torch.Generator(device="cuda").manual_seed(0)
a, c, b, s = (torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
eager = a * c - b * s
for mode, name in enumerate(["once", "to().to()", "integer RNE", "rtne"]):
    o = torch.empty_like(a)
    ck = k_cast[(n // 1024,)](a, c, b, s, o, n, MODE=mode, BLOCK=1024)
    ptx = ck.asm["ptx"]
    counts = {op: len(re.findall(re.escape(op), ptx)) for op in ("cvt.rn.bf16.f32", "cvt.f32.bf16", "cvt.rn.bf16x2.f32",
              "mul.rn.bf16", "fma.rn.bf16", "sub.rn.bf16", "fma.rn.f32", "mul.f32", "sub.f32", "mul.rn.f32")}
    print(f"{name:12s} differs from eager at {(o != eager).float().mean().item():.4%}", counts)
# the rope kernel itself, no norm
B, S, Hq, Hk, D = 2, 24, 4, 2, 64
q = torch.randn(B, S, Hq, D, device="cuda").to(torch.bfloat16)
k = torch.randn(B, S, Hk, D, device="cuda").to(torch.bfloat16)
ang = torch.randn(S, D // 2, device="cuda")
emb = torch.cat([ang, ang], -1)
cos, sin = emb.cos()[None].to(torch.bfloat16), emb.sin()[None].to(torch.bfloat16)
oq, ok = R.rope(q, k, cos, sin, None, None, 1e-6, norm=False, heads_first=True)
x = q.transpose(1, 2)
rot = torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)
want = x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)
print("rope kernel differs from eager at", f"{(oq != want).float().mean().item():.4%}")
for kern in (R._rope_fwd_kernel, R._rope_fwd_persistent_kernel):
    for _key, compiled in list(getattr(kern, "device_caches", {}).get(0, ({},))[0].items())[:1]:
        ptx = compiled.asm.get("ptx", "")
        print(kern.__name__, {op: len(re.findall(re.escape(op), ptx)) for op in
                              ("cvt.rn.bf16.f32", "cvt.f32.bf16", "mul.rn.bf16", "fma.rn.bf16", "sub.rn.bf16",
                               "add.rn.bf16", "fma.rn.f32", "mul.f32", "sub.f32", "cvt.rn.bf16x2.f32")})
