"""Which of vLLM CPU's kernel libraries this process runs, and which the host features ask.

vLLM CPU ships three builds of its kernels (``_C``: AVX-512 with BF16; ``_C_AVX512``;
``_C_AVX2``) and loads one by ``torch.cpu`` feature queries (``CpuPlatform.import_kernels``);
they sum in different orders and do not all hold the same ops (``_C_AVX2`` and
``_C_AVX512`` have no ``fp8_paged_mqa_logits_cpu``). MLA's block size follows AMX (128 with
AMX tiles, else 16). ``VLLM_MLA_CPU_ISA`` (``vllm_mla.cpu_isa``) hides features so one host
runs what another runs; ``describe()`` is what the tests and the engine state report.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

LIBRARIES = ("_C", "_C_AVX512", "_C_AVX2")
_X86 = ("x86_64", "amd64", "i386", "i686")


def expected_library() -> str | None:
    """The library ``CpuPlatform.import_kernels`` picks here (None off x86)."""
    import torch

    if platform.machine().lower() not in _X86:
        return None
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def loaded_libraries() -> list[str]:
    """vLLM kernel libraries mapped into this process (read from ``/proc/self/maps``)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    found = set(re.findall(r"/vllm/(_C(?:_AVX2|_AVX512)?)\.[\w.]*so", maps.read_text()))
    return sorted(found)


def has_amx() -> bool:
    """AMX tiles as vLLM CPU sees them (its MLA backend and block-size choice)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def describe() -> dict:
    """The CPU as this process sees it: the ISA cap, the expected and loaded libraries."""
    from vllm_mla import cpu_isa

    return {
        "isa": cpu_isa.applied() or "native",
        "expected_library": expected_library(),
        "loaded_libraries": loaded_libraries(),
        "amx": has_amx(),
    }
