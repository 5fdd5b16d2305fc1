"""noops.py: a concatenation with one non-empty piece becomes that piece, where nothing can tell."""

from __future__ import annotations

import torch

from solforge import capture

aten = torch.ops.aten


class PartialRotary(torch.nn.Module):
    """Phi-3's spelling: the rotated part and the part that passes through, joined again; with a
    rotary dim equal to the head dim the second piece is empty."""

    def __init__(self, rotary: int) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        rot, keep = q[..., : self.rotary], q[..., self.rotary :]
        return torch.cat([rot * 2.0, keep], dim=-1).sum(-1)


def _cats(m: torch.nn.Module, *inputs: torch.Tensor) -> tuple[int, int]:
    with torch.no_grad():
        cap = capture.capture(m, inputs)
    (g,) = cap.graphs
    return sum(n.target == aten.cat.default for n in g.aten.graph.nodes), g.empty_concats


def test_an_empty_piece_is_dropped_and_the_values_are_the_same() -> None:
    q = torch.randn(2, 4, 6, 8)
    assert _cats(PartialRotary(8), q) == (0, 1)
    assert _cats(PartialRotary(6), q) == (1, 0)  # a real pass-through part stays
    with torch.no_grad():
        cap = capture.capture(PartialRotary(8), (q,))
        torch.testing.assert_close(cap.graphs[0].aten(q)[0], PartialRotary(8)(q), rtol=0, atol=0)


class Attention(torch.nn.Module):
    """Phi-3's layout: q and k token-major, seen heads first (transposed), rotated elementwise (the
    result keeps that layout), joined with an empty pass-through part; then SDPA reads them, or,
    with `flat`, a view that needs the cat's contiguous layout."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.flat = flat

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        D = q.shape[-1]
        q = torch.cat([q * 0.5, q[..., D:]], dim=-1)
        k = torch.cat([k * 2.0, k[..., D:]], dim=-1)
        if self.flat:
            return q.view(-1).sum() + k.view(-1).sum()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_piece_in_another_layout_is_dropped_only_before_attention() -> None:
    q, k, v = (torch.randn(2, 6, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert _cats(Attention(), q, k, v) == (0, 2)
    with torch.no_grad():
        cap = capture.capture(Attention(), (q, k, v))
        torch.testing.assert_close(cap.graphs[0].aten(q, k, v)[0], Attention()(q, k, v))
    assert _cats(Attention(flat=True), q, k, v) == (2, 0)


class Promoting(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.zeros(x.shape[0], 0, dtype=torch.float32)
        return torch.cat([x * 2, empty], dim=1).sum()


class Escaping(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x * 2, x[:, :0]], dim=1)


class WrittenAfter(torch.nn.Module):
    """The piece is written in place after the cat: the cat's copy holds the values from before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        joined = torch.cat([y, y[:, :0]], dim=1)
        y.add_(1.0)
        return joined.sum() + y.sum()


def test_what_would_tell_the_difference_is_left_alone() -> None:
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    assert _cats(Promoting(), x) == (1, 0)  # bf16 joined with fp32 is fp32: not the piece
    assert _cats(Escaping(), x) == (1, 0)  # the caller would get a view where it got a new tensor
    with torch.no_grad():
        cap = capture.capture(WrittenAfter(), (x.float(),))
    out = cap.graphs[0].aten(x.float())[0]
    torch.testing.assert_close(out, WrittenAfter()(x.float()))
