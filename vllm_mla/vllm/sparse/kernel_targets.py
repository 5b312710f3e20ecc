"""vLLM Triton kernels our CPU stand-ins replace: found by dotted name, bound by name.

``vllm.triton_utils.dispatcher.register_kernels`` calls an override with the arguments
vLLM's launcher passes, positionally, in the kernel's own parameter order; that order
changes between vLLM versions (0.34 inserted ``positions_ptr`` into the indexer's prefill
chunk kernel). A stand-in therefore reads its arguments by the installed kernel's
parameter names (``bind``), captured before the override replaces the kernel.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_SIGNATURES: dict[str, inspect.Signature] = {}
TRITON_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass(frozen=True)
class StandIn:
    """One vLLM Triton kernel served by a torch stand-in on CPU (``register_kernels``)."""

    kernel: str
    impl: object
    why: str
    how: str
    removal: str


def launched_by_name(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, also taking Triton's launch options (dropped). vLLM's ``KernelOverride``
    forwards a launch by keyword only when the stand-in's parameters are exactly the
    kernel's (its signature, which ``functools.wraps`` keeps), and a jit-warmup launch
    passes ``num_warps`` among them."""

    @functools.wraps(fn)
    def launch(**kwargs: object) -> None:
        for option in TRITON_LAUNCH_OPTIONS:
            kwargs.pop(option, None)
        fn(**kwargs)

    return launch


def launch_arguments(path: str, args: tuple, kwargs: dict) -> dict[str, object]:
    """``bind`` after dropping Triton's launch options (a direct ``kernel[grid](...,
    num_warps=4)`` launch passes them to the stand-in)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in TRITON_LAUNCH_OPTIONS}
    return bind(path, args, kwargs)


def kernel_at(path: str) -> object | None:
    """The object at ``module.Class.attr`` (None when the module or an attribute is absent)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        return owner
    return None


def function_of(kernel: object) -> Callable:
    """The Python function behind a Triton kernel (or its launcher), or the object itself."""
    return getattr(kernel, "fn", None) or getattr(kernel, "func", None) or kernel


def constexpr_positions(kernel: object) -> tuple[int, ...]:
    """Positions of the ``tl.constexpr`` parameters of a Triton kernel's function."""
    params = inspect.signature(function_of(kernel)).parameters.values()
    return tuple(index for index, p in enumerate(params) if str(p.annotation).endswith("constexpr"))


def remember(path: str) -> None:
    """Record the installed kernel's signature (call before overriding it)."""
    if path not in _SIGNATURES:
        kernel = kernel_at(path)
        if kernel is None:
            raise LookupError(f"vLLM has no kernel {path}")
        _SIGNATURES[path] = inspect.signature(function_of(kernel))


def bind(path: str, args: tuple, kwargs: dict) -> dict[str, object]:
    """A launch's arguments by the kernel's parameter names; absent ones are missing.
    Without a recorded signature (no vLLM: a direct call) only keywords are accepted."""
    signature = _SIGNATURES.get(path)
    if signature is None:
        if args:
            raise TypeError(
                f"{path}: positional arguments need the installed kernel's parameter order "
                "(kernel_targets.remember runs when the stand-in is registered); pass keywords"
            )
        return dict(kwargs)
    return dict(signature.bind_partial(*args, **kwargs).arguments)


def _unscannable(value: object) -> bool:
    """Whether vLLM's holder scan (``_rebind_kernels``: ``vars(value).get``) fails on it.
    llvmlite's ``ffi.lib`` (imported with numba, e.g. by vLLM's ngram proposer) answers
    every attribute, ``__dict__`` included, with a C-function wrapper."""
    try:
        return hasattr(value, "__dict__") and not hasattr(vars(value), "get")
    except TypeError:
        return False


def register(overrides: dict[str, Callable]) -> None:
    """``vllm.triton_utils.dispatcher.register_kernels(overrides)``, with the modules vLLM's
    scan for other holders of a kernel cannot read (a value whose ``vars()`` is no mapping)
    out of ``sys.modules`` for the call: such a module holds no Triton kernel, and without
    this a process that imported numba before the first DCP layer stops with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` (vLLM 0.32 and
    0.33; 0.34's scan reads only real dicts, and hiding changes nothing there)."""
    import sys

    from vllm.triton_utils.dispatcher import register_kernels

    hidden = {
        name: module
        for name, module in list(sys.modules.items())
        if any(_unscannable(v) for v in list(getattr(module, "__dict__", {}).values()))
    }
    for name in hidden:
        del sys.modules[name]
    try:
        register_kernels(overrides)
    finally:
        sys.modules.update(hidden)


def _installed(dispatcher: object, name: str, impl: object) -> bool:
    """Whether ``name`` already launches ``impl`` (registered by an earlier call)."""
    host, attr = dispatcher._resolve_kernel(name)
    return getattr(getattr(host, attr, None), "func", None) is impl


def register_stand_ins(stand_ins: Iterable[StandIn]) -> bool:
    """Each stand-in through ``register`` once (a second registration would wrap our own
    wrapper), each kernel's parameter order remembered first; False where vLLM's Triton
    runs (nothing registered)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    from vllm.triton_utils import dispatcher

    wanted = {s.kernel: s.impl for s in stand_ins}
    missing = {n: impl for n, impl in wanted.items() if not _installed(dispatcher, n, impl)}
    for name in missing:
        remember(name)
    if missing:
        register(missing)
    return True
