"""Runners: where candidates are built, verified and timed. Same interface, three implementations
(docs/design.md, Runners):

- `local`: in this process (the default). Fast to start; a candidate that crashes the process or
  poisons the CUDA context takes the tune down with it.
- `process`: one worker process per GPU (`gpus`), each measuring one candidate at a time. A
  candidate that hangs (past `timeout_s`), kills its process (segfault, abort) or loses the CUDA
  context becomes a failure record with its reason, and the tune goes on in a fresh worker.
  Without a GPU the workers run Triton's interpreter, so this path is tested on any machine.
- `ray[:ADDRESS]`: one Ray actor per GPU of a Ray cluster (a local one when no address is given),
  for users who outgrow one machine; failures are isolated the same way.

Any runner can be given a `Builder`: worker processes that only compile (Triton's on-disk cache
then serves the measuring worker), so compilation runs in parallel while timing stays one
candidate at a time per GPU.

Every runner returns the same records for the same candidates (verdicts are deterministic;
times are measurements): `measure(cands)` yields one TuningRecord per candidate, in completion
order, and never raises for a bad candidate. `confirm(cands)` times a tune's finalists again side
by side, on one GPU, one RunResult each in order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from solforge import settings
from solforge.errors import UserError
from solforge.records import BuildResult, Candidate, RunResult, TuningRecord, Verdict, from_dict, to_dict

RUNNERS = ("local", "process", "ray")
STARTUP_S = 300.0  # importing torch + triton (+ CUDA init) in a fresh worker on a loaded 2-core CI box


class Runner(Protocol):
    name: str
    parallelism: int  # candidates measured at once (the search proposes batches of this size)

    def measure(self, cands: Sequence[Candidate]) -> Iterator[TuningRecord]: ...
    def confirm(self, cands: Sequence[Candidate]) -> list[RunResult]:
        """Verified candidates of one workload timed again side by side on one GPU (the tune's
        finalists, tune.confirm_times); a RunResult with its error for one that could not run."""
        ...
    def close(self) -> None: ...


def failure(cand: Candidate, stage: str, reason: str) -> TuningRecord:
    """A failure record blamed on the stage it happened in (build, verify or time)."""
    if stage == "build":
        return TuningRecord(cand, BuildResult(False, error=reason))
    if stage == "verify":
        return TuningRecord(cand, BuildResult(True), Verdict(False, reason=reason))
    return TuningRecord(cand, BuildResult(True), Verdict(True, trials=0), RunResult(error=reason))


# ----------------------------------------------------------------------------------------------
# One worker process


class _Worker:
    """One `solforge.tune.worker` process, restarted after it dies or hangs."""

    def __init__(self, mode: str, device: str, gpu: int | None, timeout_s: float, seed: int = 0) -> None:
        self.mode, self.device, self.gpu, self.timeout_s, self.seed = mode, device, gpu, timeout_s, seed
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self._buf = b""
        self.started = 0  # processes started (1 + restarts)

    def _env(self) -> dict[str, str]:
        # every setting as this process has it (an override included): the worker builds the kernels
        # the database keys by these settings
        env = dict(os.environ) | settings.current().as_env()
        # the worker imports exactly what this process imports (editable installs, test fakes)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if self.device == "cuda" and self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        if self.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        return env

    def _start(self) -> str | None:
        """Start the process and wait for it to be ready; the reason when it could not start."""
        if self.log is not None:  # the last process's log: its tail was read when it died
            self.log.unlink(missing_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"solforge-{self.mode}-", suffix=".log")
        self.log = Path(name)
        self._buf = b""
        self.started += 1
        # -P: `-m` would put the working directory first on sys.path, and a file there named like a
        # module torch imports (typing_extensions.py, numpy.py) would be imported instead; what this
        # process imports comes through PYTHONPATH (_env)
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-X", "faulthandler", "-m", "solforge.tune.worker", self.mode, self.device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, env=self._env())
        os.close(fd)
        line = self._readline(STARTUP_S)
        if isinstance(line, bytes) and b'"ready"' in line:
            return None
        self.kill()
        return f"the {self.mode} worker did not start: {self._log_tail() or 'no output'}"

    def _readline(self, timeout: float) -> bytes | str:
        """The next protocol line, "timeout" or "eof"."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return "timeout"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "eof"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _log_tail(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()] \
                if self.log else []
        except OSError:
            return ""
        # faulthandler's "Fatal Python error: ..." names a crash better than the stack under it
        fatal = [ln for ln in lines if ln.startswith("Fatal Python error")]
        return (fatal[-1] if fatal else lines[-1] if lines else "")[:300]

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self.proc = None

    def close(self) -> None:
        self.kill()
        if self.log is not None:
            self.log.unlink(missing_ok=True)

    def request(self, cand: Candidate) -> TuningRecord:
        """Run one candidate in the worker; a hang, crash or lost worker becomes a failure record."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            why = self._start()
            if why is not None:
                return failure(cand, "build", why)
        assert self.proc is not None and self.proc.stdin is not None
        stage = "build"
        try:
            self.proc.stdin.write((json.dumps({"candidate": to_dict(cand), "seed": self.seed}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died(cand, stage)
        deadline = time.monotonic() + self.timeout_s
        while True:
            line = self._readline(deadline - time.monotonic())
            if line == "timeout":
                self.kill()
                return failure(cand, stage, f"hung: no result after {self.timeout_s:g} s in {stage}; "
                               "the worker was killed and the tune goes on in a fresh one")
            if line == "eof":
                return self._died(cand, stage)
            assert isinstance(line, bytes)
            msg = json.loads(line)
            if "stage" in msg:
                stage = msg["stage"]
            elif "record" in msg:
                return from_dict(TuningRecord, msg["record"])

    def confirm(self, cands: Sequence[Candidate]) -> list[RunResult]:
        """The worker times `cands` side by side; a hang, crash or lost worker is every result's error."""
        def failed(why: str) -> list[RunResult]:
            return [RunResult(error=why[:300]) for _ in cands]

        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            why = self._start()
            if why is not None:
                return failed(why)
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"confirm": [to_dict(c) for c in cands], "seed": self.seed})
                                   + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.kill()
            return failed("the worker died before the finalists' timing")
        deadline = time.monotonic() + self.timeout_s
        while True:
            line = self._readline(deadline - time.monotonic())
            if line in ("timeout", "eof"):
                tail = self._log_tail() if line == "eof" else ""
                self.kill()
                return failed(f"the finalists' timing {'hung' if line == 'timeout' else 'killed the worker'}"
                              + (f": {tail}" if tail else ""))
            assert isinstance(line, bytes)
            msg = json.loads(line)
            if "confirmed" in msg:
                return [from_dict(RunResult, r) for r in msg["confirmed"]]

    def _died(self, cand: Candidate, stage: str) -> TuningRecord:
        assert self.proc is not None
        code = self.proc.wait()
        tail = self._log_tail()
        self.kill()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return failure(cand, stage, f"the worker died ({how}) in {stage}" + (f": {tail}" if tail else "")
                       + "; the tune goes on in a fresh one")


class _Pool:
    """Workers fed from one queue by one thread each; records come back in completion order."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def run(self, inbox: queue.Queue[Candidate | None], outbox: queue.Queue[TuningRecord]) -> list[threading.Thread]:
        def serve(w: _Worker) -> None:
            while (cand := inbox.get()) is not None:
                try:
                    outbox.put(w.request(cand))
                except Exception as e:  # a bug in the protocol: still a record, the tune goes on
                    w.kill()
                    outbox.put(failure(cand, "build", f"runner error: {type(e).__name__}: {e}"[:300]))

        threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in self.workers]
        for t in threads:
            t.start()
        return threads

    def close(self) -> None:
        for w in self.workers:
            w.close()


# ----------------------------------------------------------------------------------------------
# Builder: parallel compile-only workers


class Builder:
    """`workers` compile-only processes; `build(cands)` yields one build-only TuningRecord per
    candidate in completion order (failed ones carry their reason, built ones the compile time)."""

    def __init__(self, device: str, *, workers: int, timeout_s: float, seed: int = 0,
                 gpus: Sequence[int] | None = None) -> None:
        if workers < 1:
            raise UserError(f"--build-workers must be at least 1 (got {workers})")
        ids = list(gpus) if gpus else [None]
        self.pool = _Pool([_Worker("build", device, ids[i % len(ids)], timeout_s, seed) for i in range(workers)])

    def build(self, cands: Sequence[Candidate]) -> Iterator[TuningRecord]:
        inbox: queue.Queue[Candidate | None] = queue.Queue()
        outbox: queue.Queue[TuningRecord] = queue.Queue()
        for c in cands:
            inbox.put(c)
        for _ in self.pool.workers:
            inbox.put(None)
        self.pool.run(inbox, outbox)
        for _ in cands:
            yield outbox.get()

    def close(self) -> None:
        self.pool.close()


def _with_build_time(rec: TuningRecord, built: TuningRecord | None) -> TuningRecord:
    """The measuring worker's build is a cache hit: report the builder's compile time with it."""
    if built is None or not rec.build.ok:
        return rec
    return dataclasses.replace(rec, build=BuildResult(True, built.build.seconds + rec.build.seconds))


# ----------------------------------------------------------------------------------------------
# The three runners


class LocalRunner:
    name = "local"
    parallelism = 1

    def __init__(self, device: str, *, builder: Builder | None = None, seed: int = 0) -> None:
        self.device, self.builder, self.seed = device, builder, seed

    def measure(self, cands: Sequence[Candidate]) -> Iterator[TuningRecord]:
        from solforge.tune.measuring import family_module, measure

        built: Iterator[TuningRecord] = self.builder.build(cands) if self.builder else \
            (TuningRecord(c, BuildResult(True)) for c in cands)
        for b in built:
            if not b.build.ok:
                yield b
                continue
            rec = measure(family_module(b.candidate.workload.family), b.candidate, device=self.device, seed=self.seed)
            yield _with_build_time(rec, b if self.builder else None)

    def confirm(self, cands: Sequence[Candidate]) -> list[RunResult]:
        from solforge.tune.measuring import confirm_times

        return confirm_times(cands, device=self.device, seed=self.seed)

    def close(self) -> None:
        if self.builder is not None:
            self.builder.close()


class ProcessRunner:
    name = "process"

    def __init__(self, device: str, *, gpus: Sequence[int] | None = None, timeout_s: float = 120.0,
                 builder: Builder | None = None, seed: int = 0) -> None:
        ids: list[int | None] = list(gpus) if gpus else [None]
        self.pool = _Pool([_Worker("measure", device, g, timeout_s, seed) for g in ids])
        self.parallelism = len(ids)
        self.builder = builder

    def measure(self, cands: Sequence[Candidate]) -> Iterator[TuningRecord]:
        inbox: queue.Queue[Candidate | None] = queue.Queue()
        outbox: queue.Queue[TuningRecord] = queue.Queue()
        builds: dict[Candidate, TuningRecord] = {}

        def feed() -> None:
            source = self.builder.build(cands) if self.builder else (TuningRecord(c, BuildResult(True)) for c in cands)
            for b in source:
                if b.build.ok:
                    builds[b.candidate] = b
                    inbox.put(b.candidate)
                else:
                    outbox.put(b)
            for _ in self.pool.workers:
                inbox.put(None)

        threading.Thread(target=feed, daemon=True).start()
        self.pool.run(inbox, outbox)
        for _ in cands:
            rec = outbox.get()
            yield _with_build_time(rec, builds.get(rec.candidate) if self.builder else None)

    def confirm(self, cands: Sequence[Candidate]) -> list[RunResult]:
        """On the first worker's GPU: side by side means one GPU."""
        return self.pool.workers[0].confirm(cands)

    @property
    def restarts(self) -> int:
        return sum(max(0, w.started - 1) for w in self.pool.workers)

    def close(self) -> None:
        self.pool.close()
        if self.builder is not None:
            self.builder.close()


class _RayMeasurer:
    """The Ray actor: measures candidates in its own process (one GPU each)."""

    def __init__(self, device: str, seed: int) -> None:
        self.device, self.seed = device, seed

    def measure(self, cand: dict[str, Any]) -> dict[str, Any]:
        from solforge.tune.measuring import family_module, measure

        c = from_dict(Candidate, cand)
        return to_dict(measure(family_module(c.workload.family), c, device=self.device, seed=self.seed))

    def confirm(self, cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from solforge.tune.measuring import confirm_times

        got = confirm_times([from_dict(Candidate, c) for c in cands], device=self.device, seed=self.seed)
        return [to_dict(r) for r in got]


class RayRunner:
    name = "ray"

    def __init__(self, device: str, *, address: str | None = None, gpus: Sequence[int] | None = None,
                 timeout_s: float = 120.0, seed: int = 0, workers: int | None = None) -> None:
        try:
            import ray
        except ImportError as e:
            raise UserError("--runner ray needs Ray: pip install 'solforge[ray]'") from e
        self.ray, self.device, self.timeout_s, self.seed = ray, device, timeout_s, seed
        self._owns = not ray.is_initialized()
        if self._owns:
            env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            # the switches that change kernels, as the database keys them (paths are this machine's)
            env |= settings.current().as_env(kernels_only=True)
            if device == "cpu":
                env["TRITON_INTERPRET"] = "1"
            try:
                ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": env}, **({} if address else {"num_cpus": max(2, workers or 1)}))
            except Exception as e:
                raise UserError(f"could not start or reach a Ray cluster at {address or 'local'}: "
                                f"{type(e).__name__}: {e}".splitlines()[0]) from e
        if workers is None:
            workers = len(gpus) if gpus else (int(ray.cluster_resources().get("GPU", 0)) if device == "cuda" else 1)
        if workers < 1:
            raise UserError("the Ray cluster has no GPUs: start it with GPUs, or use --device cpu")
        self.parallelism = workers
        opts = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        self._cls = ray.remote(**opts)(_RayMeasurer)
        self.actors = [self._new() for _ in range(workers)]

    def _new(self) -> Any:
        return self._cls.remote(self.device, self.seed)

    def measure(self, cands: Sequence[Candidate]) -> Iterator[TuningRecord]:
        ray = self.ray
        todo = list(cands)
        free = list(range(len(self.actors)))
        running: dict[Any, tuple[int, Candidate, float]] = {}
        while todo or running:
            while todo and free:
                i, c = free.pop(), todo.pop(0)
                running[self.actors[i].measure.remote(to_dict(c))] = (i, c, time.monotonic())
            first = min(t for _, _, t in running.values())
            done, _ = ray.wait(list(running), num_returns=1,
                               timeout=max(0.0, first + self.timeout_s - time.monotonic()))
            for ref in done:
                i, c, _ = running.pop(ref)
                free.append(i)
                try:
                    yield from_dict(TuningRecord, ray.get(ref))
                except Exception as e:  # the actor died: a fresh one takes its place
                    self.actors[i] = self._new()
                    yield failure(c, "build", f"the Ray worker died: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}"[:300])
            for ref, (i, c, t) in list(running.items()):
                if time.monotonic() - t > self.timeout_s:  # hung: kill it, a fresh actor takes its place
                    running.pop(ref)
                    ray.kill(self.actors[i])
                    self.actors[i] = self._new()
                    free.append(i)
                    yield failure(c, "build", f"hung: no result after {self.timeout_s:g} s (stage unknown "
                                  "under Ray); the worker was killed and the tune goes on in a fresh one")

    def confirm(self, cands: Sequence[Candidate]) -> list[RunResult]:
        """On the first actor's GPU; a hang past the timeout or a dead actor is every result's error."""
        ref = self.actors[0].confirm.remote([to_dict(c) for c in cands])
        try:
            return [from_dict(RunResult, r) for r in self.ray.get(ref, timeout=self.timeout_s)]
        except Exception as e:
            self.ray.kill(self.actors[0])
            self.actors[0] = self._new()
            first = str(e).splitlines()[0] if str(e) else ""
            why = f"the finalists' timing failed under Ray: {type(e).__name__}: {first}"
            return [RunResult(error=why[:300]) for _ in cands]

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self._owns:
            self.ray.shutdown()


def parse_gpus(text: str | None) -> list[int] | None:
    """`--gpus 0,1` -> [0, 1]; a clear error for anything else."""
    if text is None:
        return None
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"--gpus takes GPU indices separated by commas, e.g. 0,1 (got {text!r})") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise UserError(f"--gpus takes distinct non-negative GPU indices, e.g. 0,1 (got {text!r})")
    return ids


def check_spec(spec: str) -> str:
    """The runner kind of `spec`, or a UserError that says what to write."""
    kind = spec.partition(":")[0]
    if kind not in RUNNERS:
        raise UserError(f"unknown runner {spec!r}: use local, process or ray[:ADDRESS]")
    return kind


def make_runner(spec: str, *, device: str, gpus: Sequence[int] | None = None, timeout_s: float = 120.0,
                build_workers: int = 0, seed: int = 0) -> Runner:
    """`local`, `process` or `ray[:ADDRESS]`; `build_workers` > 0 adds a parallel compile-only Builder."""
    kind, _, address = check_spec(spec), *spec.partition(":")[1:]
    if gpus and device == "cuda":
        import torch

        n = torch.cuda.device_count()
        bad = [g for g in gpus if g >= n]
        if bad and kind != "ray":
            raise UserError(f"--gpus {','.join(map(str, gpus))}: this machine has {n} GPU(s) (0..{n - 1})")
    if kind == "local" and gpus and len(gpus) > 1:
        raise UserError("--gpus with several GPUs needs --runner process (or ray): the local runner uses one")
    builder = Builder(device, workers=build_workers, timeout_s=timeout_s, seed=seed, gpus=gpus) \
        if build_workers else None
    if kind == "local":
        return LocalRunner(device, builder=builder, seed=seed)
    if kind == "process":
        return ProcessRunner(device, gpus=gpus, timeout_s=timeout_s, builder=builder, seed=seed)
    if builder is not None:
        builder.close()
        raise UserError("--build-workers works with the local and process runners; Ray actors build themselves")
    return RayRunner(device, address=address or None, gpus=gpus, timeout_s=timeout_s, seed=seed)
