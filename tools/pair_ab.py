"""Decided kernels/reduce.py's row sums in one reduction and layernorm_bwd's 8 warps with the residual gradient:
kernels A/B against an earlier commit's, in one process.

GPU A/B in one process: the norm backwards and rope against their kernels at an earlier commit.

    python tools/pair_ab.py --export REV DIR     # on a git checkout: REV's kernels, renamed to load beside ours
    python tools/pair_ab.py --old DIR [--out FILE] [--only rmsnorm_bwd,layernorm_bwd,rope_bwd,rope]

Written to measure one change (the row sums of rmsnorm_bwd, layernorm_bwd and rope's norm taken in
one `tl.reduce` each, kernels/reduce.py) against the kernels before it, config for config, each
pair timed back to back (medians of do_bench, L2 flushed), so a drift of the clocks hits both.
Every output of both is checked against the fp32 reference first. A device-to-device copy of one
of the case's tensors is timed in the same run. Each case starts with one discarded timing: in the
first runs, the first config of a case measured up to 2x slower than when timed again later.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import bench_us, provenance, write_json  # noqa: E402

FILES = ("rmsnorm_bwd", "layernorm_bwd", "rope", "rope_bwd")


def export(rev: str, out: Path) -> None:
    """REV's kernel files as old_<name>.py in `out`, their ops in a library of their own
    ("solforge_old"), importing each other rather than ours."""
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        s = subprocess.run(["git", "show", f"{rev}:solforge/kernels/{name}.py"], check=True, capture_output=True,
                           text=True).stdout
        s = s.replace('Library("solforge", "FRAGMENT")', 'Library("solforge_old", "FRAGMENT")')
        s = s.replace('"solforge::', '"solforge_old::').replace("torch.ops.solforge.", "torch.ops.solforge_old.")
        s = s.replace("from solforge.kernels import rope as _rope", "import old_rope as _rope")
        s = s.replace("from solforge.kernels.rope import (", "from old_rope import (")
        s = s.replace("from solforge.kernels.rmsnorm_bwd import", "from old_rmsnorm_bwd import")
        s = s.replace("from solforge.kernels import rope_bwd as _bwd", "import old_rope_bwd as _bwd")
        (out / f"old_{name}.py").write_text(s)


def pair(old: Callable[[], Any], new: Callable[[], Any]) -> tuple[float, float]:
    return round(bench_us(old), 2), round(bench_us(new), 2)


def copy_TBps(t: torch.Tensor) -> float:  # noqa: N802
    dst = torch.empty_like(t)
    return round(2 * t.numel() * t.element_size() / bench_us(lambda: dst.copy_(t)) / 1e6, 3)


def ok(out: Any, ref: Any) -> bool:
    from solforge.numerics import compare

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs, strict=True):
        if o.dim() == 1:  # a weight gradient: a sum over every row
            if (o.float() - r.float()).abs().max() > 1e-2 * r.float().abs().max():
                return False
        elif not compare(o.to(r.dtype), r).ok:
            return False
    return True


def rows_case(fam: str, old: Any, new: Any, rows: int, H: int, with_ds: bool, configs: list[Any]) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, ds = (torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    ds = ds if with_ds else None
    if fam == "rmsnorm_bwd":
        ref = new.rmsnorm_bwd_ref(dy, x, w, 1e-6, round_before_weight=True, ds=ds)

        def run(mod: Any, c: Any) -> Any:
            return mod.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, ds=ds, config=c)
    else:
        ref = new.layernorm_bwd_ref(dy, x, w, 1e-5, ds=ds, bias_grad=True)

        def run(mod: Any, c: Any) -> Any:
            return mod.layernorm_bwd(dy, x, w, 1e-5, ds=ds, bias_grad=True, config=c)
    nbytes = (4 if with_ds else 3) * x.numel() * 2
    res: dict[str, Any] = {"family": fam, "shape": [rows, H], "ds": with_ds, "bytes": nbytes,
                           "copy_TBps": copy_TBps(x), "configs": {}}
    bench_us(lambda: run(new, configs[0]))  # warm-up, discarded: the first timing of a case ran slow
    for c in configs:
        oc = type(c).__module__  # the old module's own class for the same fields
        c_old = getattr(old, type(c).__name__)(**dataclasses.asdict(c))
        try:
            if not (ok(run(old, c_old), ref) and ok(run(new, c), ref)):
                res["configs"][c.encode()] = "WRONG"
                continue
            t_old, t_new = pair(lambda c=c_old: run(old, c), lambda c=c: run(new, c))
            res["configs"][c.encode()] = {"old_us": t_old, "new_us": t_new,
                                          "new_TBps": round(nbytes / t_new / 1e6, 3)}
        except Exception as e:  # a config one of them cannot build: recorded, the run goes on
            res["configs"][c.encode()] = f"{type(e).__name__} ({oc}): {str(e)[:100]}"
        print(c.encode(), res["configs"][c.encode()], flush=True)
    return res


def rope_case(bwd: bool, old_r: Any, old_b: Any, B: int, S: int, configs: list[str]) -> dict[str, Any]:
    from rope_bwd_sweep import qwen3_inputs

    from solforge.kernels import rope as R
    from solforge.kernels import rope_bwd as RB

    Hq, Hk, D = 32, 8, 128
    q, k, cos, sin, qw, kw = qwen3_inputs(B, S, Hq, Hk, D, cos_batch=B)
    opts = dict(norm=True, round_before_weight=True, heads_first=True)
    qo, ko = R.rope(q, k, cos, sin, qw, kw, 1e-6, **opts)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    if bwd:
        ref = RB.rope_bwd_ref(gq, gk, q, k, cos, sin, qw, kw, 1e-6, **opts)
        nbytes = 3 * (q.numel() + k.numel()) * 2

        def run(mod: Any, c: str) -> Any:
            m, cfg = (RB, R.Config) if mod is None else (old_b, old_r.Config)
            return m.grads(gq, gk, q, k, cos, sin, qw, kw, 1e-6, config=cfg.decode(c), **opts)
    else:
        ref = R.rope_ref(q, k, cos, sin, qw, kw, 1e-6, out_dtype=torch.bfloat16, **opts)
        nbytes = 2 * (q.numel() + k.numel()) * 2

        def run(mod: Any, c: str) -> Any:
            m = R if mod is None else old_r
            return m.rope(q, k, cos, sin, qw, kw, 1e-6, config=m.Config.decode(c), **opts)
    heur = (R.bwd_heuristic if bwd else R.heuristic)(R.workload_for(q, k, cos, sin, qw, kw, 1e-6, **opts))
    res: dict[str, Any] = {"family": "rope_bwd" if bwd else "rope", "shape": [B, S, Hq, Hk, D], "bytes": nbytes,
                           "heuristic": heur.encode(), "copy_TBps": copy_TBps(q), "configs": {}}
    bench_us(lambda: run(None, heur.encode()))  # warm-up, discarded: the first timing of a case ran slow
    for c in [heur.encode()] + [c for c in configs if c != heur.encode()]:
        try:
            if not (ok(run(old_r, c), ref) and ok(run(None, c), ref)):
                res["configs"][c] = "WRONG"
                continue
            t_old, t_new = pair(lambda c=c: run(old_r, c), lambda c=c: run(None, c))
            res["configs"][c] = {"old_us": t_old, "new_us": t_new, "new_TBps": round(nbytes / t_new / 1e6, 3)}
        except Exception as e:
            res["configs"][c] = f"{type(e).__name__}: {str(e)[:100]}"
        print(c, res["configs"][c], flush=True)
    return res


def rms_configs(H: int) -> list[Any]:
    from solforge.kernels.rmsnorm_bwd import BwdConfig, bwd_heuristic

    out = [bwd_heuristic(16384, H, "cuda")]
    if H > 1024:
        out += [BwdConfig(r, p, w, 0, 2, 1) for r, p, w in ((1, 1, 16), (2, 2, 8), (1, 2, 8), (4, 1, 16), (1, 4, 4))]
    else:
        out += [BwdConfig(r, p, w, 0, 2, 0) for r, p, w in ((16, 8, 2), (8, 4, 1), (32, 4, 4))]
    return list(dict.fromkeys(out))


def ln_configs(H: int, ds: bool) -> list[Any]:
    from solforge.kernels.layernorm_bwd import BwdConfig, bwd_heuristic

    out = [bwd_heuristic(16384, H, "cuda", ds=ds)]
    out += [BwdConfig(r, p, w, 4096, 0, 2, 1) for r, p, w in ((1, 2, 8), (2, 1, 16), (1, 1, 16), (1, 4, 4))]
    out += [BwdConfig(1, 2, 8, 2048, 512, 2, 1)]
    return list(dict.fromkeys(out))


ROPE_BWD = ["tile:t=16:h=1:w=8:p=4", "tile:t=16:h=1:w=4:p=4", "tile:t=4:h=4:w=4:p=4:s=2",
            "tile:t=8:h=4:w=4:p=4:s=2", "tile:t=16:h=1:w=4:p=8"]
ROPE_FWD = ["tile:t=4:h=8:w=8", "tile:t=16:h=2:w=4:p=4:s=2"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", nargs=2, metavar=("REV", "DIR"))
    p.add_argument("--old", metavar="DIR")
    p.add_argument("--out")
    p.add_argument("--only", default="rmsnorm_bwd,layernorm_bwd,rope_bwd,rope")
    a = p.parse_args()
    if a.export:
        export(a.export[0], Path(a.export[1]))
        return 0
    if not a.old:
        p.error("--old DIR (made by --export) is required")
    sys.path.insert(0, str(Path(a.old).resolve()))
    from solforge.kernels import layernorm_bwd as LB
    from solforge.kernels import rmsnorm_bwd as RB

    old = {n: importlib.import_module(f"old_{n}") for n in FILES}
    only = a.only.split(",")
    res: dict[str, Any] = {**provenance(), "cases": []}
    todo: list[Callable[[], dict[str, Any]]] = []
    if "rmsnorm_bwd" in only:
        todo += [lambda r=r, H=H, ds=ds: rows_case("rmsnorm_bwd", old["rmsnorm_bwd"], RB, r, H, ds, rms_configs(H))
                 for r, H, ds in ((16384, 2560, True), (16384, 2560, False), (4096, 2560, True), (524288, 128, True))]
    if "layernorm_bwd" in only:
        todo += [lambda ds=ds: rows_case("layernorm_bwd", old["layernorm_bwd"], LB, 16384, 2560, ds,
                                         ln_configs(2560, ds)) for ds in (False, True)]
    if "rope_bwd" in only:
        todo += [lambda B=B, S=S: rope_case(True, old["rope"], old["rope_bwd"], B, S, ROPE_BWD)
                 for B, S in ((2, 8192), (1, 4096))]
    if "rope" in only:
        todo += [lambda B=B, S=S: rope_case(False, old["rope"], old["rope_bwd"], B, S, ROPE_FWD)
                 for B, S in ((2, 8192), (1, 4096))]
    for case in todo:
        r = case()
        timed = {k: v for k, v in r["configs"].items() if isinstance(v, dict)}
        if timed:
            bo = min(timed, key=lambda k: timed[k]["old_us"])
            bn = min(timed, key=lambda k: timed[k]["new_us"])
            r["best_old"] = [bo, timed[bo]["old_us"]]
            r["best_new"] = [bn, timed[bn]["new_us"], timed[bn]["new_TBps"]]
        print(json.dumps({k: v for k, v in r.items() if k != "configs"}), flush=True)
        res["cases"].append(r)
        write_json(res, a.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
