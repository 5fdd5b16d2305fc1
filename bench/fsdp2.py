"""Benchmark on 2 GPUs: a training step under FSDP2 (`fully_shard`), eager against solforge.

    python bench/fsdp2.py [--layers 4] [--batch 2] [--seq 2048] [--order shard-first|optimize-first]
                          [--variants eager,solforge,compile] [--out bench/results/NAME.json]

No torchrun: the script spawns one process per GPU (NCCL). The model is Qwen3-0.6B's architecture
(solforge.zoo.hf.qwen3_0_6b_config) cut to `--layers` layers, random bf16 weights, sdpa attention;
the step is the causal-LM loss of a batch of `--batch` x `--seq` random tokens per rank (the model
called with labels, inside a module so that optimize captures the loss too), backward, AdamW.
Every decoder layer is a `fully_shard` unit, the step module the root.

Variants, one after another in the same two processes, each from the same weights and batches:
- eager: FSDP2 as it is;
- solforge: FSDP2 and `solforge.optimize(mode="train")`, by default sharded first (`--order
  optimize-first`: optimized, then sharded); each rank tunes into a kernel database of its own
  (`--db-dir`), so a second run starts from the first's kernels;
- compile: FSDP2 and `torch.compile` of the step module (default backend), for reference.

Per rank and variant: the median, p20 and p80 step time (CUDA events around each of `--steps`
steps after `--warmup`, a barrier before each), peak allocated and reserved memory over the timed
steps, and the first steps' losses (each variant's against eager's: the same function in bf16).
solforge's entry adds optimize's wall time, what it returned and why, its end-to-end check. Rank
0 writes one JSON file with device, versions, date, command and every number.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


class Step(torch.nn.Module):
    """The causal-LM loss of a batch: what a training step differentiates."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def _model(layers: int) -> Step:
    import transformers

    from solforge.zoo.hf import qwen3_0_6b_config

    cfg = qwen3_0_6b_config()
    cfg.num_hidden_layers = layers
    cfg.max_window_layers = layers
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return Step(lm)


def _shard(step: Step) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (WORLD,))
    for layer in step.lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(step, mesh=mesh)
    return step


def _batch(i: int, a: argparse.Namespace, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randint(0, vocab, (a.batch, a.seq), generator=g).cuda()


def _time_steps(step: Step, a: argparse.Namespace, rank: int) -> dict[str, Any]:
    vocab = step.lm.config.vocab_size
    opt = torch.optim.AdamW(step.parameters(), lr=1e-5, foreach=True)
    losses: list[float] = []
    times: list[float] = []

    def one(i: int) -> torch.Tensor:
        loss = step(_batch(i, a, rank, vocab))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(a.warmup):
        losses.append(float(one(i)))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup, a.warmup + a.steps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = one(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(losses) < a.warmup + 3:
            losses.append(float(loss))
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return {"step_ms": statistics.median(times), "p20_ms": q[1], "p80_ms": q[7], "steps": len(times),
            "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3), "losses": losses}


def _variant(name: str, a: argparse.Namespace, rank: int) -> dict[str, Any]:
    step = _model(a.layers)
    out: dict[str, Any] = {}
    if name == "solforge":
        import solforge

        example = (_batch(0, a, rank, step.lm.config.vocab_size),)
        if a.order == "shard-first":
            _shard(step)
        t = time.perf_counter()
        _, report = solforge.optimize(step, example, mode="train", budget=a.budget,
                                      db=Path(a.db_dir) / f"kernels-rank{rank}.db", name="qwen3-0.6b-fsdp2")
        out["optimize_s"] = round(time.perf_counter() - t, 1)
        if a.order == "optimize-first":
            _shard(step)
        e2e = report.e2e
        out |= {"returned": report.returned, "why": report.why, "notes": list(report.notes),
                "kernels": getattr(getattr(step, "solforge_stats", None), "total", None),
                "e2e": None if e2e is None else {k: getattr(e2e, k) for k in (
                    "passed", "note", "grad_max_rel_err", "max_rel_err", "baseline_ms", "optimized_ms", "speedup")}}
    else:
        _shard(step)
        if name == "compile":
            step.compile()
    out |= _time_steps(step, a, rank)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _worker(rank: int, port: int, a: argparse.Namespace) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank),
                            timeout=dt.timedelta(minutes=30))
    try:
        results = {name: _variant(name, a, rank) for name in a.variants.split(",")}
        every = [None] * WORLD
        dist.all_gather_object(every, results)
        if rank == 0:
            _write(a, every)
    finally:
        dist.destroy_process_group()


def _write(a: argparse.Namespace, every: list[Any]) -> None:
    from solforge.api import versions

    eager = [r.get("eager") for r in every]
    for r, e in zip(every, eager, strict=True):  # each variant's first losses against eager's, same batches
        for v in r.values():
            if e is not None and v is not e:
                n = min(len(v["losses"]), len(e["losses"]))
                v["loss_max_rel_diff_vs_eager"] = max(abs(x - y) / abs(y) for x, y in zip(
                    v["losses"][:n], e["losses"][:n], strict=True))
    result = {"what": "FSDP2 training step, eager vs solforge", "device": torch.cuda.get_device_name(0),
              "gpus": WORLD, "versions": versions("cuda"),
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "args": vars(a),
              "model": f"Qwen3-0.6B dims, {a.layers} layers, bf16, random weights, sdpa",
              "ranks": every}
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=120.0, help="optimize's tuning budget, seconds")
    p.add_argument("--order", choices=("shard-first", "optimize-first"), default="shard-first")
    p.add_argument("--variants", default="eager,solforge")
    p.add_argument("--db-dir", default="/tmp/solforge-fsdp2-bench")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    Path(a.db_dir).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, a), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
