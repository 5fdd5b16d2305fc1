"""What the end-to-end result needs said beside its numbers: random ops the model draws (both
models started from one seed), and why a slower optimized model may be slower."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def random_ops(graphs: Iterable[torch.fx.GraphModule]) -> list[str]:
    """The seeded-random ATen ops (dropout, rand, bernoulli, ...) the graphs call, by name; not an
    attention or dropout call whose dropout probability is 0 (or whose `train` is False): those are
    tagged as random but draw nothing."""
    names = {n.target._overloadpacket.__name__ for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
             and torch.Tag.nondeterministic_seeded in n.target.tags and _draws(n)}
    return sorted(names)


def _draws(node: torch.fx.Node) -> bool:
    schema = node.target._schema  # type: ignore[union-attr]
    args = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
            for i, a in enumerate(schema.arguments)}
    if "dropout_p" in args:
        return args["dropout_p"] not in (0, 0.0, None)
    if schema.name in ("aten::native_dropout", "aten::dropout"):
        return args.get("p") not in (0, 0.0) and args.get("train") is not False
    return True


def host_time(step_graphs: Sequence[Any]) -> str:
    """What the graphs' timed calls (stepgraphs.py: host time to enqueue a call against its GPU
    time) say about a slow end-to-end result."""
    timed = [s for s in step_graphs if s.host_s is not None and s.gpu_s is not None]
    if not timed:
        return "a step this small may be bound by the host's launches"
    host, gpu = sum(s.host_s for s in timed) * 1e6, sum(s.gpu_s for s in timed) * 1e6
    bound = ": bound by the host" if host >= gpu else ""
    return f"its timed call took {host:.0f} us of host time for {gpu:.0f} us on the GPU{bound}"
