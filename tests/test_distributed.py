"""DDP and FSDP2 (`fully_shard`) around a model optimized in training mode (runtime/distributed.py):
two processes on the CPU (gloo), each rank on its own data. Every order of optimize and the
wrapping trains as eager does under the same wrapping: the same losses on every rank and the same
(gathered) parameters after the steps, with solforge's kernels running in them."""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

H, WORLD, STEPS = 48, 2, 3
# the kernels compute in fp32 in another order than eager's ops (the interpreter too); SGD's steps
# carry a difference forward, so the bar is a little over one op's rounding
TOL = {"atol": 2e-5, "rtol": 2e-4}
KW: dict[str, Any] = {"mode": "train", "budget": 1, "max_candidates": 1, "db": False, "profile": "off",
                      "keep_slower": True}


class Net(nn.Module):
    """An RMSNorm region between two linears; 13 output rows shard unevenly over two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, H)
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.down = nn.Linear(H, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def _x(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 5, H, generator=torch.Generator().manual_seed(100 * seed + rank))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: nn.Module, rank: int) -> dict[str, Any]:
    """STEPS steps of SGD on this rank's batches; the losses, the parameters after (gathered) and how
    many solforge ops ran (the profiler sees them as ops: kernels/direct.py)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(STEPS):
            loss = model(_x(10 + step, rank)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    ops = sum(1 for e in prof.events() if e.name.startswith("solforge::"))
    params = {n.replace("module.", ""): _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "ops": ops}


def _optimize(model: nn.Module, rank: int) -> dict[str, Any]:
    import solforge

    out, report = solforge.optimize(model, (_x(0, rank),), make_inputs=lambda s: (_x(s, rank),), **KW)
    assert out is model
    return {"returned": report.returned, "passed": report.e2e is not None and report.e2e.passed,
            "note": report.e2e.note if report.e2e is not None else None, "kernels": model.solforge_stats.total}


def _ddp(rank: int, base: nn.Module) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import solforge
    from solforge.records import E2EReport
    from solforge.runtime import distributed

    out: dict[str, Any] = {"eager": _train(DDP(copy.deepcopy(base)), rank)}
    model = copy.deepcopy(base)  # optimize, then wrap
    out["optimized_first"] = _optimize(model, rank)
    out["optimized_first"] |= _train(DDP(model), rank)
    wrapped = DDP(copy.deepcopy(base))  # wrap, then optimize the module inside
    out["wrapper_error"] = _error(lambda: _optimize(wrapped, rank))
    out["wrapped_first"] = _optimize(wrapped.module, rank)
    out["wrapped_first"] |= _train(wrapped, rank)
    on = KW | {"profile": "on"}
    out["profile_error"] = _error(lambda: solforge.optimize(copy.deepcopy(base), (_x(0, rank),), **on))
    # the ranks' end-to-end results agreed on: rank 1's failure and its slower run are every rank's
    mine = E2EReport(baseline_ms=1.0 + rank, optimized_ms=2.0 - rank, speedup=None, max_abs_err=float(rank),
                     max_rel_err=0.0, argmax_agree=None, passed=rank == 0, note=f"rank {rank}'s note")
    out["agreed"] = distributed.agree(mine)
    return out


def _error(fn: Callable[[], Any]) -> str | None:
    from solforge.errors import UserError

    try:
        fn()
    except UserError as e:
        return str(e)
    return None


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.up, mesh=mesh)  # a unit of its own inside the root's: the hooks break the graph there
    fully_shard(model, mesh=mesh)
    return model


def _warned_train(model: nn.Module, rank: int) -> dict[str, Any]:
    """_train, with the warnings solforge's call gave about sharding (runtime/inplace.py)."""
    from solforge.runtime.inplace import SHARDED_AFTER_WARNING

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(model, rank)
    return out | {"sharding_warnings": [str(w.message) for w in caught if str(w.message) == SHARDED_AFTER_WARNING]}


def _fsdp(rank: int, base: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {"eager": _train(_shard(copy.deepcopy(base)), rank)}
    model = _shard(copy.deepcopy(base))  # shard, then optimize
    out["sharded_first"] = _optimize(model, rank)
    out["sharded_first"] |= _warned_train(model, rank)
    model = copy.deepcopy(base)  # optimize, then shard
    out["optimized_first"] = _optimize(model, rank)
    out["optimized_first"] |= _warned_train(_shard(model), rank)
    return out


# both cases in one pair of processes (the spawn and its imports are most of a case's time)
CASES: dict[str, Callable[[int, nn.Module], dict[str, Any]]] = {
    "ddp": _ddp, "fsdp": _fsdp, "both": lambda rank, base: {"ddp": _ddp(rank, base), "fsdp": _fsdp(rank, base)}}


def _worker(rank: int, port: int, case: str, out_dir: str) -> None:
    # the ranks run on the CPU (gloo), also on a machine with a GPU: solforge's kernels run in
    # Triton's interpreter there (set before solforge, and with it its kernels, is imported)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRITON_INTERPRET": "1",
                   "CUDA_VISIBLE_DEVICES": ""}
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        base = Net()
        result = CASES[case](rank, base) | {"start": {n: p.detach().clone() for n, p in base.named_parameters()}}
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str, tmp_path: Path, limit_s: float = 240.0) -> list[dict[str, Any]]:
    """The case on WORLD spawned ranks; each rank's result. A rank that hangs past `limit_s` (a
    collective one rank never joins) fails the test instead of hanging it."""
    ctx = mp.start_processes(_worker, args=(_free_port(), case, str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{case}: the ranks did not finish in {limit_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]  # our own files


def _same_training(got: dict[str, Any], want: dict[str, Any], start: dict[str, torch.Tensor], *,
                   ran: bool = True) -> None:
    """`got` trained as eager did (`want`); `ran`: solforge's ops ran in its steps (else none did)."""
    assert got["passed"] and got["returned"] == "optimized", got["note"]
    assert got["kernels"] > 0 and (got["ops"] > 0) == ran, got["ops"]  # the kernels ran in the steps, or not
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL)
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # the steps moved the parameters: equal to eager's is not equal to where they started
    assert all(not torch.allclose(p, start[n], **TOL) for n, p in want["params"].items())


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("both", tmp_path_factory.mktemp("ranks"))


@pytest.mark.xdist_group("distributed")
def test_ddp_optimize_before_or_after_wrapping(both: list[dict[str, Any]]) -> None:
    ranks = [r["ddp"] | {"start": r["start"]} for r in both]
    for r in ranks:
        for order in ("optimized_first", "wrapped_first"):
            _same_training(r[order], r["eager"], r["start"])
        assert r["wrapper_error"] is not None and "ddp.module" in r["wrapper_error"]
        assert r["profile_error"] is not None and "torch.distributed" in r["profile_error"]
    for rank, r in enumerate(ranks):
        agreed = r["agreed"]
        assert not agreed.passed and agreed.max_abs_err == 1.0
        assert agreed.baseline_ms == 2.0 and agreed.optimized_ms == 2.0 and agreed.speedup == 1.0
        assert agreed.note == ("on rank 1 of 2: rank 1's note" if rank == 0 else "rank 1's note")
    # DDP keeps the replicas equal
    for name, p in ranks[0]["wrapped_first"]["params"].items():
        torch.testing.assert_close(ranks[1]["wrapped_first"]["params"][name], p, atol=0, rtol=0)


@pytest.mark.xdist_group("distributed")
def test_fsdp2_optimize_before_or_after_fully_shard(both: list[dict[str, Any]]) -> None:
    ranks = [r["fsdp"] | {"start": r["start"]} for r in both]
    for r in ranks:
        _same_training(r["sharded_first"], r["eager"], r["start"])
        # optimized unsharded, then sharded: the first call after fully_shard says the check did not
        # measure the sharded step, once, and the original call runs (no solforge op in the steps);
        # sharded first, nothing to say
        _same_training(r["optimized_first"], r["eager"], r["start"], ran=False)
        assert len(r["optimized_first"]["sharding_warnings"]) == 1 and not r["sharded_first"]["sharding_warnings"]
    assert ranks[0]["eager"]["losses"] != ranks[1]["eager"]["losses"]  # each rank trained on its own data


def test_a_class_swap_to_an_fsdp_unit_after_optimize_runs_the_original_and_warns_once() -> None:
    """What fully_shard does to a module (its class becomes an FSDPModule subclass), seen by the
    installed call without the processes above: from the first call after the swap the original
    call runs (the optimized one was never measured sharded), with a warning at that call, none
    before or after it; a model that was sharded already when it was optimized keeps its call."""
    from torch.distributed.fsdp import FSDPModule

    from solforge.runtime.inplace import SHARDED_AFTER_WARNING, SolforgeCall

    def unit(cls: type) -> type:  # as fully_shard makes it
        return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})

    model = Net()
    x = torch.randn(3, H)
    optimized = object()  # what the stand-in optimized call returns
    call = SolforgeCall(lambda x: optimized, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(x) is optimized
    model.__class__ = unit(Net)
    with pytest.warns(UserWarning) as caught:
        torch.testing.assert_close(call(x), Net.forward(model, x))
    assert [str(w.message) for w in caught] == [SHARDED_AFTER_WARNING] and call.unvouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(call(x), Net.forward(model, x))
        sharded = Net()
        sharded.__class__ = unit(Net)
        again = SolforgeCall(lambda x: optimized, sharded)
        sharded.__class__ = unit(Net)  # another class swap of a model sharded when optimized
        assert again(x) is optimized and not again.unvouched
