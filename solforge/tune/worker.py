"""A tuning worker process: `python -m solforge.tune.worker {measure|build} DEVICE`.

The parent (runners.ProcessRunner) writes one JSON request per line on stdin,
`{"candidate": {...}, "seed": 0}`, and reads JSON lines back on the worker's original stdout:
`{"ready": true}` once imports are done, `{"stage": "build"|"verify"|"time"}` as each stage
starts (so a hang is blamed on its stage), then `{"record": {...}}` (a TuningRecord). A tune's
finalists come as `{"confirm": [candidate, ...], "seed": 0}` and are answered with
`{"confirmed": [RunResult, ...]}` (tune.confirm_times: timed again side by side). Everything
else the worker or Triton prints goes to stderr (a log file the parent reads on a crash).

`measure` builds, verifies and times (tune.measure); `build` only compiles: on a GPU every Triton
launch is turned into a compile (JITFunction.run with warmup=True), which fills Triton's on-disk
cache so the measuring worker's first launch is a cache hit. Builders run in parallel; timing
stays one candidate at a time per GPU.

After a CUDA error (an illegal memory access poisons the whole context) the worker answers and
then exits with CONTEXT_LOST, so the next candidate gets a fresh process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

CONTEXT_LOST = 3
# Error texts after which a CUDA context cannot be trusted (torch/Triton wording).
_FATAL = ("illegal memory access", "unspecified launch failure", "device-side assert", "CUDA error",
          "misaligned address", "an illegal instruction")


def _send(out: TextIO, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def compile_only() -> None:
    """Every Triton launch in this process compiles its kernel and does not run it."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warm(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warm  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    mode, device = argv[0], argv[1]
    # the protocol channel is the original stdout; anything printed (Python or C) goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from solforge.records import Candidate, from_dict, to_dict
    from solforge.tune import confirm_times, family_module, measure

    if mode == "build" and device == "cuda":
        compile_only()
    _send(out, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        seed = int(msg.get("seed", 0))
        if "confirm" in msg:
            got = confirm_times([from_dict(Candidate, c) for c in msg["confirm"]], device=device, seed=seed)
            _send(out, {"confirmed": [to_dict(r) for r in got]})
            if device == "cuda" and any(f in (r.error or "") for r in got for f in _FATAL):
                return CONTEXT_LOST
            continue
        cand = from_dict(Candidate, msg["candidate"])
        family = family_module(cand.workload.family)
        rec = measure(family, cand, device=device, seed=seed, build_only=mode == "build",
                      on_stage=lambda s: _send(out, {"stage": s}))
        _send(out, {"record": to_dict(rec)})
        err = rec.error or ""
        if device == "cuda" and any(f in err for f in _FATAL):
            return CONTEXT_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
