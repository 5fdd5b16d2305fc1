"""Test setup. Triton's interpreter runs the kernels when there is no GPU; it must be switched on
before triton is imported anywhere, hence here. With a GPU, the same tests run on it."""

import os

# tools/gpu_tests.sh on a host of several GPUs: each pytest-xdist worker takes one of $PYTEST_GPUS in
# turn (set before torch starts CUDA), so one run's workers spread over the GPUs and share its files
if os.environ.get("PYTEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER"):
    _gpus = os.environ["PYTEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_gpus)]

import pytest  # noqa: E402
import torch  # noqa: E402

from solforge import settings  # noqa: E402
from solforge.kernels import registry  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the hand-written families: tests of one family's matching leave solforge's generator out (it
# takes whatever memory-bound region the families leave, which those tests do not count)
HAND_WRITTEN = tuple(f for f in registry.forward_names() if f != "generated")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Under pytest-xdist each worker's torch would start a thread per core: N workers on N cores would
# run N x N threads. Each gets its share of the cores instead.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    # and so do the processes the tests start (tuning workers, bench scripts, Ray actors): off the GPU
    # their torch would start a thread per core beside the other workers' (the smoke run of
    # bench/trainer.py: 53 s in the suite, 32 s alone)
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(_share))
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The GPU tests with the largest shapes (vocabulary-sized logits and their references): under
# pytest-xdist with `--dist loadgroup` they run one after another on one worker. At -n 8 on an H100,
# test_qwen3_vocab_on_gpu's 28 GB next to another worker's 42 GB ran the GPU out of memory.
large_gpu_memory = pytest.mark.xdist_group("gpu_memory")


@pytest.fixture(autouse=True)
def _give_back_large_gpu_memory(request: pytest.FixtureRequest):
    """After a large_gpu_memory test, its worker returns the cached blocks to the GPU, so the other
    workers can use them while this one runs its next tests."""
    yield
    marker = request.node.get_closest_marker("xdist_group")
    if marker is not None and marker.args[:1] == ("gpu_memory",) and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles models with its own backends: start every test with dynamo's caches
    empty so earlier compilations never count against the recompile limit. Training captures an
    earlier test kept alive (its model not yet collected) are not counted in this one's memory rule
    (runtime/traingraphs.py counts every kept capture's pool)."""
    from solforge.runtime import traingraphs

    torch.compiler.reset()
    traingraphs._HOLDING.clear()
    yield


@pytest.fixture(scope="session")
def _shared_lowerings(tmp_path_factory: pytest.TempPathFactory):
    """One lowering cache for the whole run, shared by pytest-xdist's workers: the tiny models many
    tests optimize are traced to ATen once, not once per test or per worker (entries are keyed by
    the graph, inputs, versions and solforge's source, checksummed, and written by a rename, so
    concurrent writers are safe; test_capture_cache tests the cache itself in directories of its
    own). Which test traces a graph first already depends on the workers' scheduling."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = base.parent / "lowered"  # the run's directory, above each worker's own
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("lowered")


@pytest.fixture(autouse=True)
def _private_kernel_db(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory,
                       _shared_lowerings):
    """No test reads or writes the real ~/.cache/solforge/kernels.db: each gets an empty one (the
    environment for the processes a test starts; this process read its settings once already)."""
    path = tmp_path_factory.mktemp("kernel-db") / "kernels.db"
    monkeypatch.setenv("SOLFORGE_DB", str(path))
    monkeypatch.setenv("SOLFORGE_LOWERING_DIR", str(_shared_lowerings))
    # Off the GPU a family's generated alternative is tuned and verified but never chosen (the
    # interpreter's times rank nothing: integrate/select.py): the whole-model CPU tests leave it out,
    # test_alternatives.py turns it on (and a GPU run keeps the default).
    alternatives = torch.cuda.is_available()
    monkeypatch.setenv("SOLFORGE_GENERATED_ALTERNATIVES", str(int(alternatives)))
    with settings.override(db=path, lowering_dir=_shared_lowerings, generated_alternatives=alternatives):
        yield


@pytest.fixture
def on_device():
    """Tensors a test makes without naming a device go to DEVICE (the GPU when there is one), so
    a test written with plain torch.randn runs its kernels on the GPU there."""
    with torch.device(DEVICE):
        yield


# A sweep over a family's config space runs whole on a GPU, where a config costs milliseconds. Through
# Triton's interpreter (CI: 2 cores, no GPU) a config costs seconds, so there the sweep runs a covering
# sample: `first`, then each config that brings a field value not yet run within its variant, so every
# variant and every value of every field of it runs at least once. SOLFORGE_FULL_SWEEPS=1 runs them whole,
# and so does SOLFORGE_CODEGEN_FULL=1 (the GPU runs' switch for the codegen tests' schedules): one
# switch runs every sampled sweep whole.
FULL_SWEEPS = torch.cuda.is_available() or os.environ.get("SOLFORGE_FULL_SWEEPS") == "1" or \
    os.environ.get("SOLFORGE_CODEGEN_FULL", "") not in ("", "0")


def covering(configs, first=(), ignore=()):
    """The configs a sweep runs here: all of them with FULL_SWEEPS, else a covering sample (above);
    fields in `ignore` only size the same work differently (a program count) and need no value each."""
    import dataclasses

    configs = list(dict.fromkeys([*first, *configs]))
    if FULL_SWEEPS:
        return configs
    seen: set = set()
    out = []
    for i, c in enumerate(configs):
        variant = getattr(c, "variant", None)
        values = {(type(c).__name__, variant, f.name, getattr(c, f.name)) for f in dataclasses.fields(c)
                  if f.name not in ignore}
        if i < len(first) or not values <= seen:
            out.append(c)
            seen |= values
    return out


def alternating(items, turn: int, keep: int = 1) -> list:
    """The items a parametrized case runs here: all of them with FULL_SWEEPS, else the first `keep`
    and every other one after them, from the first (turn even) or the second (turn odd). Two cases
    whose turns differ by one (the two dtypes of one shape) run every item between them."""
    items = list(items)
    if FULL_SWEEPS:
        return items
    return items[:keep] + items[keep:][turn % 2::2]
