"""Helpers for running the kernels under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(v):
    """fp32 -> nearest bf16 (ties to even), still as fp32. Only for Triton's interpreter, whose bf16
    cast truncates (the GPU's cast rounds already): a value one bf16 ulp off can move a result past
    its tolerance. layernorm rounds its residual sum with it; cross_entropy its logits' gradient,
    which linear_cross_entropy's reference rounds as the model does."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _probe() -> None:
    pass


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import.
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
# Triton 3.6's interpreter casts fp32 to bf16 by truncation (1.0 + 2^-8 + 2^-12 -> 1.0), while the
# GPU rounds to nearest even like torch: off the GPU the kernels round by hand, so CPU tests
# compare the same function the GPU computes (bf16 results then match the reference bit for bit
# except at rare rounding ties), not one with a systematic one-ulp bias.
_RNE_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def cast_rne(v, dtype: tl.constexpr):
    """v cast to `dtype`, an fp32 v rounded to nearest even on the GPU and in the interpreter alike."""
    if _RNE_BY_HAND:
        if dtype == tl.bfloat16 and v.dtype == tl.float32:
            v = round_bf16(v)
    return v.to(dtype)


def _scalar_index(self: tl.tensor) -> int:
    data = self.handle.data
    # A 1-element array (how the interpreter holds every scalar) -> its element; anything larger
    # keeps the interpreter's own error.
    return int(data.reshape(()) if data.size == 1 else data)


def _fix_scalar_index() -> None:
    """Let the interpreter run `for i in range(n)` / `tl.range(0, n, B)` with a runtime bound n.

    Triton 3.6's interpreter holds a scalar as a 1-element numpy array and, while a kernel runs,
    sets `tl.tensor.__index__` to `int(array)`, which range() calls on its bounds. numpy 2.4 made
    int() of an array with ndim > 0 a TypeError (triton-lang/triton#9171; fixed upstream after 3.6
    by squeezing the array). Without this the CPU tests could only run while-loop copies of the
    kernels' loops, not the loops the GPU compiles. Installed only under the interpreter; it wraps
    the hook the interpreter calls per launch, so nothing changes where that hook does not exist.
    """
    from triton.runtime import interpreter

    hook = getattr(interpreter, "_patch_lang_tensor", None)
    if hook is None or getattr(hook, "solforge_index", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        hook(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patch_lang_tensor.solforge_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _share_patches() -> None:
    """Patch triton.language once per launch, not once per device-function call (CPU speed only).

    Triton 3.6's interpreter patches the language module (every builtin of tl, tl.core, tl.math
    and tl.tensor: an inspect.getmembers walk each) at a kernel launch, restores it after, and
    patches it again, identically, at every call of a nested @triton.jit function, whose scope is
    then dropped. The kernels call small device functions in their inner loops (rope's backward
    ~30 per program), so most of a CPU test's interpreter time went to repatching (measured: 26%
    of one rope_bwd verification by cProfile). A nested call whose language modules the running
    launch already patched gets no new patch; anything else goes to the interpreter's own code.
    The same builder and the same wrappers either way, so the kernels compute the same values.
    """
    import inspect
    import weakref

    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "solforge_shared", False):
        return
    patched: list[set[int]] = []  # the language modules patched by the launch running now (0 or 1 entry)

    seen: weakref.WeakKeyDictionary[object, tuple[int, set[int]]] = weakref.WeakKeyDictionary()

    def langs(fn: object) -> set[int]:
        glb = getattr(fn, "__globals__", {})
        try:  # per function, walked again only if its module gained names since
            n, got = seen[fn]
            if n == len(glb):
                return got
        except (KeyError, TypeError):
            pass
        got = {id(v) for v in glb.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        try:
            seen[fn] = (len(glb), got)
        except TypeError:  # not weakly referable: walked at every call, as before
            pass
        return got

    class _Launch:
        def __init__(self, scope: object) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.clear()
            self.scope.restore()  # type: ignore[attr-defined]

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn: object) -> object:
        want = langs(fn)
        if patched and want <= patched[0]:
            return _Nothing()
        scope = real(fn)
        if patched:  # a nested call reaching a module the launch did not patch: kept patched, as before
            patched[0] |= want
            return scope
        patched.append(set(want))  # (a copy: the launch's set grows, the memo's must not)
        return _Launch(scope)

    patch_lang.solforge_shared = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang

    real_np = getattr(interpreter, "_get_np_dtype", None)
    if real_np is None:
        return
    memo: dict[object, object] = {}

    def get_np_dtype(tt_dtype: object) -> object:
        """The interpreter's dtype map, memoized (it built a 19-entry dict on every call)."""
        el = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(el, tl.pointer_type):
            return real_np(el)
        got = memo.get(el)
        if got is None:
            got = memo[el] = real_np(el)
        return got

    interpreter._get_np_dtype = get_np_dtype


def _memo_block_shapes() -> None:
    """Build a block's shape and a tensor's shape once per shape, not once per op (CPU speed only).

    Under the interpreter every op of every program makes new `tl.block_type`s and `tl.tensor`s, each
    of which unwrapped, validated and wrapped its shape again (a `tl.tuple`, with a tuple type and its
    name string). The shapes are plain ints by then: Triton's own shape objects for a shape are made
    once and shared from then on (nothing in the interpreter mutates them). Any other shape
    (constexprs, a 0-d or an invalid one) goes to Triton's own code, errors included.
    """
    core = tl.core
    real_block, real_tensor = core.block_type.__init__, core.tensor.__init__
    if getattr(real_tensor, "solforge_memo", False):
        return
    blocks: dict[tuple[int, ...], tuple[object, int, str]] = {}
    listed = (list, tuple, core.tuple)  # a block type's own shape (a tl.tuple) comes back in with_element_ty
    tensors: dict[tuple[int, ...], tuple[object, object]] = {}

    def block_init(self, element_ty, shape) -> None:
        key = tuple(shape) if type(shape) in listed else None
        got = blocks.get(key) if key is not None else None
        if got is None:
            real_block(self, element_ty, shape)
            if key is not None and all(type(s) is int for s in key):
                blocks[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty, (self.shape, self.numel, text) = element_ty, got
        self.name = f"<{text}, {element_ty}>"

    def tensor_init(self, handle, ty) -> None:
        shape = tuple(ty.shape) if ty.is_block() else ()  # plain ints: a tl.tuple's == is a constexpr
        got = tensors.get(shape)
        if got is None:
            real_tensor(self, handle, ty)
            if all(type(s) is int for s in shape):
                tensors[shape] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, ty, ty.scalar
        self.numel, self.shape = got

    tensor_init.solforge_memo = True  # type: ignore[attr-defined]
    core.block_type.__init__ = block_init
    core.tensor.__init__ = tensor_init


def _no_discarded_overflow_checks() -> None:
    """Skip the integer-overflow check whose assert the interpreter drops anyway (CPU speed only).

    Triton 3.6's interpreter runs with `sanitize_overflow` on and `debug` off: every int32 add, sub
    and mul of every program is redone in int64 and compared with int32's range, and the result
    goes to `device_assert`, which returns without looking at it unless `debug` is on. That was a
    quarter of the CPU tests' interpreter time (cProfile of tests/test_generated.py, 2026-11-28).
    With `debug` on (TRITON_DEBUG) the check stays, and asserts.
    """
    import dataclasses

    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    if b.options.sanitize_overflow and not b.options.debug:
        b.options = dataclasses.replace(b.options, sanitize_overflow=False)


if INTERPRETED:
    _fix_scalar_index()
    _share_patches()
    _memo_block_shapes()
    _no_discarded_overflow_checks()
