"""Device ceilings: copy bandwidth and bf16/fp32 matmul rates, measured once per device and cached.

Cached as JSON in `~/.cache/solforge/ceilings/<device name>.json`; the folder can be moved with
the SOLFORGE_CEILINGS_DIR environment variable (solforge/settings.py) or the `cache_dir` argument (tests use both).
On a GPU: a 1 GiB device-to-device copy (bytes read + written, as BASELINES.md counts them:
3.02 TB/s on an H100 80GB HBM3) and 8192^3 matmuls (745 TFLOP/s bf16 there). On the CPU a small
copy and matmul stand in, labelled not meaningful: a CPU run only exercises the code path.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from solforge import settings
from solforge.records import Ceilings, from_dict, to_dict


def cache_dir(override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    configured = settings.current().ceilings_dir  # SOLFORGE_CEILINGS_DIR
    return configured if configured is not None else Path.home() / ".cache" / "solforge" / "ceilings"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu {platform.processor() or platform.machine()}"


def cache_file(device: str, override: str | Path | None = None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", device_name(device)).strip("_") or "device"
    return cache_dir(override) / f"{slug}.json"


def get_ceilings(device: str, *, cache: str | Path | None = None, remeasure: bool = False) -> Ceilings:
    """The cached ceilings of this device, measuring (and caching) them the first time."""
    path = cache_file(device, cache)
    if not remeasure and path.is_file():
        try:
            c = from_dict(Ceilings, json.loads(path.read_text()))
            if c.device == device_name(device) and min(c.copy_gbs, c.bf16_tflops, c.fp32_tflops) > 0:
                return c
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache is measured again
    c = measure(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(to_dict(c), indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs a re-measure next time, nothing else
    return c


def _seconds(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200)) / 1e3  # median ms
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(device: str) -> Ceilings:
    gpu = device == "cuda"
    copy_bytes = (1 << 30) if gpu else (32 << 20)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_gbs = 2 * copy_bytes / _seconds(lambda: dst.copy_(src), device) / 1e9
    rates = {}
    for dt in (torch.bfloat16, torch.float32):
        n = 8192 if gpu else 256
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        rates[dt] = 2 * n**3 / _seconds(lambda a=a, b=b: a @ b, device) / 1e12
        del a, b
    if gpu:
        torch.cuda.empty_cache()
    return Ceilings(
        device=device_name(device), copy_gbs=copy_gbs, bf16_tflops=rates[torch.bfloat16],
        fp32_tflops=rates[torch.float32], meaningful=gpu,
        measured=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), torch=torch.__version__,
    )
