"""``kernel_targets.register``: vLLM's ``register_kernels`` in a process whose modules its
holder scan cannot read (llvmlite's ``ffi.lib`` answers ``__dict__`` with a C-function
wrapper; numba imports it, and vLLM's ngram proposer imports numba before the model's
first DCP layer installs its stand-ins)."""

from __future__ import annotations

import sys
import types

import pytest
from vllm.triton_utils import dispatcher

from vllm_mla.vllm.sparse import kernel_targets


class FunctionWrapper:
    """llvmlite's ``_lib_fn_wrapper``: a callable with slots and nothing else."""

    __slots__ = ()

    def __call__(self, *args):
        return None


class AnswersEverything:
    """llvmlite's ``_lib_wrapper`` in miniature: every attribute is a function wrapper."""

    __slots__ = ()

    def __getattr__(self, name):
        return FunctionWrapper()


@pytest.fixture
def unscannable_module(monkeypatch):
    module = types.ModuleType("fake_llvmlite_ffi")
    module.lib = AnswersEverything()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def scan() -> None:
    """vLLM's scan for other holders of a kernel, as register_kernels runs it (renamed
    ``_rebind_impls`` in 0.34)."""
    (getattr(dispatcher, "_rebind_kernels", None) or dispatcher._rebind_impls)([])


def test_vllms_own_scan_fails_on_such_a_module_before_0_34(unscannable_module):
    """The control: 0.32 and 0.33 stop on it; 0.34 reads only real dicts (fixed upstream)."""
    if not hasattr(dispatcher, "_rebind_kernels"):
        scan()  # 0.34: passes by itself
        return
    with pytest.raises(AttributeError, match="has no attribute 'get'"):
        scan()


def test_register_hides_it_for_the_call_and_puts_it_back(monkeypatch, unscannable_module):
    seen = []

    def register_kernels(overrides):  # vLLM's scan, then what register_kernels was given
        scan()
        seen.append((dict(overrides), unscannable_module.__name__ in sys.modules))

    monkeypatch.setattr(dispatcher, "register_kernels", register_kernels)
    kernel_targets.register({"some.kernel": print})
    assert seen == [({"some.kernel": print}, False)]
    assert sys.modules[unscannable_module.__name__] is unscannable_module
