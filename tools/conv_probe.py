"""Probe: KernelBench level 2 row 1's convolution on a GPU: eager NCHW against channels-last (with and
without the copies in), cuDNN's benchmark mode, torch.compile's kernels, and what solforge's layout
pass decides.

Decided (H200, 2026-11-27, bench/results/2026-11-27-h200-conv-probe.txt): the layout pass rewrites
the convolution once the copy back fuses; ATen adds the bias in a pass of its own
(capture/layout.py's strip_bias); ATen's NCHW -> NHWC clone took 2.3x Inductor's tiled one
(plan/generated.py's relayouts).

    python tools/conv_probe.py --kernelbench PATH [--problem level2/1_Conv2D_ReLU_BiasAdd.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from triton.testing import do_bench

from solforge.capture import layout as L
from solforge.capture.stage import capture_model
from solforge.tune.timing import time_kernel

CONV = torch.ops.aten.convolution.default
CL = torch.channels_last


def _kernels(fn: Callable[[], Any]) -> list[tuple[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], round(e.device_time_total / 1e3, 3)) for e in prof.key_averages()]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", required=True, help="a KernelBench checkout (its level folders)")
    p.add_argument("--problem", default="level2/1_Conv2D_ReLU_BiasAdd.py")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("problem", f"{a.kernelbench}/{a.problem}")
    assert spec is not None and spec.loader is not None
    prob = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prob)
    torch.manual_seed(0)
    m = prob.Model(*prob.get_init_inputs()).cuda().eval()
    (x,) = [t.cuda() for t in prob.get_inputs()]
    conv = next(c for c in m.modules() if isinstance(c, torch.nn.Conv2d))
    w, b = conv.weight.detach(), conv.bias.detach()
    rest = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0, 0], conv.groups)
    xc, wc = x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)
    out: dict[str, Any] = {"problem": a.problem, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                           "cudnn_benchmark": torch.backends.cudnn.benchmark}
    with torch.no_grad():
        timed = {"conv_nchw": lambda: CONV(x, w, b, *rest),
                 "conv_nchw_no_bias": lambda: CONV(x, w, None, *rest),
                 "conv_cl_preconverted": lambda: CONV(xc, wc, b, *rest),
                 "conv_cl_preconverted_no_bias": lambda: CONV(xc, wc, None, *rest),
                 "clone_x_to_cl": lambda: x.clone(memory_format=CL),
                 "conv_cl_with_copies_in": lambda: CONV(x.clone(memory_format=CL), w.clone(memory_format=CL), b, *rest),
                 "eager_model": lambda: m(x)}
        for name, fn in timed.items():
            out[name + "_ms"] = round(do_bench(fn, rep=200), 3)
        out["time_kernel_nchw_us"] = time_kernel(timed["conv_nchw"], "cuda").p50_us
        out["time_kernel_cl_us"] = time_kernel(timed["conv_cl_with_copies_in"], "cuda").p50_us
        torch.backends.cudnn.benchmark = True
        out["conv_nchw_benchmark_ms"] = round(do_bench(timed["conv_nchw"], rep=200), 3)
        out["conv_cl_benchmark_ms"] = round(do_bench(timed["conv_cl_preconverted"], rep=200), 3)
        torch.backends.cudnn.benchmark = False
        cm = torch.compile(m)
        cm(x)
        out["compile_ms"] = round(do_bench(lambda: cm(x), rep=200), 3)
        out["compile_kernels"] = _kernels(lambda: cm(x))
        out["eager_kernels"] = _kernels(lambda: m(x))
        t = time.time()
        cap = capture_model(m, (x,), train=False, cache=None, skip_logits=False)
    out["capture_s"] = round(time.time() - t, 1)
    out["conv_layouts"] = [g.conv_layouts for g in cap.graphs]
    out["measured_cache"] = str(L._measured.cache_info())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
