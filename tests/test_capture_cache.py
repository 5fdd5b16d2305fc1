"""The ATen lowering cache: a graph read back is the graph make_fx traced (code, node values,
module paths, matches, outputs); a broken entry or anything the key cannot describe falls back to
tracing; a change of inputs or grad mode is another key. And capture() keeps full GC scans out."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE

from solforge import capture, plan
from solforge.capture import cache as lc
from solforge.integrate import integrate_captured
from solforge.tune import family_module
from solforge.zoo import load_model


def _capture(model: nn.Module, inputs: tuple, directory: Path, grad: bool = False) -> capture.SolforgeBackend:
    torch.compiler.reset()  # a new process would trace again: so does dynamo after a reset
    return capture.capture(model, inputs, cache=directory, grad=grad)


def _vals(gm: torch.fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        vs = v if isinstance(v, tuple | list) else (v,)
        out.append([(tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad)
                    if isinstance(x, torch.Tensor) else x for x in vs])
    return out


def _matches(gm: torch.fx.GraphModule) -> list:
    return [(m.family, m.workload, [n.name for n in m.nodes], [str(a) for a in m.args],
             m.region(0).module) for m in plan.find_matches(gm.graph)]


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


@pytest.fixture(scope="module")
def tiny():
    # odd sizes: batch 3, 13 tokens
    return load_model("qwen3-tiny", device=DEVICE, dtype=torch.float32, batch=3, seq=13, seed=0)


def test_round_trip_gives_the_traced_graph(tiny, tmp_path):
    with torch.no_grad():
        traced = _capture(tiny.model, tiny.example_inputs, tmp_path)
        assert (traced.cache.hits, traced.cache.stored, traced.cache.problems) == (0, 1, [])
        assert len(_entries(tmp_path)) == 1
        cached = _capture(tiny.model, tiny.example_inputs, tmp_path)
        assert (cached.cache.hits, cached.cache.stored) == (1, 0)
    (a,), (b,) = traced.graphs, cached.graphs
    # the attention pass ran on both (2 layers), and then the graphs are the same, node for node
    assert a.attention_restored == b.attention_restored == 2
    assert a.aten.code == b.aten.code
    assert _vals(a.aten) == _vals(b.aten)
    for x, y in zip(a.aten.graph.nodes, b.aten.graph.nodes, strict=True):
        assert capture.module_path(x) == capture.module_path(y)
        assert x.meta.get("stack_trace") == y.meta.get("stack_trace")
        assert x.meta.get("requires_grad") == y.meta.get("requires_grad")
    assert a.aten.meta == b.aten.meta
    ma, mb = _matches(a.aten), _matches(b.aten)
    assert ma == mb and {m[0] for m in ma} >= {"rope", "add_rmsnorm", "swiglu"}

    # both, rewritten with the same kernels, compute exactly the same logits as each other, and
    # the same function as the model
    fresh = tiny.make_inputs(5)
    with torch.no_grad():
        ref = tiny.model(*fresh).logits
        outs = []
        for captured in (traced, cached):
            groups = plan.plan(captured.graphs)
            winners = {g.workload: family_module(g.workload.family).heuristic(g.workload).encode() for g in groups}
            optimized, stats = integrate_captured(captured, winners)
            assert stats.total == sum(g.count for g in groups) > 0
            outs.append(optimized(*fresh).logits)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], ref, rtol=1e-4, atol=1e-4)


def _float_args(data: dict) -> list[tuple[dict, int, float]]:
    """(node, argument index, value) of every float constant argument of a call in an entry."""
    return [(n, i, a) for n in data["nodes"] if n["op"] == "call_function" and isinstance(n["args"], dict)
            for i, a in enumerate(n["args"].get("tuple", [])) if isinstance(a, float)]


@pytest.fixture(scope="module")
def first_entry(tiny, tmp_path_factory):
    """One traced capture and its entry's name and bytes, which each damage below copies."""
    directory = tmp_path_factory.mktemp("first-entry")
    with torch.no_grad():
        first = _capture(tiny.model, tiny.example_inputs, directory)
    (entry,) = _entries(directory)
    return first.graphs[0].aten.code, entry.name, entry.read_bytes()


def _damaged(raw: bytes, damage: str, eps: float) -> tuple[bytes, str]:
    """The entry's bytes with one kind of damage, and the key it is looked up by."""
    key = json.loads(raw.partition(b"\n")[0])["key"]
    data = lc.unpack(raw, key)
    head, _, payload = raw.partition(b"\n")
    if damage == "garbage":
        return b"\x00\xffnot json", key
    if damage == "truncated":
        return raw[: len(raw) // 2], key
    if damage == "edited eps":
        # the RMSNorms' eps, changed in the JSON and the checksum left as written: it decodes
        # to a valid graph that computes something else, so only the checksum can catch it
        found = [(n, i, a) for n, i, a in _float_args(data) if a == eps]
        assert found
        for n, i, _ in found:
            n["args"]["tuple"][i] = 1e-2
        return head + b"\n" + json.dumps(data, separators=(",", ":")).encode(), key
    if damage == "one byte":
        at = payload.index(b'"name":"') + len(b'"name":"')  # a node's name, one letter changed
        return head + b"\n" + payload[:at] + bytes([payload[at] ^ 1]) + payload[at + 1:], key
    # well-formed entries (checksums right) whose contents are wrong
    if damage == "other key":
        return lc.pack("0" * 64, data), key
    if damage == "bad op":
        node = next(n for n in data["nodes"] if n["op"] == "call_function")
        node["target"] = "aten::no_such_op.default"
    elif damage == "bad dtype":
        node = next(n for n in data["nodes"] if isinstance(n["val"], dict) and "tensor" in n["val"])
        node["val"]["tensor"][3] = "no_such_dtype"
    else:
        node = next(n for n in data["nodes"] if n["op"] == "call_function")
        node["args"] = {"tuple": [{"node": "nowhere"}]}
    return lc.pack(key, data), key


DAMAGES = ["garbage", "truncated", "other key", "bad op", "bad dtype", "bad node ref", "edited eps", "one byte"]


def test_every_broken_entry_is_ignored_and_said(tiny, first_entry, tmp_path, capsys):
    """Each damage, looked up as a capture looks it up: a miss (never a graph), a problem said; an
    entry whose checksum does not match is also warned about at once, in one line."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, name, raw = first_entry
    for damage in DAMAGES:
        bad, key = _damaged(raw, damage, tiny.model.config.rms_norm_eps)
        (tmp_path / name).write_bytes(bad)
        cache = lc.LoweringCache(tmp_path)
        capsys.readouterr()
        assert cache.load(key, FakeTensorMode()) is None, damage
        assert (cache.hits, cache.misses) == (0, 1) and len(cache.problems) == 1, (damage, cache.problems)
        assert "broken entry" in cache.problems[0], damage
        warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("solforge: warning:")]
        # an entry that decodes (edited in place) is caught by its checksum alone, and warned about
        checksum = "checksum" in cache.problems[0]
        assert checksum or damage not in ("edited eps", "one byte"), (damage, cache.problems)
        assert len(warned) == int(checksum) and all("checksum" in w for w in warned), (damage, warned)
    # the good entry reads back
    (tmp_path / name).write_bytes(raw)
    cache = lc.LoweringCache(tmp_path)
    assert cache.load(json.loads(raw.partition(b"\n")[0])["key"], FakeTensorMode()) is not None and cache.hits == 1


# the whole capture's fallback for one damage of each kind (a checksum that does not match; a
# well-formed entry whose contents are wrong): the others are the same path after the lookup above
@pytest.mark.parametrize("damage", ["edited eps", "bad op"])
def test_broken_entry_falls_back_to_tracing(tiny, first_entry, tmp_path, damage, capsys):
    first_code, name, raw = first_entry
    bad, _ = _damaged(raw, damage, tiny.model.config.rms_norm_eps)
    (tmp_path / name).write_bytes(bad)
    with torch.no_grad():
        capsys.readouterr()
        again = _capture(tiny.model, tiny.example_inputs, tmp_path)
    assert again.cache.hits == 0 and again.cache.stored == 1
    assert any("broken entry" in p for p in again.cache.problems)
    if damage == "edited eps":  # said at once, in one line
        assert any("checksum" in p for p in again.cache.problems)
        warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("solforge: warning:")]
        assert len(warned) == 1 and "checksum" in warned[0]
    assert again.graphs[0].aten.code == first_code
    assert not again.errors
    # the entry was written again, and is good
    with torch.no_grad():
        third = _capture(tiny.model, tiny.example_inputs, tmp_path)
    assert third.cache.hits == 1 and third.graphs[0].aten.code == first_code


def test_other_inputs_or_grad_mode_are_other_keys(tiny, tmp_path):
    with torch.no_grad():
        _capture(tiny.model, tiny.example_inputs, tmp_path)
        longer = (torch.randint(0, 512, (3, 7), device=DEVICE),)
        b = _capture(tiny.model, longer, tmp_path)
    assert (b.cache.hits, b.cache.stored) == (0, 1)
    g = _capture(tiny.model, tiny.example_inputs, tmp_path, grad=True)
    assert (g.cache.hits, g.cache.stored) == (0, 1)
    assert g.graphs[0].aten.meta["grad_enabled"] is True
    assert len(_entries(tmp_path)) == 3


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _user_function(x) * self.w


@torch._dynamo.allow_in_graph
def _user_function(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


def test_user_code_in_the_graph_is_not_cached(tmp_path):
    """A call of user code stays a call in dynamo's graph: its lowering depends on code the key
    cannot see, so the graph is traced every time (and works)."""
    m = _Scaled().to(DEVICE)
    x = torch.randn(3, 5, device=DEVICE)
    with torch.no_grad():
        b = _capture(m, (x,), tmp_path)
        out = b.compiled(x)
    assert b.cache.stored == 0 and b.cache.hits == 0
    assert any("not cacheable" in p and "_user_function" in p for p in b.cache.problems)
    torch.testing.assert_close(out, (x.sin() + 1) * m.w)
    assert _entries(tmp_path) == []


def test_local_module_class_is_not_cached(tmp_path):
    """A module class defined inside a function cannot be imported back for nn_module_stack."""

    class Local(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 3

    x = torch.randn(4, 3, device=DEVICE)
    with torch.no_grad():
        b = _capture(nn.Sequential(Local()), (x,), tmp_path)  # inside: on the module stack
        torch.testing.assert_close(b.compiled(x), torch.relu(x) * 3)
    assert b.cache.stored == 0 and any("Local" in p for p in b.cache.problems)


def test_values_round_trip_exactly():
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    args = (1, -0.0, float("inf"), float("nan"), True, None, "s", torch.bfloat16, torch.device("cpu"),
            [2, 3], (torch.strided, torch.channels_last), {"k": 1.5}, slice(1, None, 2), torch.Size([4, 5]))
    enc = json.loads(json.dumps(lc._encode(args), allow_nan=False))
    back = lc._decode(enc, {})
    assert repr(back) == repr(args) and type(back[9]) is list and type(back[13]) is torch.Size
    with fake:
        t = torch.empty_strided((3, 4), (1, 3), dtype=torch.float16).requires_grad_(True)
        v = (t, t[1:, 1:], 7)
    got = lc._decode_val(json.loads(json.dumps(lc._encode_val(v))), fake)
    for x, y in zip(got[:2], v[:2], strict=True):
        assert (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device) == \
            (y.shape, y.stride(), y.storage_offset(), y.dtype, y.device)
    assert got[0].requires_grad and got[2] == 7
    with pytest.raises(lc.Uncacheable):
        lc._encode(object())


def test_capture_holds_full_collections_off_and_restores_the_gc():
    # start unfrozen: an earlier test in this process may have frozen the heap (the CLI's optimize
    # does), and capture() then leaves the freeze alone (checked below); on the H100 it had
    gc.unfreeze()
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    seen: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    m = nn.Linear(6, 5).to(DEVICE)
    x = torch.randn(3, 6, device=DEVICE)
    gc.callbacks.append(on_gc)
    try:
        with capture.few_full_collections():
            assert gc.get_freeze_count() > frozen and gc.get_threshold()[2] >= 1000
            # well past the default thresholds: without the context, this runs full collections
            junk = [[i] for i in range(300_000)]
            del junk
            capture.capture(m, (x,))
    finally:
        gc.callbacks.remove(on_gc)
    assert 2 not in seen  # no full scan, though young ones ran
    assert 0 in seen
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen
    # a caller's own freeze is left alone
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        capture.capture(m, (x,))
        # still frozen (a few frozen objects may die meanwhile): capture() did not unfreeze them
        assert 0.99 * before < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()


def test_prune_by_last_use_and_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`solforge db prune --lowered`: entries not used for DAYS days go (a read counts as a use),
    leftover temp files too; --dry-run removes nothing; kernel-entry criteria are refused."""
    import os
    import time

    from solforge.cli import main

    m = nn.Linear(6, 5).to(DEVICE)
    x = torch.randn(3, 6, device=DEVICE)
    cache = lc.LoweringCache(tmp_path / "lowered")
    capture.capture(m, (x,), cache=cache)
    (entry,) = list(cache.directory.glob("*.json"))
    leftover = cache.directory / ".tmp-killed.json"
    leftover.write_text("{")
    old = time.time() - 10 * 86400
    for p in (entry, leftover):
        os.utime(p, (old, old))
    # a hit makes the entry recent again: a 5-day prune keeps it, takes the leftover
    hit = lc.LoweringCache(tmp_path / "lowered")
    torch._dynamo.reset()
    capture.capture(m, (x,), cache=hit)
    assert hit.hits == 1
    assert [p.name for p, _ in hit.prune(older_than_days=5, dry_run=True)] == [leftover.name]
    assert leftover.exists()
    assert [p.name for p, _ in hit.prune(older_than_days=5)] == [leftover.name]
    assert entry.exists() and not leftover.exists()
    db = str(tmp_path / "kernels.db")  # lowered/ lives beside it; the database need not exist
    assert main(["db", "prune", "--lowered", "--older-than", "1", "--db", db]) == 0
    assert "nothing to prune" in capsys.readouterr().out and entry.exists()
    assert main(["db", "prune", "--lowered", "--dry-run", "--db", db]) == 0
    assert "would remove 1 lowered graphs" in capsys.readouterr().out and entry.exists()
    assert main(["db", "prune", "--lowered", "--db", db]) == 0
    assert "removed 1 lowered graphs" in capsys.readouterr().out and not entry.exists()
    assert main(["db", "prune", "--lowered", "--family", "rope", "--db", db]) == 2
    assert "--lowered prunes by age only" in capsys.readouterr().err


def test_the_profile_reads_the_captures_lowering(tiny, tmp_path):
    """optimize profiles the model after capturing it: the profile's trace reads the capture's
    ATen graph from the lowering cache instead of lowering it again, and finds the same regions."""
    from solforge.profile import profile_model

    with torch.no_grad():
        captured = _capture(tiny.model, tiny.example_inputs, tmp_path)
    assert captured.cache.stored == 1
    cache = lc.LoweringCache(tmp_path)
    prof = profile_model(tiny.model, tiny.example_inputs, device=DEVICE, lowering_cache=cache)
    assert (cache.hits, cache.stored, cache.problems) == (1, 0, [])
    fresh = profile_model(tiny.model, tiny.example_inputs, device=DEVICE)
    assert prof.regions and sorted(r.key for r in prof.regions) == sorted(r.key for r in fresh.regions)
