"""VLLM_MLA_CPU_ISA makes vLLM CPU load the kernel library of a host with fewer features.

What an AVX2-only or AVX-512-without-BF16 host runs is run here by hiding features; each
level runs in a fresh interpreter (vLLM imports its library once per process) and must load
exactly the library ``CpuPlatform.import_kernels`` picks for those features. A level whose
features the host lacks is skipped naming them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm_mla.vllm import cpu_host
print(json.dumps(cpu_host.describe()))
"""
# level -> (library it must load, host feature it needs, that feature's /proc/cpuinfo flag)
LEVELS = {
    "avx2": ("_C_AVX2", "AVX2", "avx2"),
    "avx512": ("_C_AVX512", "AVX-512", "avx512f"),
    "avx512_bf16": ("_C", "AVX-512 BF16", "avx512_bf16"),
}


def host_has(flag: str) -> bool:
    """The host's own feature (this process may run capped by VLLM_MLA_CPU_ISA)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the host's features from")
    return flag in cpuinfo.read_text().split()


def has_cpu_libraries() -> bool:
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm_mla.vllm import cpu_host

    return bool(cpu_host.loaded_libraries())


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_loads_its_vllm_cpu_library(level):
    library, feature, flag = LEVELS[level]
    if not has_cpu_libraries():
        pytest.skip("this vLLM build ships no CPU kernel libraries (vLLM CPU has them)")
    if not host_has(flag):
        pytest.skip(f"the host has no {feature}: {level} cannot be shown here")
    env = {**os.environ, "VLLM_MLA_CPU_ISA": level}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["isa"] == level, "the environment's start-up hook did not apply the level"
    assert seen["loaded_libraries"] == [library] == [seen["expected_library"]]
    assert seen["amx"] is False
