"""VLLM_MLA_CPU_ISA hides x86 features from torch and oneDNN (vllm_mla.cpu_isa).

Each case runs in a fresh interpreter: torch chooses its kernels once per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from vllm_mla import envs

PROBE = """
import json, sys
from vllm_mla import cpu_isa
level = cpu_isa.apply(sys.argv[1] if len(sys.argv) > 1 else None)
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
print(json.dumps({
    "level": level,
    "applied": cpu_isa.applied(),
    "avx512": torch.cpu._is_avx512_supported(),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "amx": torch.cpu._is_amx_tile_supported(),
    "capability": torch.backends.cpu.get_cpu_capability(),
    "inductor_cache": cache_dir(),
    "inductor_default": default_cache_dir(),
}))
"""

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 feature levels"
)


def probe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    own = ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")
    clean = {k: v for k, v in os.environ.items() if k not in own}
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def run(*args: str, env: dict | None = None) -> dict:
    result = probe(*args, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_avx2_hides_avx512_bf16_and_amx_from_torch_and_its_kernels():
    seen = run("avx2")
    assert seen["level"] == seen["applied"] == "avx2"
    assert not (seen["avx512"] or seen["avx512_bf16"] or seen["amx"])
    assert seen["capability"] in ("AVX2", "DEFAULT")  # DEFAULT: a host below AVX2


def test_each_capped_level_compiles_into_its_own_inductor_cache(tmp_path):
    """Inductor's caches are not keyed on the cap: a graph compiled at native and loaded
    under avx2 served a bf16 model wrongly (vllm_mla.cpu_isa.inductor_cache_dir)."""
    native, avx2 = run("native"), run("avx2")
    assert native["inductor_cache"] == native["inductor_default"]
    assert avx2["inductor_cache"] == os.path.join(avx2["inductor_default"], "vllm-mla-isa-avx2")
    assert run("avx512")["inductor_cache"] != avx2["inductor_cache"]
    # inside the user's own cache; a worker inheriting the variable keeps it
    mine = run("avx2", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})["inductor_cache"]
    assert mine == str(tmp_path / "vllm-mla-isa-avx2")
    assert run("avx2", env={"TORCHINDUCTOR_CACHE_DIR": mine})["inductor_cache"] == mine


def test_the_level_comes_from_the_environment():
    seen = run(env={"VLLM_MLA_CPU_ISA": "AVX512 "})  # case and spaces do not matter
    assert seen["level"] == "avx512"
    assert not (seen["avx512_bf16"] or seen["amx"])
    assert seen["avx512"] == torch.cpu._is_avx512_supported()  # never more than the host


def test_avx512_bf16_hides_only_amx():
    seen = run("avx512_bf16")
    assert not seen["amx"]
    assert seen["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()


def test_native_changes_nothing():
    seen = run("native")
    assert seen["applied"] == "native"
    assert seen["avx512"] == torch.cpu._is_avx512_supported()
    assert seen["amx"] == torch.cpu._is_amx_tile_supported()


def test_an_unknown_level_is_refused_naming_the_variable_and_the_levels():
    result = probe("avx3")
    assert result.returncode != 0
    assert "VLLM_MLA_CPU_ISA must be one of" in result.stderr
    assert all(level in result.stderr for level in envs.CPU_ISA_LEVELS)


def test_a_second_level_in_one_process_is_refused():
    script = PROBE + "\ncpu_isa.apply('avx512')\n"
    result = subprocess.run(
        [sys.executable, "-c", script, "avx2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "already capped at 'avx2'" in result.stderr


def test_the_start_up_hook_never_raises_on_a_bad_value():
    script = "from vllm_mla import cpu_isa; cpu_isa.start_up(); print(cpu_isa.applied())"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VLLM_MLA_CPU_ISA": "avx3"},
    )
    assert result.returncode == 0 and result.stdout.strip() == "None"


def test_amx_claims_avx512_bf16_and_amx_and_leaves_torchs_kernels_alone():
    """``amx`` is the one claiming level: torch.cpu reports AVX-512 BF16 and AMX tiles
    whatever the host has, so vLLM's Python decisions take an AMX host's branches; torch's
    own kernel choice is not capped (nothing may run AMX it does not have)."""
    seen = run("amx")
    assert seen["level"] == seen["applied"] == "amx"
    assert seen["avx512"] and seen["avx512_bf16"] and seen["amx"]
    assert seen["capability"] == run("native")["capability"]


def test_amx_is_refused_beside_vllm_cpu_kernels_on_a_host_without_amx(monkeypatch):
    """vLLM CPU's libraries would execute the claimed AMX instructions: refused, named."""
    from vllm_mla import cpu_isa

    monkeypatch.setattr(cpu_isa, "_applied", None)
    monkeypatch.setattr(cpu_isa, "host_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(cpu_isa, "vllm_cpu_libraries", lambda: ["_C_AVX2.abi3.so"])
    with pytest.raises(ValueError, match=r"claims AMX tiles this host lacks.*_C_AVX2\.abi3\.so"):
        cpu_isa.apply("amx")
    assert cpu_isa.applied() is None  # nothing claimed
    # an AMX host: the claim changes nothing, so nothing is refused
    monkeypatch.setattr(cpu_isa, "host_flags", lambda: frozenset({"amx_tile"}))
    cpu_isa._refuse_claim_over_kernels("amx")
