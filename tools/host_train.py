"""Decided compact.py (linears put back as one aten.linear): the Qwen3-4B training step's host time against its device
time, per phase (bench/results/2026-11-22-h100-session7.md).

GPU: is the Qwen3-4B training step waiting on the host? Host time against device time, per phase.

    python tools/host_train.py [--variants eager,solforge] [--budget 60] [--steps 10] [--out FILE]

BASELINES.md's step (B1 S4096 bf16, loss = mean of the squared last hidden state, forward +
backward; solforge optimized with mode="train"). Each measured step starts on an idle device
(synchronized), then:
- host_fwd_ms / host_bwd_ms: how long the Python call of the forward (to the loss) and of
  backward() took on the host; kernel launches are asynchronous, so this is the host's own time
  (unless it had to wait for the device);
- dev_fwd_ms / dev_bwd_ms: CUDA events recorded at the same points: the device's time for each
  phase, including any time it sat idle waiting for the host's next launch;
- step_ms: wall time of the whole step, synchronized at the end.
When the host time of a phase is close to (or above) its device time, the device was starved in
that phase: a faster kernel there does not make the step faster, less host work does. Medians
over --steps steps, after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from solforge import settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402


def measure(f: Any, ids: torch.Tensor, steps: int) -> dict[str, float]:
    rows: list[tuple[float, ...]] = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        t0 = time.perf_counter()
        e[0].record()
        loss = f(ids).last_hidden_state.float().square().mean()
        t1 = time.perf_counter()
        e[1].record()
        loss.backward()
        t2 = time.perf_counter()
        e[2].record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= 3:
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]),
                         (t3 - t0) * 1e3))
    names = ("host_fwd_ms", "host_bwd_ms", "dev_fwd_ms", "dev_bwd_ms", "step_ms")
    return {n: round(statistics.median(r[k] for r in rows), 2) for k, n in enumerate(names)}


def variant(name: str, budget: float, steps: int) -> dict[str, Any]:
    from transformers import Qwen3ForCausalLM

    from solforge.zoo import zoo_config

    cfg = zoo_config("qwen3-4b")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    body = model.model.train()
    ids = torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda")
    out: dict[str, Any] = {"variant": name}
    f: Any = body
    if name.startswith("solforge"):
        import solforge.integrate
        import solforge.integrate.compact
        from solforge.api import optimize

        counted = [0]
        real = solforge.integrate.compact.recompose_linear

        def counting(gm: Any) -> int:  # the Integrator's call, counted
            n = real(gm)
            counted[0] += n
            return n

        solforge.integrate.recompose_linear = counting
        t0 = time.time()
        with torch.enable_grad():
            f, rep = optimize(body, (ids,), budget=budget, is_language_model=False, mode="train")
        out["optimize_s"] = round(time.time() - t0, 1)
        out["linears_recomposed"] = counted[0]
        out["regions"] = [[r.workload.split("[")[0], r.count, r.config] for r in rep.regions]
    out.update(measure(f, ids, steps))
    del model, body, f
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="eager,solforge",
                   help="eager, solforge, solforge-nocompact (without compact.py's pass), "
                        "solforge-nolinears (without linears.py's)")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()
    res: dict[str, Any] = {**provenance(), "rows": []}
    for v in a.variants.split(","):
        # solforge-nocompact: without compact.py's pass, to measure what it saves in the same process;
        # solforge-nolinears: without linears.py's pass (the training linears stay aten.linear)
        with settings.override(compact=v != "solforge-nocompact", linears=v != "solforge-nolinears"):
            res["rows"].append(variant(v, a.budget, a.steps))
        print(json.dumps(res["rows"][-1])[:600], flush=True)
        write_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
