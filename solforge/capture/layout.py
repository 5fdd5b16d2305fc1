"""Convolutions in channels-last where that is measured to be faster.

cuDNN's convolutions on tensor cores run fastest with channels-last (NHWC / NDHWC) tensors; a model
written the PyTorch way hands them NCHW. torch.compile (Inductor's layout optimization) converts
whole graphs to channels-last. On KernelBench level 2's 1_Conv2D_ReLU_BiasAdd (H100, fp32,
2026-11-27) eager took 4.36 ms, torch.compile 1.96 ms and solforge, its ReLU and bias add fused,
3.50 ms: fusing them saves one pass over the 1 GB output (about 0.7 ms at the copy ceiling), so
most of compile's lead is in the convolution (not profiled yet: that is the inference).

This pass, run on each captured ATen graph before matching, rewrites a 4-D or 5-D
`aten.convolution` whose input is not channels-last into

    conv(clone(x, channels_last), clone(w, channels_last), ...)  ->  clone(out, contiguous_format)

The result the rest of the graph sees is laid out as before (so views, reshapes and the graph's
outputs are unchanged); the clones are copies, and the copy back is a pointwise op that region
formation fuses with the ops after the convolution (a ReLU and a bias add then read the
channels-last output once and write the contiguous result once: no extra pass over memory).

Whether to rewrite is measured, not guessed, island by island (`islands`): the convolutions whose
results reach one another through ops that keep the memory order form a group, and each
convolution is timed on the GPU at its shapes, dtypes and parameters (random inputs) as the graph
runs it, channels-last (its input already so, the weight's copy counted), and the copies of its
input and output. The group goes channels-last where its channels-last times, plus a copy in where
the group starts and each copy back that stays, take at most MARGIN of its times as written. A copy
back does not stay where every op reading the convolution's result can be in a generated region
(the copy is that region's strided read: `copy_back_fuses`) or where it reaches only convolutions
of the group (it cancels: `copy_back_cancels`). Decided one convolution at a time with every copy
counted, no convolution of KernelBench level 2's rows (H100/H200, 2026-11-27) was rewritten, and
a ResNet's stem then left every convolution after it NCHW (`islands` says more). Off the GPU
nothing is rewritten (no timing means anything there); tests pass their own `decide` or timings.
Timings are kept per shape and parameters for the process. SOLFORGE_CONV_LAYOUT=0 turns the pass
off.

Between rewritten convolutions, the copies cancel (`cancel_copies`: channels-last islands): the
channels-last result flows through the ops that keep the memory order (pointwise ops, pools, eval
BatchNorm) into the next convolutions, whose copies in go, and the copy back moves to where the
island ends: a CNN's conv -> ReLU -> pool -> conv chains and a ResNet's residual adds run
channels-last throughout, with a copy at the graph's input and one where the island ends.

A rewritten fp32 convolution computes as precisely as the one written. cuDNN may run an fp32
convolution on TF32 tensor cores (PyTorch's default allows it) and its channels-last kernels do: on
KernelBench level 2's 57_Conv2d_ReLU_HardSwish (H200, 2026-11-28) torch.compile's channels-last
convolution (cuDNN's TF32 kernel) was 2.1x eager's NCHW one and 3.4e-4 from eager's output, past
KernelBench's 1e-4; solforge's rewrite was as far, its end-to-end check failed and it returned the
original model. So the timing also tells whether the convolution as written rounds through TF32
(its output against the same convolution with TF32 off, `ConvTimes.tf32`); where it does not, the
rewrite calls `convolution_fp32` (TF32 off for the call, the setting put back after), and is timed
that way. Off the GPU (no timing) a rewritten fp32 convolution calls `convolution_fp32`.

A copy back that would fuse into a reduction across the channels (a GroupNorm of fewer groups than
channels, a LayerNorm over C and more, a mean over C, H, W) is counted as a copy of its own, and
the reduction's input is materialized (`MATERIALIZE`): a generated region reads its input along the
reduced index in the dims' logical order, strided by C over a channels-last tensor, so the
reduction reads an NCHW value instead (the copy and the pointwise ops before the reduction a
transposing region of their own).

Before deciding, a CUDA convolution's bias moves to the region after it (`strip_bias`): ATen adds a
cuDNN convolution's bias in a separate pass over the output, which the region after it can do for
free while it reads that output (as Inductor does).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge.capture.pointwise import is_pointwise

aten = torch.ops.aten
CONV = aten.convolution.default
# The channels-last way must take at most this fraction of the time of the original way.
MARGIN = 0.95
# A copy from this size on is a generated region (plan/generated.py's RELAYOUT_MIN_BYTES; capture does
# not import plan): timed as the plain copy of its bytes where that is faster than ATen's
RELAYOUT_BYTES = 1 << 20
# node meta: the channels-last copy this pass made of a convolution's input (shared by every reader)
_COPY = "solforge_channels_last_copy"


def _format(dim: int) -> torch.memory_format | None:
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(dim)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def candidate(n: fx.Node) -> bool:
    """A convolution this pass may rewrite: floating 4-D/5-D input and weight with static sizes,
    the input not already channels-last."""
    if n.op != "call_function" or n.target is not CONV:
        return False
    x, w = _val(n.args[0]), _val(n.args[1])
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or not x.is_floating_point():
        return False
    fmt = _format(x.dim())
    if fmt is None or w.dim() != x.dim():
        return False
    if not all(isinstance(s, int) for s in (*x.shape, *w.shape)):
        return False
    return x.is_contiguous() and not x.is_contiguous(memory_format=fmt)  # NCHW, not both (C == 1)


def _hashable(a: Any) -> Any:
    return tuple(_hashable(v) for v in a) if isinstance(a, list | tuple) else a


# node meta: a value computed from a copy back to NCHW that a reduction across the channels reads
# from memory rather than taking in (codegen/regions.py: no consumer joins its region), set by
# `materialize_before_channel_reductions`
MATERIALIZE = "solforge_materialize"
_CHANNEL_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                       aten.var.correction, aten.std.correction, aten.var_mean.correction,
                       aten.linalg_vector_norm.default}


def _reduces_across_channels(u: fx.Node) -> bool:
    """A norm or reduction over the channels (dim 1) together with other dims: a GroupNorm of
    fewer groups than channels, a LayerNorm over C and the dims after it, a sum/mean/var/max over
    dims holding 1 and another. A generated region reads its input along the reduced index in the
    dims' logical order; over a channels-last tensor that is strided by C (KernelBench level 2's
    60_ConvTranspose3d_Swish_GroupNorm_HardSwish: its GroupNorm region took 2308 µs reading the
    channels-last result, torch.compile's two kernels reading NCDHW 1279, H200, 2026-11-28)."""
    x = _val(u.args[0]) if u.args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return False
    if u.target is aten.native_group_norm.default:
        return len(u.args) > 6 and isinstance(u.args[6], int) and isinstance(u.args[4], int) and u.args[6] < u.args[4]
    if u.target is aten.native_layer_norm.default:
        return len(u.args) > 1 and len(u.args[1]) >= x.dim() - 1
    if u.target in _CHANNEL_REDUCTIONS:
        dims = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
        if dims is None:
            return True  # over everything
        dims = {d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)}
        return 1 in dims and len(dims) > 1
    return False


def _walk(starts: Iterable[Any], follow: Callable[[fx.Node], Iterable[fx.Node]], limit: int) -> Iterator[fx.Node]:
    """The call_function nodes reached from `starts`, depth first, each once, `follow(node)` walked
    after the caller has seen it; nothing past `limit` nodes (a search that gives up says no)."""
    stack, seen = list(starts), set()
    while stack and len(seen) < limit:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        yield n
        stack.extend(follow(n))


def into_a_channel_reduction(n: fx.Node, limit: int = 64) -> bool:
    """Whether `n`'s result reaches, through pointwise ops (and copies), a reduction across the
    channels (`_reduces_across_channels`)."""
    def through(u: fx.Node) -> Iterable[fx.Node]:
        return u.users if is_pointwise(u.target) or u.target is aten.clone.default else ()

    return any(_reduces_across_channels(u) for u in _walk(n.users, through, limit))


def _is_copy_back(n: fx.Node) -> bool:
    """A contiguous clone of a channels-last value."""
    if n.target is not aten.clone.default or n.kwargs.get("memory_format") != torch.contiguous_format:
        return False
    x = _val(n.args[0])
    fmt = _format(x.dim()) if isinstance(x, torch.Tensor) else None
    return fmt is not None and x.is_contiguous(memory_format=fmt) and not x.is_contiguous()


def _from_a_copy_back(a: fx.Node, limit: int = 64) -> bool:
    """Whether `a` is, or is computed through pointwise ops from, a copy back to NCHW."""
    def inputs(n: fx.Node) -> Iterable[fx.Node]:
        return n.all_input_nodes if is_pointwise(n.target) else ()

    return any(_is_copy_back(n) for n in _walk([a], inputs, limit))


def materialize_before_channel_reductions(gm: fx.GraphModule) -> int:
    """Mark the input of each reduction across the channels (`_reduces_across_channels`) that is
    computed, through pointwise ops, from a copy back to NCHW: the reduction's region reads it from
    memory instead of taking in the copy and reading the channels-last value strided (the copy and
    the pointwise ops before the reduction are a transposing region of their own). Returns how many."""
    marked = 0
    for u in gm.graph.nodes:
        if u.op != "call_function" or not _reduces_across_channels(u):
            continue
        a = u.args[0]
        if isinstance(a, fx.Node) and not a.meta.get(MATERIALIZE) and _from_a_copy_back(a):
            a.meta[MATERIALIZE] = True
            marked += 1
    return marked


def copy_back_fuses(n: fx.Node) -> bool:
    """Whether the copy back to the original layout after convolution `n` would be part of the
    generated region after it: every user of its result is a pointwise ATen op (ATen's tag; what
    region formation takes first. Not codegen's own test: capture must not import codegen) or a
    concatenation (an Inception module's branches: one region reads every branch's channels-last
    result and writes the concatenation once, as Inductor's kernel does)."""
    return bool(n.users) and all(
        u.op == "call_function" and (is_pointwise(u.target) or u.target is aten.cat.default) for u in n.users)


def copy_back_cancels(n: fx.Node, limit: int = 4096) -> bool:
    """Whether the copy back after convolution `n` would cancel (`cancel_copies`): its result
    reaches, through ops that keep the memory order, convolutions this pass may rewrite and nothing
    else (a CNN's conv -> BatchNorm -> ReLU -> conv, a ResNet's residual add -> ReLU -> the next
    block's convolutions). The island's copy out is then paid where the island ends, not here: with
    it counted at every convolution, no convolution of timm's ResNet-50 (bf16, H200, 2026-11-27)
    was rewritten, although cuDNN converted every NCHW input and output there in passes of its own
    (1.05 ms of its 6.8 ms)."""
    stack, seen, convs = list(n.users), set(), 0
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if len(seen) > limit:
            return False
        if candidate(u) and (u.args[0] is n or u.args[0] in seen):
            convs += 1
        elif _keeps_layout(u):
            stack.extend(u.users)
        else:
            return False
    return convs > 0


@contextlib.contextmanager
def ieee_fp32() -> Any:
    """cuDNN's fp32 convolutions in fp32 (no TF32) inside the block; the setting as it was after."""
    conv = torch.backends.cudnn.conv
    was = conv.fp32_precision
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision = was


def convolution_fp32(*args: Any) -> Any:
    """`aten.convolution` with cuDNN's TF32 off: what a rewritten fp32 convolution calls."""
    with ieee_fp32():
        return CONV(*args)


convolution_fp32._schema = CONV._schema  # type: ignore[attr-defined]  # alias info (stepgraphs, tidy)
convolution_fp32.solforge_op = CONV  # type: ignore[attr-defined]  # the op it stands for (profile)


def _rewritten_call(x: torch.Tensor, tf32: bool = False) -> Callable[..., Any]:
    """What a rewritten convolution of input `x` calls: an fp32 one that does not round through
    TF32 as written (`tf32`) keeps fp32 (the module doc)."""
    return convolution_fp32 if x.dtype == torch.float32 and not tf32 else CONV


def _rounds_through_tf32(out: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether fp32 convolution output `out` is further from `exact` (the same convolution with
    TF32 off) than fp32 sums in another order are: TF32 keeps 10 bits of mantissa (about 1e-3
    relative a product), fp32 sums differ by a few ulps (about 1e-7)."""
    scale = exact.abs().max().item()
    return scale > 0 and (out - exact).abs().max().item() > 1e-5 * scale


def _key(n: fx.Node) -> tuple[Any, ...]:
    """What a convolution's timings depend on: shapes, strides, dtypes, device, whether there is a
    bias, the convolution's parameters (stride, padding, dilation, transposed, output padding, groups)."""
    x, w = _val(n.args[0]), _val(n.args[1])
    return (tuple(x.shape), tuple(x.stride()), x.dtype, tuple(w.shape), w.dtype, str(x.device),
            n.args[2] is not None, _hashable(tuple(n.args[3:])), torch.backends.cudnn.conv.fp32_precision)


@dataclass(frozen=True)
class ConvTimes:
    """One convolution's device times (µs, p50): as the graph runs it (`plain`); channels-last with
    its input already channels-last and the weight's copy counted (`last`: inside an island); the
    copy of its input to channels-last (`copy_in`: where an island starts) and of its output back
    (`copy_back`: where one ends). A copy of a MiB or more is a generated region of its own, a
    transposing kernel (plan/generated.py's `relayouts`), so a copy counts the faster of ATen's and
    a plain copy of the same bytes: on KernelBench level 2's 54_Conv2d_Multiply_LeakyReLU_GELU
    (H200, 2026-11-28) ATen's copy of the 1 GB input to channels-last cost as much as cuDNN's own
    conversions around its TF32 kernel saved, and the island stayed NCHW, while torch.compile's
    copy took 514 µs and its channels-last convolution won."""

    plain: float
    last: float
    copy_in: float
    copy_back: float
    tf32: bool = False  # the convolution as written rounds through TF32 (fp32 only): so may the rewrite


@functools.cache
def _times(key: tuple[Any, ...]) -> ConvTimes | None:
    """The timings of `key`'s convolution on the GPU at random inputs; None where one fails (out of
    memory, an unsupported convolution: it stays as written)."""
    from solforge.tune.timing import time_kernel

    xshape, xstride, dtype, wshape, wdtype, device, has_bias, rest, _precision = key
    fmt = _format(len(xshape))
    transposed, groups = rest[3], rest[5]
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.empty_strided(xshape, xstride, dtype=dtype, device=device).normal_(generator=g)
        w = torch.randn(wshape, dtype=wdtype, device=device, generator=g)
        channels = wshape[1] * groups if transposed else wshape[0]
        b = torch.randn(channels, dtype=wdtype, device=device, generator=g) if has_bias else None
        x_last = x.contiguous(memory_format=fmt)
        tf32 = dtype == torch.float32 and _rounds_through_tf32(CONV(x, w, b, *rest), convolution_fp32(x, w, b, *rest))
        conv = _rewritten_call(x, tf32)
        out = conv(x_last, w.contiguous(memory_format=fmt), b, *rest)
        runs = [time_kernel(lambda: CONV(x, w, b, *rest), "cuda"),
                time_kernel(lambda: conv(x_last, w.clone(memory_format=fmt), b, *rest), "cuda"),
                time_kernel(lambda: x.clone(memory_format=fmt), "cuda"),
                time_kernel(lambda: out.clone(memory_format=torch.contiguous_format), "cuda")]
        plain_copies = [time_kernel(lambda: x_last.clone(memory_format=fmt), "cuda"),
                        time_kernel(lambda: out.clone(memory_format=fmt), "cuda")]
    except Exception:  # noqa: BLE001 - out of memory or an unsupported convolution: leave it as written
        return None
    if not all(r.ok for r in runs):
        return None
    plain, last, copy_in, copy_back = (r.p50_us for r in runs)
    for k, (r, nbytes) in enumerate(zip(plain_copies, (x.numel() * x.element_size(), out.numel() * out.element_size()),
                                        strict=True)):
        if r.ok and nbytes >= RELAYOUT_BYTES:
            if k == 0:
                copy_in = min(copy_in, r.p50_us)
            else:
                copy_back = min(copy_back, r.p50_us)
    return ConvTimes(plain, last, copy_in, copy_back, tf32=tf32)


def node_times(n: fx.Node) -> ConvTimes | None:
    """`islands`' default timing: on a CUDA graph, the measurement above; elsewhere None (nothing is
    rewritten off the GPU: no timing means anything there)."""
    x = _val(n.args[0])
    if not (isinstance(x, torch.Tensor) and x.device.type == "cuda" and torch.cuda.is_available()):
        return None
    if torch.cuda.is_current_stream_capturing():  # a model compiled inside the user's CUDA graph capture
        return None  # timing there would break the capture: left as written
    return _times(_key(n))


def _groups(graph: fx.Graph, limit: int = 4096) -> tuple[list[list[fx.Node]], set[fx.Node]]:
    """The candidate convolutions grouped into would-be islands: one convolution's result reaching
    another's input through ops that keep the memory order (a CNN's conv -> BatchNorm -> ReLU ->
    pool -> conv, a ResNet's residual add), or two reading one input (an Inception module's
    branches, one copy in), puts them in one group. Also returns the convolutions fed from their
    group (no copy in of their own once it is channels-last)."""
    convs = [n for n in graph.nodes if candidate(n)]
    parent = {c: c for c in convs}

    def root(c: fx.Node) -> fx.Node:
        while parent[c] is not c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    def join(a: fx.Node, b: fx.Node) -> None:
        ra, rb = root(a), root(b)
        if ra is not rb:
            parent[ra] = rb

    fed: set[fx.Node] = set()
    by_input: dict[Any, fx.Node] = {}
    for c in convs:
        join(c, by_input.setdefault(c.args[0], c))
        stack, seen = list(c.users), {c}
        while stack and len(seen) < limit:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in parent and u.args[0] in seen:
                fed.add(u)
                join(u, c)
            elif _keeps_layout(u):
                stack.extend(u.users)
    out: dict[fx.Node, list[fx.Node]] = {}
    for c in convs:
        out.setdefault(root(c), []).append(c)
    return list(out.values()), fed


def islands(gm: fx.GraphModule, times: Callable[[fx.Node], ConvTimes | None] | None = None) -> set[fx.Node]:
    """The convolutions to rewrite, decided island by island: a group of convolutions (`_groups`)
    goes channels-last together where its convolutions' channels-last times, plus the copies in
    where it starts and the copies back that stay (neither fused into the region after them nor
    cancelled: `copy_back_fuses`, `copy_back_cancels`), take at most MARGIN of their times as the
    graph runs them. Decided one at a time, a ResNet's stem (its copy in counted, no faster
    channels-last) stayed NCHW, and then so did every convolution after it, its copy in counted
    too (timm's ResNet-50, bf16, H100, 2026-11-27: 22 of 53 rewritten, cuDNN converting the others'
    inputs and outputs in passes of its own, 0.64 ms of solforge's 4.80). In a training graph the
    island's values are saved for the backward, so its copies do not cancel: there each
    convolution counts its own."""
    times = times or node_times  # looked up at the call (tests give their own)
    training = bool(gm.meta.get("grad_enabled", False))
    groups, fed = _groups(gm.graph)
    chosen: set[fx.Node] = set()
    decisions: list[Decision] = gm.meta.setdefault(DECISIONS, [])
    for group in groups:
        ts = [times(c) for c in group]
        if any(t is None for t in ts):
            if torch.cuda.is_available() and all(on_cuda(c) for c in group):  # off the GPU none is timed
                decisions.append(Decision(len(group), None, None, False))
            continue
        plain = cost = 0.0
        copied: set[Any] = set()
        for c, t in zip(group, ts, strict=True):
            assert t is not None
            plain += t.plain
            cost += t.last
            if (training or c not in fed) and c.args[0] not in copied:
                copied.add(c.args[0])
                cost += t.copy_in
            # a copy back into a reduction across the channels stays (materialized: the reduction
            # reads NCHW), even where the region after the convolution would have taken it
            fuses = copy_back_fuses(c) and not into_a_channel_reduction(c)
            if not (fuses or (not training and copy_back_cancels(c))):
                cost += t.copy_back
        if cost <= MARGIN * plain:
            chosen.update(group)
        decisions.append(Decision(len(group), plain, cost, cost <= MARGIN * plain, any(t.tf32 for t in ts)))
    return chosen


# gm.meta keys: the Decision of each island `islands` weighed, how many biases `strip_bias` moved
# (reports show them)
DECISIONS = "solforge_conv_layout_decisions"
BIASES_MOVED = "solforge_conv_biases_moved"


@dataclass(frozen=True)
class Decision:
    """One island's layout decision: its convolutions, their time as written (µs, None: not timed)
    and channels-last with the copies that stay, whether it was rewritten, whether a convolution
    of it rounds through TF32 as written."""

    convolutions: int
    written_us: float | None
    channels_last_us: float | None
    rewritten: bool
    tf32: bool = False

    def text(self) -> str:
        if self.written_us is None or self.channels_last_us is None:
            return f"{self.convolutions} convolution(s) left as written: a timing failed"
        way = "channels-last" if self.rewritten else "left as written"
        return (f"{self.convolutions} convolution(s) {way}: {self.written_us:.0f} µs as written, "
                f"{self.channels_last_us:.0f} µs channels-last with its copies (rewritten at <= {MARGIN:.0%})"
                + ("; TF32 as written" if self.tf32 else ""))


def _fake(fn: Callable[..., Any], *vals: Any) -> Any:
    """`fn` on the nodes' fake values, under their fake mode (for the new nodes' meta)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return fn(*vals)
    with mode:
        return fn(*vals)


def on_cuda(n: fx.Node) -> bool:
    """`strip_bias`'s default: the convolution runs on CUDA (cuDNN), where ATen adds the bias in a
    pass of its own; on the CPU oneDNN adds it inside the convolution."""
    x = _val(n.args[0])
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


# Norms a kernel family matches whose generated alternative takes the producers only it reads
# (plan/alternatives.py): a bias add before one, through views, joins that alternative
# (and BatchNorm: an InstanceNorm is a batch-statistics BatchNorm of the (1, N*C, ...) view of its
# input, KernelBench level 2's Conv2d_InstanceNorm_Divide kept ATen's 824 µs bias pass, H200)
_NORMS = (aten.native_layer_norm.default, aten.native_group_norm.default, aten.native_batch_norm.default,
          aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_no_training.default,
          aten.cudnn_batch_norm.default)


def _into_a_norm(n: fx.Node) -> bool:
    """Every reader of `n`'s result is a norm that normalizes it (its first argument), directly (a
    GroupNorm: a generated region, which takes the add as any producer) or through views alone
    (ConvNeXt's permute to channels-last before the LayerNorm family's region, whose generated
    alternative takes the add)."""
    stack = [(u, n) for u in n.users]
    seen = 0
    while stack:
        u, src = stack.pop()
        seen += 1
        if seen > 64 or u.op != "call_function":
            return False
        if u.target in _NORMS and u.args[0] is src:
            continue
        if u.target in (aten.permute.default, aten.view.default, aten.reshape.default, aten.transpose.int) \
                and u.args[0] is src and u.users:
            stack.extend((w, u) for w in u.users)
            continue
        return False
    return bool(n.users)


# Reductions region formation takes whole (codegen/regions.py; capture does not import codegen):
# a convolution read by them alone (KernelBench level 2's Conv2d -> min over channels -> tanh,
# Conv3d -> softmax over channels) gets its bias added where the reduction reads its input
_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
               aten.amin.default, aten.max.dim, aten.min.dim, aten.max.default, aten.min.default,
               aten._softmax.default, aten._log_softmax.default, aten.logsumexp.default,
               aten.var.correction, aten.std.correction, aten.var_mean.correction,
               aten.linalg_vector_norm.default, aten.argmax.default, aten.argmin.default,
               aten._native_batch_norm_legit_no_training.default}


# BatchNorms that are a reduction above when not training (args[5]): the graph's eval BatchNorm
# (plan/generated.py decomposes them into regions)
_BATCH_NORMS = {aten.native_batch_norm.default, aten.cudnn_batch_norm.default}


def _reduces(u: fx.Node) -> bool:
    return u.target in _REDUCTIONS or (u.target in _BATCH_NORMS and len(u.args) > 5 and u.args[5] is False)


def _readers_take_the_add(n: fx.Node) -> bool:
    """Every reader of `n`'s result takes a per-channel add of it into its region: a pointwise op or
    a concatenation (`copy_back_fuses`), a reduction of it (`_REDUCTIONS`, an eval BatchNorm), a norm of it, directly
    or through views (`_into_a_norm`), in any mix (KernelBench level 2's
    Conv2d_GroupNorm_Tanh_HardSwish_ResidualAdd_LogSumExp: the convolution read by its GroupNorm and
    by the residual add kept ATen's bias pass, 404 µs of 1758, H200, 2026-11-28)."""
    users = list(n.users)
    if not users:
        return False
    for u in users:
        if u.op != "call_function":
            return False
        if is_pointwise(u.target) or u.target is aten.cat.default:
            continue
        if (_reduces(u) or u.target in _NORMS) and u.args[0] is n and n not in u.args[1:]:
            continue
        if u.target in (aten.permute.default, aten.view.default, aten.reshape.default, aten.transpose.int) \
                and u.args[0] is n and _into_a_norm(u):
            continue
        return False
    return True


_AVG_POOLS = {aten.avg_pool2d.default, aten.avg_pool3d.default}
_MAX_POOLS = {aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default}
_ADAPTIVE_AVG_POOLS = {aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default}


def _past_a_pool(n: fx.Node) -> fx.Node | None:
    """Where a per-channel add of `n`'s result can go instead: after the pool that alone reads it,
    when the pool commutes with the add. A max pool (max(x + b) = max(x) + b: rounding is monotonic;
    its indices unread), an average pool over the input's elements alone (no padding counted, no
    divisor override: avg(x + b) = avg(x) + b up to rounding), an adaptive average pool. The add then
    reads the pooled result, k times smaller (KernelBench level 2's Conv2d_AvgPool_Sigmoid_Sum:
    ATen's bias add over the convolution's 4.8 GB output was 3.7 of its 11 ms, H200, 2026-11-28)."""
    if len(n.users) != 1:
        return None
    (u,) = n.users
    if u.op != "call_function" or u.args[0] is not n or n in u.args[1:]:
        return None
    a = u.args
    if u.target in _AVG_POOLS:
        padding = a[3] if len(a) > 3 else u.kwargs.get("padding", [0])
        include = a[5] if len(a) > 5 else u.kwargs.get("count_include_pad", True)
        override = a[6] if len(a) > 6 else u.kwargs.get("divisor_override")
        pads = padding if isinstance(padding, list | tuple) else [padding]
        return u if override is None and (not include or not any(pads)) else None
    if u.target in _ADAPTIVE_AVG_POOLS:
        return u
    if u.target in _MAX_POOLS:
        firsts = [g for g in u.users if g.target is operator.getitem and g.args[1] == 0]
        if len(firsts) == 1 and all(g.target is operator.getitem and (g.args[1] == 0 or not g.users) for g in u.users):
            return firsts[0]
    return None


def strip_bias(gm: fx.GraphModule, where: Callable[[fx.Node], bool] = on_cuda) -> int:
    """Convolutions with a bias whose readers all take an add (`_readers_take_the_add`: pointwise
    ops, reductions and norms of it, in any mix): `conv(x, w, b)` becomes
    `conv(x, w, None) + b.view(1, C, 1, ...)` (read by a pool alone that commutes with the add,
    `_past_a_pool`: `pool(conv(x, w, None)) + b.view(...)`), so the bias add joins the region after the
    convolution (before a norm family's region, that region's generated alternative; where the
    family's kernel wins, ATen's add runs as cuDNN's own pass did, and the selection charged the
    family its time). On CUDA ATen runs cuDNN's convolution and then adds the bias in a pass of
    its own over the whole output (on an H100 about 0.6 ms of KernelBench level 2's 2.7 ms first
    convolution, 2026-11-27; ConvNeXt's depthwise convolutions, 480 µs in 22 launches), which the
    region after it then reads again.
    Returns how many."""
    graph, done = gm.graph, 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not CONV or not isinstance(n.args[2], fx.Node):
            continue
        out, b = _val(n), _val(n.args[2])
        if not (isinstance(out, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 1
                and out.dim() >= 3 and b.shape[0] == out.shape[1] and where(n)):
            continue
        at = n if _readers_take_the_add(n) else _past_a_pool(n)
        if at is None or not isinstance(_val(at), torch.Tensor):
            continue
        bias, out = n.args[2], _val(at)
        shape = [1, b.shape[0]] + [1] * (out.dim() - 2)
        n.args = (n.args[0], n.args[1], None, *n.args[3:])
        with graph.inserting_after(at):
            view = graph.call_function(aten.view.default, (bias, shape))
        with graph.inserting_after(view):
            add = graph.call_function(aten.add.Tensor, (at, view))
        view.meta["val"] = _fake(lambda t, s=shape: t.view(s), b)
        add.meta["val"] = _fake(lambda a, c: a + c, out, view.meta["val"])
        at.replace_all_uses_with(add, delete_user_cb=lambda u, a=add: u is not a)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


# Ops that compute a channels-last result from a channels-last input as they compute an NCHW one
# from an NCHW input (ATen's pointwise ops keep their input's memory order; these pools and eval
# BatchNorm have channels-last kernels): a copy back to NCHW before them and a copy to
# channels-last after them, into the next convolution, cancel out.
# A concatenation keeps the layout its pieces share (a DenseNet block's running concatenation of
# channels-last features; where a piece is not channels-last, its result is contiguous and the
# island's fake values say so: `_island_holds` then keeps the copies).
_KEEP_LAYOUT = {aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
                aten.avg_pool2d.default, aten.avg_pool3d.default, aten._adaptive_avg_pool2d.default,
                aten._native_batch_norm_legit_no_training.default, aten.cat.default}


def _keeps_layout(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    t = n.target
    # eval only (training updates the running statistics); on CUDA the lowering records cuDNN's
    # op, which keeps a channels-last input channels-last as native_batch_norm does
    if t in (aten.native_batch_norm.default, aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default):
        return len(n.args) > 5 and n.args[5] is False
    return t in _KEEP_LAYOUT or (is_pointwise(t) and not t._schema.is_mutable)


def _is_copy_to(n: fx.Node, fmt: torch.memory_format) -> bool:
    return (n.op == "call_function" and n.target is aten.clone.default
            and n.kwargs.get("memory_format") == fmt and len(n.args) == 1)


def _island_values(graph: fx.Graph, convs: dict[fx.Node, fx.Node], way: list[fx.Node]) -> dict[fx.Node, Any] | None:
    """The fake values the ops on the way would have with each convolution's channels-last result in
    place of its copy back (`convs`: copy back -> convolution; None: one of them cannot be computed)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    new: dict[fx.Node, Any] = {}

    def val(a: Any) -> Any:
        return _val(convs[a]) if a in convs else new[a] if a in new else _val(a)

    try:
        for n in sorted(way, key=order.__getitem__):
            args, kwargs = fx.node.map_arg(n.args, val), fx.node.map_arg(n.kwargs, val)
            vals = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
            new[n] = _fake(lambda *_, t=n.target, a=args, k=kwargs: t(*a, **k), *vals)
    except Exception:  # noqa: BLE001 - an op the fake values cannot run: the island stays as it is
        return None
    return new


def _island_holds(new: dict[fx.Node, Any], backs: dict[fx.Node, fx.Node], ends: list[fx.Node],
                  exits: list[tuple[fx.Node, fx.Node]], rewritten: set[fx.Node], fmt: torch.memory_format) -> bool:
    """Whether the island's layouts are what the rest of the graph was made for: every convolution
    at its end reads a channels-last value (its own value, and the regions after it, are
    channels-last), and every op where it ends read an NCHW-contiguous value before (the copy out
    gives it that again; a region after it was planned for those strides)."""
    def now(a: fx.Node) -> Any:  # a copy back that goes reads as its convolution (conv -> conv)
        return _val(backs[a]) if a in backs else new.get(a, _val(a))

    def last(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_contiguous(memory_format=fmt)

    if not all(last(now(e.args[0])) for e in ends):
        return False
    if not all(last(now(u.args[0])) for u in rewritten if u.args[0] in new):
        return False
    return all(v in backs or (isinstance(_val(v), torch.Tensor) and _val(v).is_contiguous()) for _, v in exits)


def cancel_copies(gm: fx.GraphModule, backs: list[fx.Node]) -> int:
    """Channels-last islands: from each rewritten convolution, its channels-last result flows
    through the ops that keep the memory order (`_KEEP_LAYOUT`, pointwise ops) to the next
    rewritten convolutions, whose copies in go, and the copy back to NCHW moves to where the island
    ends (an op of unknown layout, a view: one copy before it), as Inductor lays a CNN out. A
    conv -> BatchNorm -> ReLU -> pool -> conv chain, and a ResNet's residual adds, then run
    channels-last throughout. In an inference graph an island may end at the graph's output (a
    copy out before it); in a training graph an island whose values the graph returns (or saves
    for its backward) stays as it was. So does one that would need more copies out than it
    saves. The values on the way get their channels-last fake values again (their strides are what
    generated regions compile for), and an island stays as it is where they would not be what the
    rest of the graph was made for (`_island_holds`). Returns how many copies back went."""
    graph, gone = gm.graph, 0
    # the lowering records whether autograd was on (lower.py); a graph traced without it (a test's)
    # is an inference graph
    inference = not gm.meta.get("grad_enabled", False)
    rewritten = {b.args[0] for b in backs}
    todo = list(backs)  # the copies back still there
    # until nothing changes: an island may hold only once a neighbour's copy back has gone (a
    # residual add of two islands' values is channels-last only when both are)
    while todo:
        left = [b for b in todo if not _cancel(graph, [b], rewritten, inference)]
        if len(left) == len(todo):
            # islands that meet (a concatenation of two islands' values: alone, each would make it
            # contiguous) go together or not at all
            for group in _meeting(left):
                if len(group) > 1 and _cancel(graph, group, rewritten, inference):
                    left = [b for b in left if b not in group]
        gone += len(todo) - len(left)
        if len(left) == len(todo):
            break
        todo = left
    if gone or backs:
        graph.lint()
        gm.recompile()
    return gone


def _reach(back: fx.Node) -> set[fx.Node]:
    """The ops that keep the layout reachable from a copy back through such ops (its island's way)."""
    seen: set[fx.Node] = set()
    stack = list(back.users)
    while stack:
        u = stack.pop()
        if u not in seen and _keeps_layout(u):
            seen.add(u)
            stack.extend(u.users)
    return seen


def _meeting(backs: list[fx.Node]) -> list[list[fx.Node]]:
    """The copies back grouped by islands that share an op (connected through shared ways)."""
    ways = {b: _reach(b) for b in backs}
    groups: list[tuple[list[fx.Node], set[fx.Node]]] = []
    for b in backs:
        merged = [g for g in groups if g[1] & ways[b]]
        members, way = [b], set(ways[b])
        for g in merged:
            members += g[0]
            way |= g[1]
            groups.remove(g)
        groups.append((members, way))
    return [g[0] for g in groups]


def _cancel(graph: fx.Graph, backs: list[fx.Node], rewritten: set[fx.Node], inference: bool) -> bool:
    """One island of `cancel_copies` (from one copy back, or from several whose islands meet): True
    where its copies went. In an inference graph the graph's output is where an island may end (a
    copy out before it, as before any other op of unknown layout: a DenseNet's last pool, returned)."""
    if not all(b.users for b in backs):
        return False
    convs = {b: b.args[0] for b in backs}
    fmts = {_format(_val(c).dim()) if isinstance(_val(c), torch.Tensor) else None for c in convs.values()}
    if len(fmts) != 1 or None in fmts:
        return False
    (fmt,) = fmts
    way: list[fx.Node] = []
    ends: list[fx.Node] = []
    exits: list[tuple[fx.Node, fx.Node]] = []  # (the op where the island ends, the value it reads)
    joined = 0
    stack = [(u, b) for b in backs for u in b.users]
    seen: set[fx.Node] = set()
    ok = True
    while stack and ok:
        u, v = stack.pop()
        if _is_copy_to(u, fmt) and all(w in rewritten and w.args[0] is u for w in u.users):
            ends.append(u)  # a copy in of a convolution this pass rewrote (nothing else reads it)
        elif u in rewritten and u.args[0] is v:
            joined += 1  # a convolution already reading the island (its copy in went before)
        elif _is_copy_to(u, torch.contiguous_format):
            joined += 1  # already the way out of an island
        elif u.op == "output" and not inference:
            ok = False  # a value a training graph returns (or saves for its backward) keeps its layout
        elif _keeps_layout(u):
            if u not in seen:
                seen.add(u)
                way.append(u)
                stack.extend((w, u) for w in u.users)
        elif u in convs.values() or u in backs:
            continue
        else:
            exits.append((u, v))
    ends = list(dict.fromkeys(ends))
    exits = list(dict.fromkeys(exits))
    if not ok or not (ends or joined or len(backs) > 1) or len(exits) > len(ends) + joined + len(backs) - 1:
        return False
    new = _island_values(graph, convs, way)
    if new is None or not _island_holds(new, convs, ends, exits, rewritten, fmt):
        return False
    for b, conv in convs.items():
        b.replace_all_uses_with(conv)
        graph.erase_node(b)
    for e in ends:
        e.replace_all_uses_with(e.args[0])
        graph.erase_node(e)
    for n, val in new.items():
        n.meta["val"] = val
    for u, v in exits:
        v = convs.get(v, v)
        with graph.inserting_before(u):
            out = graph.call_function(aten.clone.default, (v,), {"memory_format": torch.contiguous_format})
        out.meta["val"] = _fake(lambda t: t.clone(memory_format=torch.contiguous_format), _val(v))
        u.replace_input_with(v, out)
    return True


def channels_last_convolutions(gm: fx.GraphModule, decide: Callable[[fx.Node], bool] | None = None,
                               strip: Callable[[fx.Node], bool] | None = None) -> int:
    """Rewrite the convolutions `decide` picks (default: `islands`' timing); returns how many.
    First the bias of each convolution `strip` admits (default: `on_cuda`, looked up at the call)
    goes to the region after it (`strip_bias`), so the timing compares the convolutions as they
    will run."""
    from solforge import settings

    if not settings.current().conv_layout:
        return 0
    gm.meta[BIASES_MOVED] = strip_bias(gm, strip or on_cuda)
    if decide is None:
        decide = islands(gm).__contains__
    graph, done = gm.graph, 0
    backs: list[fx.Node] = []
    calls: list[tuple[fx.Node, Callable[..., Any]]] = []
    for n in list(graph.nodes):
        if not candidate(n) or not decide(n):
            continue
        x, w = n.args[0], n.args[1]
        xv, wv = _val(x), _val(w)
        fmt = _format(xv.dim())
        times = node_times(n) if xv.dtype == torch.float32 else None  # before the node changes
        call = _rewritten_call(xv, times is not None and times.tf32)
        # the new nodes' values first: a convolution whose values cannot be made stays untouched
        rest = [_val(v) if isinstance(v, fx.Node) else v for v in n.args[2:]]
        xcv = _fake(lambda t, f=fmt: t.clone(memory_format=f), xv)
        wcv = _fake(lambda t, f=fmt: t.clone(memory_format=f), wv)
        outv = _fake(lambda a, b, r=rest: CONV(a, b, *r), xcv, wcv)
        backv = _fake(lambda t: t.clone(memory_format=torch.contiguous_format), outv)
        with graph.inserting_before(n):
            # one channels-last copy of an input however many convolutions read it
            xc = x.meta.get(_COPY) if isinstance(x, fx.Node) else None
            if xc is None:
                xc = graph.call_function(aten.clone.default, (x,), {"memory_format": fmt})
                xc.meta["val"] = xcv
                if isinstance(x, fx.Node):
                    x.meta[_COPY] = xc
            wc = graph.call_function(aten.clone.default, (w,), {"memory_format": fmt})
        wc.meta["val"] = wcv
        n.args = (xc, wc, *n.args[2:])
        n.meta["val"] = outv
        with graph.inserting_after(n):
            back = graph.call_function(aten.clone.default, (n,), {"memory_format": torch.contiguous_format})
        back.meta["val"] = backv
        n.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b)
        backs.append(back)
        calls.append((n, call))
        done += 1
    for node in graph.nodes:  # the shared copies are this pass's bookkeeping only
        node.meta.pop(_COPY, None)
    if done:
        graph.lint()
        gm.recompile()
        cancel_copies(gm, backs)
        materialize_before_channel_reductions(gm)
        for n, call in calls:  # after the islands: they find the rewritten convolutions by their op
            n.target = call
        gm.recompile()
    return done
