"""The capture stage of `optimize`: the model run once through the backend (with the lowering
cache beside the kernel database), a failure to run said in one line, and what the capture's
passes did, as notes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from solforge import settings
from solforge.capture.backend import SolforgeBackend, capture
from solforge.capture.cache import LoweringCache
from solforge.capture.layout import BIASES_MOVED, DECISIONS
from solforge.errors import UserError


def lowering_cache(db: str | Path | bool) -> LoweringCache | None:
    """The ATen lowering cache beside the kernel database (`lowered/` in its directory): a run that
    keeps no database keeps no lowerings either. SOLFORGE_LOWERING_CACHE=0 (settings.lowering_cache)
    turns it off alone; SOLFORGE_LOWERING_DIR (settings.lowering_dir) puts it elsewhere (entries are
    keyed and checksummed, so several databases can share one: the CPU tests do)."""
    if db is False or not settings.current().lowering_cache:
        return None
    if settings.current().lowering_dir is not None:
        return LoweringCache(settings.current().lowering_dir)
    from solforge.db import default_path

    path = default_path() if db is True else Path(db).expanduser()
    return LoweringCache(path.parent / "lowered")


def capture_model(model: torch.nn.Module, inputs: Sequence[Any], *, train: bool,
                  cache: LoweringCache | None, skip_logits: bool = False) -> SolforgeBackend:
    """capture(), a model that fails on its example inputs being the user's error (one line)."""
    try:
        # train: captured with autograd on, as training runs it; the fused ops carry their backward
        return capture(model, inputs, grad=train, cache=cache, skip_logits=skip_logits)
    except Exception as e:
        raise UserError(f"the model failed to run on its example inputs: {type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e


def capture_notes(captured: SolforgeBackend, cache: LoweringCache | None) -> list[str]:
    """The capture's errors, the lowering cache's hits and problems, the attention calls restored."""
    notes = list(captured.errors)
    if cache is not None:
        if cache.hits:
            notes.append(f"capture: {cache.hits} ATen graph(s) read from the lowering cache "
                         f"({cache.directory}) instead of traced again")
        notes += [f"lowering cache: {p}" for p in dict.fromkeys(cache.problems)]
    restored = sum(g.attention_restored for g in captured.graphs)
    if restored:
        notes.append(f"attention: {restored} SDPA call(s) traced with a mask computed from sizes alone run as "
                     "eager runs them: is_causal where the mask is causal, without a mask where it allows every "
                     "key (no K/V repeat copies)")
    layouts = sum(g.conv_layouts for g in captured.graphs)
    if layouts:
        notes.append(f"convolutions: {layouts} run channels-last, timed faster that way on this GPU with the copies "
                     "in and out counted (capture/layout.py; SOLFORGE_CONV_LAYOUT=0 turns it off)")
    decisions = [d for g in captured.graphs if g.aten is not None for d in g.aten.meta.get(DECISIONS, ())]
    notes += [f"convolution layout: {d.text()}" for d in decisions]
    moved = sum(g.aten.meta.get(BIASES_MOVED, 0) for g in captured.graphs if g.aten is not None)
    if moved:
        notes.append(f"convolutions: {moved} bias(es) added in the region after the convolution, not in a pass "
                     "of ATen's own (capture/layout.py strip_bias)")
    return notes
