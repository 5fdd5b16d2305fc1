"""Decided rmsnorm's per-node launch plan (`rmsnorm._Site`): a decode-sized call's host time, layer by layer
(bench/results/2026-11-26-h100-h200-session21.md).

Where a decode-sized call through the optimized model spends its host time (issue 2's 1 x 2560
RMSNorm): wall clock per call of each layer of the call path in a loop of back-to-back calls, and a
cProfile of the whole path. Writes JSON to --out."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import EPS, OneNorm, bench_us, loop_us, versions  # noqa: E402


def _inner_layers(gm: Any, args: Any) -> dict[str, float]:
    """Each layer under the FX graph alone, in a loop: the graph's forward without nn.Module's call,
    the op's direct function, the rmsnorm launcher, solforge's `launch`, and the compiled
    kernel's launcher (what `launch` calls on a hit). A layer that cannot be reached is left out."""
    import solforge.kernels.launch as L
    import solforge.kernels.rmsnorm as rn

    out: dict[str, float] = {"fx_graph_forward": loop_us(lambda: gm.forward(*args))}
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    env = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], args, strict=False))
    vals = [env.get(a, a) for a in node.args]
    out["direct_call"] = loop_us(lambda: node.target(*vals))
    out["op_impl"] = loop_us(lambda: rn._rmsnorm_op(*vals))
    got: list[Any] = []
    real = rn._launch
    rn._launch = lambda *a: (got.append(a), real(*a))  # type: ignore[assignment]
    rn._rmsnorm_op(*vals)
    rn._launch = real
    kernel, grid, kargs, kw = got[0]
    out["launch"] = loop_us(lambda: L.launch(kernel, grid, kargs, kw))
    key = L.launch_key(kernel, grid, kargs, kw, torch.cuda.current_device())
    out["launch_key"] = loop_us(lambda: L.launch_key(kernel, grid, kargs, kw, 0), 20000)
    hit = L._CACHE.get(key)
    stream = torch.cuda.current_stream().cuda_stream
    if hit is not None and len(hit) == 7:  # (kernel, run, head, grid x3, tail)
        _, run, head, g0, g1, g2, tail = hit
        out["compiled_run"] = loop_us(lambda: run(g0, g1, g2, stream, *head, *kargs, *tail))
    elif hit is not None and len(hit) == 8:  # before 2026-11-26: (kernel, run, function, metadata, grid x3, tail)
        _, run, function, metadata, g0, g1, g2, tail = hit
        out["compiled_run"] = loop_us(lambda: run(g0, g1, g2, stream, function, metadata, None, None, None,
                                                  *kargs, *tail))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from solforge.api import optimize

    H = a.hidden  # noqa: N806
    torch.manual_seed(0)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    m = OneNorm(H).cuda().to(torch.bfloat16)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "versions": versions(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    loops: dict[str, float] = {}
    benches: dict[str, float] = {}
    with torch.no_grad():
        opt, rep = optimize(m, (x,), budget=20)
        assert rep.e2e is not None and rep.e2e.passed
        for _ in range(5):
            opt(x)
        step = opt.solforge_stats.step_graphs[0]
        loops["eager"] = loop_us(lambda: m(x))
        loops["model_path"] = loop_us(lambda: opt(x))
        benches["model_path"] = bench_us(lambda: opt(x))
        benches["eager"] = bench_us(lambda: m(x))
        ident = torch.compile(m, backend=lambda gm, ex: gm.forward)
        ident(x)
        loops["dynamo_fx_eager_ops"] = loop_us(lambda: ident(x))
        comp = torch.compile(m)
        comp(x)
        loops["torch_compile"] = loop_us(lambda: comp(x))
        benches["torch_compile"] = bench_us(lambda: comp(x))
        # the StepGraph and its FX graph, without dynamo: the arguments dynamo passes, recorded once
        import solforge.runtime.stepgraphs as sg

        got: list[Any] = []
        real = sg.StepGraph.__call__

        def rec(self: Any, *args: Any) -> Any:
            got.append(args)
            return real(self, *args)
        sg.StepGraph.__call__ = rec  # type: ignore[method-assign]
        opt(x)
        sg.StepGraph.__call__ = real  # type: ignore[method-assign]
        args = got[0]
        res["step_summary"] = step.summary()
        res["graph_code"] = step.gm.code
        loops["step_graph_alone"] = loop_us(lambda: step(*args))
        loops["fx_graph_alone"] = loop_us(lambda: step.gm(*args))
        if step._replay is not None:
            loops["cuda_graph_replay_alone"] = loop_us(step._replay)
        loops.update(_inner_layers(step.gm, args))
        buf = torch.empty_like(x)
        loops["copy_1x2560"] = loop_us(lambda: buf.copy_(x))
        loops["clone_1x2560"] = loop_us(lambda: x.clone())
        loops["empty_like"] = loop_us(lambda: torch.empty_like(x))
        pr = cProfile.Profile()
        for _ in range(50):
            opt(x)
        torch.cuda.synchronize()
        pr.enable()
        for _ in range(2000):
            opt(x)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        res["cprofile_tottime"] = s.getvalue()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        res["cprofile_cumulative"] = s.getvalue()
    res["loop_us"] = {k: round(v, 2) for k, v in loops.items()}
    res["do_bench_us"] = {k: round(v, 2) for k, v in benches.items()}
    res["eps"] = EPS
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("cprofile")}, indent=1))
    print(res["cprofile_tottime"])
    print(res["cprofile_cumulative"])
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
