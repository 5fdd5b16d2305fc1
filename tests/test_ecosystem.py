"""The optimized model is the user's model (runtime/inplace.py), its train/eval flags are left as
they were, and solforge is a torch.compile backend (dynamo.py, registration.py)."""

from __future__ import annotations

import copy
import inspect
import io
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import DEVICE
from torch import nn

import solforge
from solforge import dynamo
from solforge.errors import UserError
from solforge.runtime.inplace import TRACED_WARNING, installed

H = 48


class Net(nn.Module):
    """An RMSNorm region between two linears (odd sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, H)
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.down = nn.Linear(H, 13)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.down(self.norm(self.up(x) * scale))


def _x(seed: int) -> torch.Tensor:
    return torch.randn(3, 5, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _solforge_events(fn) -> int:  # type: ignore[no-untyped-def]
    """Calls of solforge's ops while `fn` runs (under the profiler they go through torch.ops). The
    graphs run as they are: on a GPU an optimized model replays a no-grad call from a CUDA graph
    once it was called a few times (runtime/stepgraphs.py), and a replay's kernels are no op
    events the profiler sees."""
    from solforge.runtime.stepgraphs import step_graphs

    with step_graphs(False), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("solforge::"))


# keep_slower: these tests are about the model object, not speed (on a GPU a tiny model's kernels
# may not beat eager, and the guarantee would hand the original back)
KW = {"budget": 1, "max_candidates": 1, "db": False, "profile": "off", "keep_slower": True}


@pytest.fixture(scope="module")
def optimized_net() -> tuple[Net, Net]:
    torch.manual_seed(0)
    model = Net().to(DEVICE)  # a new module is in train mode: optimize(inference) must leave it so
    ref = copy.deepcopy(model)
    out, report = solforge.optimize(model, (_x(0),), make_inputs=lambda s: (_x(s),), **KW)
    assert report.e2e is not None and report.e2e.passed, report.e2e
    assert out is model
    return model, ref


def test_the_model_stays_the_users(optimized_net: tuple[Net, Net]) -> None:
    model, ref = optimized_net
    assert type(model) is Net and installed(model) is not None
    assert list(model.state_dict()) == list(ref.state_dict())  # no _orig_mod. prefix
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert model.training and all(m.training for m in model.modules())  # as it was
    x = _x(5)
    with torch.no_grad():
        assert _solforge_events(lambda: model(x, scale=0.5)) >= 1
        torch.testing.assert_close(model(x, scale=0.5), ref(x, scale=0.5), atol=1e-5, rtol=1e-5)
    assert model.solforge_stats.total >= 1


def test_copies_are_plain_models(optimized_net: tuple[Net, Net]) -> None:
    model, ref = optimized_net
    x = _x(6)
    twin = copy.deepcopy(model)
    assert installed(twin) is None and installed(model) is not None
    assert "solforge_stats" not in twin.__dict__ and "__getstate__" not in twin.__dict__
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is Net and installed(loaded) is None
    with torch.no_grad():
        for plain in (twin, loaded):
            assert _solforge_events(lambda plain=plain: plain(x)) == 0
            torch.testing.assert_close(plain(x), ref(x), atol=0, rtol=0)
    state = io.BytesIO()
    torch.save(model.state_dict(), state)
    state.seek(0)
    fresh = Net().to(DEVICE)
    fresh.load_state_dict(torch.load(state))
    for (n, p), (m, q) in zip(fresh.state_dict().items(), ref.state_dict().items(), strict=True):
        assert n == m and torch.equal(p, q)


def test_restore_and_outer_compile_warn(optimized_net: tuple[Net, Net]) -> None:
    model, ref = optimized_net
    x = _x(7)
    torch._dynamo.reset()  # the earlier tests' graphs of Net.forward do not count towards the limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen: list[int] = []

        def eager(gm: torch.fx.GraphModule, _inputs: list) -> object:
            seen.append(len(gm.graph.nodes))
            return gm.forward

        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend=eager)(x), ref(x), atol=1e-5, rtol=1e-5)
        assert seen and any(TRACED_WARNING in str(w.message) for w in caught)
        caught.clear()
        torch.export.export(model, (x,))
        assert any(TRACED_WARNING in str(w.message) for w in caught)
    call = installed(model)
    assert solforge.restore(model) is model and installed(model) is None
    assert list(model.__dict__).count("_compiled_call_impl") == 0 and "generate" not in model.__dict__
    with torch.no_grad():
        assert _solforge_events(lambda: model(x)) == 0
    from solforge.runtime.inplace import install

    install(model, call)  # the module fixture's model back as it was for any later test
    assert installed(model) is call


def test_train_mode_optimize_leaves_eval_flags() -> None:
    torch.manual_seed(1)
    model = Net().to(DEVICE).eval()
    model.norm.train()  # a mixed set of flags: each comes back as it was
    flags = [m.training for m in model.modules()]
    x = _x(0).requires_grad_(False)
    out, report = solforge.optimize(model, (x,), mode="train", make_inputs=lambda s: (_x(s),), **KW)
    assert out is model and report.e2e is not None and report.e2e.passed, report.e2e
    assert [m.training for m in model.modules()] == flags


def test_dynamo_backend_by_name_runs_solforge_ops() -> None:
    assert "solforge" in torch._dynamo.list_backends()
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = Net().to(DEVICE).eval()
    ref = copy.deepcopy(model)
    before = len(dynamo.history)
    compiled = torch.compile(model, backend="solforge", options={"budget": 1, "max_candidates": 1, "db": False})
    x = _x(3)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=1e-5)
        assert _solforge_events(lambda: compiled(x)) >= 1
    new = list(dynamo.history)[before:]
    assert len(new) == 1 and new[0].solforge_calls() >= 1 and new[0].validated and new[0].error is None
    assert new[0].tuned and new[0].tuned[0].startswith("rmsnorm[")


def test_model_compile_in_place_with_backend_object() -> None:
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = Net().to(DEVICE).eval()
    keys = list(model.state_dict())
    be = solforge.backend(budget=0, db=False)  # no tuning: the family's heuristic config
    model.compile(backend=be)
    x = _x(4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model._call_impl(x), atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == keys
    assert len(be.graphs) == 1 and be.graphs[0].solforge_calls() >= 1 and not be.graphs[0].tuned
    with pytest.raises(UserError, match="unknown solforge backend option"):
        solforge.backend(budgett=1)


def test_import_does_not_import_torch() -> None:
    code = "import sys, solforge; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def optimized_lm():  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.float32, batch=1, seq=8, weights=None, seed=0)
    model = lm.model
    ref = copy.deepcopy(model)
    keys, sig = list(model.state_dict()), inspect.signature(model.forward)
    out, report = solforge.optimize(model, lm.example_inputs, make_inputs=lm.make_inputs, families=("rmsnorm",),
                                    **KW)
    assert out is model and installed(model) is not None and report.e2e is not None and report.e2e.passed
    assert list(model.state_dict()) == keys and inspect.signature(model.forward) == sig
    return lm, ref, report


def test_transformers_model_round_trips(optimized_lm, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """qwen3-tiny (a transformers model) optimized in place: it runs solforge's ops, keeps its eval
    flag, and save_pretrained/from_pretrained gives its weights under its own names."""
    lm, ref, _report = optimized_lm
    model = lm.model
    assert not model.training  # the zoo loads it in eval
    (ids,) = lm.make_inputs(4)
    with torch.no_grad():
        assert _solforge_events(lambda: model(ids)) >= 1
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path)  # on the CPU, wherever the model was saved from
    for (n, p), (m, q) in zip(back.state_dict().items(), ref.state_dict().items(), strict=True):
        assert n == m and torch.equal(p, q.cpu()), n


@pytest.mark.slow
def test_transformers_generate_in_place(optimized_lm) -> None:  # type: ignore[no-untyped-def]
    """The model's own generate (routed: runtime/generation.py) gives the plain model's tokens
    (~30 s on the CPU: the prefill and decode graphs compile through the interpreter)."""
    lm, ref, _report = optimized_lm
    (ids,) = lm.make_inputs(4)
    kw = {"max_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        assert torch.equal(lm.model.generate(ids, **kw), ref.generate(ids, disable_compile=True, **kw))


def test_dynamo_backend_training_gradients() -> None:
    """A training graph: the forward and the backward kernels tuned, the gradients eager's."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = Net().to(DEVICE)
    ref = copy.deepcopy(model)
    be = solforge.backend(budget=1, max_candidates=1, db=False)
    x = _x(8).to(DEVICE)
    torch.compile(model, backend=be)(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert float((p.grad - q.grad).norm() / q.grad.norm()) < 1e-4, name
    (g,) = be.graphs
    assert g.train and sorted(k.split("[")[0] for k in g.tuned) == ["rmsnorm", "rmsnorm_bwd"]
    if DEVICE == "cpu":  # on a GPU a kernel slower than the region at this size is kept out
        assert g.solforge_calls() >= 1 and g.validated


def test_registered_when_dynamo_was_imported_first() -> None:
    code = ("import torch._dynamo, solforge; assert 'solforge' in torch._dynamo.list_backends(); "
            "from torch._dynamo.backends.registry import lookup_backend; "
            "from solforge.registration import _backend; assert lookup_backend('solforge') is _backend")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def test_a_torch_module_is_captured_and_optimized_in_place() -> None:
    """A model whose forward is torch's own (nn.Sequential): dynamo skips such frames, so the call
    is compiled through a frame of solforge's (capture/backend.py compile_call)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H, eps=1e-6)).to(DEVICE).eval()
    ref = copy.deepcopy(model)
    out, report = solforge.optimize(model, (_x(0).to(DEVICE),), make_inputs=lambda s: (_x(s).to(DEVICE),), **KW)
    assert out is model and installed(model) is not None and [r.family for r in report.regions] == ["rmsnorm"]
    x = _x(9).to(DEVICE)
    with torch.no_grad():
        assert _solforge_events(lambda: model(x)) >= 1
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def _norm_paths(model: nn.Module, report: solforge.Report) -> list[str]:
    """The module paths of the report's rmsnorm regions, each checked to name an RMSNorm of `model`."""
    paths = [p for r in report.regions if r.family == "rmsnorm" for p in r.modules]
    for p in paths:
        assert "rmsnorm" in type(model.get_submodule(p)).__name__.lower(), p
    return paths


def test_module_paths_are_the_models_own() -> None:
    """The paths dynamo records (nn_module_stack) name the model's own submodules however its call
    was compiled: a Sequential goes through solforge's wrapper frame (L['call_impl'].__self__...),
    profiling compiles the module (L['fn']...), a custom forward names its self; all read alike."""
    from solforge.capture import SolforgeBackend, capture, compile_with, module_path

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H, eps=1e-6), nn.Linear(H, H), nn.RMSNorm(H, eps=1e-6))
    model = model.to(DEVICE).eval()

    def paths(graphs) -> set[str]:  # type: ignore[no-untyped-def]
        return {p for g in graphs for n in g.aten.graph.nodes if (p := module_path(n)) is not None}

    via_module = SolforgeBackend()
    with torch.no_grad():
        compile_with(model, via_module)(_x(1))
    assert paths(capture(model, (_x(1),)).graphs) == paths(via_module.graphs) == {"0", "1", "2", "3"}
    ref = copy.deepcopy(model)
    out, report = solforge.optimize(model, (_x(0),), make_inputs=lambda s: (_x(s),), **KW)
    assert out is model and sorted(_norm_paths(model, report)) == ["1", "3"]
    x = _x(9)
    with torch.no_grad():
        assert _solforge_events(lambda: model(x)) >= 2
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_transformers_module_paths(optimized_lm) -> None:  # type: ignore[no-untyped-def]
    """qwen3-tiny optimized in place: every RMSNorm of the model (input, post-attention, q/k and the
    final norm) is in a matched rmsnorm region under its own path."""
    lm, _ref, report = optimized_lm
    model = lm.model
    want = {n for n, m in model.named_modules() if "rmsnorm" in type(m).__name__.lower()}
    got = _norm_paths(model, report)
    assert len(want) > 4 and set(got) == want and all(p.startswith("model.") for p in got)


@pytest.mark.parametrize("inplace", [True, False])
def test_inference_optimize_leaves_train_flags(inplace: bool) -> None:
    """optimize(inference) runs the model in eval, and puts every module's flag back as it was: a
    model in train mode with one submodule in eval stays so, in place or not."""
    torch.manual_seed(7)
    model = Net().to(DEVICE).train()
    model.up.eval()
    flags = [m.training for m in model.modules()]
    ref = copy.deepcopy(model)
    out, report = solforge.optimize(model, (_x(0),), make_inputs=lambda s: (_x(s),), inplace=inplace, **KW)
    assert report.e2e is not None and report.e2e.passed, report.e2e
    assert [m.training for m in model.modules()] == flags
    assert (out is model) is inplace and (installed(model) is not None) is inplace
    x = _x(3)
    with torch.no_grad():
        assert _solforge_events(lambda: out(x)) >= 1
        torch.testing.assert_close(out(x), ref(x), atol=1e-5, rtol=1e-5)
    assert [m.training for m in model.modules()] == flags
