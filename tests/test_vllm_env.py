"""scripts/vllm_env.py: the one place where vLLM's pins the package index cannot serve are
replaced (setup.sh's vLLM 0.34 environment, scripts/check_newest_vllm.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env():
    spec = importlib.util.spec_from_file_location("vllm_env", ROOT / "scripts" / "vllm_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_exact_pin_an_override_names_is_replaced():
    env = _env()
    assert env.overridden("flashinfer-python", "==0.7.3") == "flashinfer-python==0.7.4"
    assert env.overridden("FlashInfer-Python", "==0.7.3") == "FlashInfer-Python==0.7.4"
    assert env.overridden("flashinfer-python", "==0.7.5") is None  # a later pin: vLLM's own
    assert env.overridden("flashinfer-python", ">=0.7.3") is None
    assert env.overridden("torch", "==2.14.0") is None


def test_every_override_moves_a_pin_and_says_why():
    for (name, pinned), (instead, why) in _env().OVERRIDES.items():
        assert name == name.lower() and pinned != instead and len(why) > 40
