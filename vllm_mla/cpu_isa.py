"""Make this process see fewer x86 CPU features than the host has (a test-harness switch).

vLLM CPU decides by ``torch.cpu`` feature queries which kernel library it loads
(``_C`` with AVX-512 BF16, ``_C_AVX512``, ``_C_AVX2``), which attention ISA it uses and,
through AMX, the MLA block size (128 with AMX, else 16). torch and oneDNN pick their own
kernels from ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``. ``VLLM_MLA_CPU_ISA`` caps
all of them at once, so a developer on an AMX host runs what an AVX2-only host runs:

========== ====================== =========================== ======================
level      vLLM library           torch.cpu says               torch / oneDNN cap
========== ====================== =========================== ======================
avx2       ``_C_AVX2``            no AVX-512, no VNNI, no AMX  ``avx2`` / ``AVX2``
avx512     ``_C_AVX512``          AVX-512, no BF16, no AMX     ``avx512`` / ``AVX512_CORE_VNNI``
avx512_bf16 ``_C``                AVX-512 BF16, no AMX         ``avx512`` / ``AVX512_CORE_BF16``
native     as the host            as the host                  unchanged
amx        (none: CUDA wheel)     AVX-512 BF16 and AMX tiles   unchanged
========== ====================== =========================== ======================

The first three levels only hide features: on a host without AVX-512, ``avx512`` changes
nothing that is not already so. ``amx`` is the one level that *claims* features: vLLM's
Python decisions (the GEMM binding, the MLA backend and block size) take the branches of
an AMX host, so a host without AMX checks what an AMX host decides. Nothing may then run
an AMX instruction, so it is refused where vLLM CPU's kernel libraries are installed and
the host has no AMX tiles; it serves the CUDA wheel's CPU platform mode (the vLLM-class
tests), which has no CPU kernels at all. AMX FP16 stays the host's answer (Sapphire
Rapids has AMX tiles without it). Each level but ``native`` compiles into its own torch
inductor cache (``inductor_cache_dir``).
``apply()`` must run before vLLM imports its kernels; the test
environments run it at interpreter start-up (a ``.pth`` file written by
``scripts/setup.sh``), so vLLM's spawned workers see the same CPU.
"""

from __future__ import annotations

import os

from vllm_mla import envs

# what each level lets torch.cpu report (a feature the host lacks stays False)
_VISIBLE = {
    "avx2": frozenset({"avx2"}),
    "avx512": frozenset({"avx2", "avx512", "vnni"}),
    "avx512_bf16": frozenset({"avx2", "avx512", "vnni", "avx512_bf16"}),
}
_QUERIES = {
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "vnni": "_is_vnni_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}
# what ``amx`` makes torch.cpu report True, whatever the host has
_CLAIMED = {"amx": frozenset({"avx2", "avx512", "vnni", "avx512_bf16", "amx"})}
_TORCH_CAP = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}
_ONEDNN_CAP = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16"}

_applied: str | None = None


def apply(level: str | None = None) -> str:
    """Cap this process's CPU features at ``level`` (default: ``VLLM_MLA_CPU_ISA``).

    Sets ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` (only if the user has not) and
    replaces the ``torch.cpu`` feature queries. Returns the level applied. Idempotent; a
    second, different level in the same process is a ValueError (torch has already
    chosen its kernels)."""
    global _applied
    level = envs.cpu_isa() if level is None else level
    if level not in envs.CPU_ISA_LEVELS:
        raise ValueError(f"VLLM_MLA_CPU_ISA must be one of {envs.CPU_ISA_LEVELS}, got {level!r}")
    if _applied is not None:
        if _applied != level:
            raise ValueError(f"CPU ISA already capped at {_applied!r} in this process")
        return level
    if level == "native":
        _applied = level
        return level
    if level in _CLAIMED:
        _refuse_claim_over_kernels(level)
        answers = dict.fromkeys(_CLAIMED[level], True)
    else:
        answers = {f: False for f in _QUERIES if f not in _VISIBLE[level]}
        # before torch is imported: both are read once, at first use
        os.environ.setdefault("ATEN_CPU_CAPABILITY", _TORCH_CAP[level])
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP[level])
    _applied = level
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(level)
    import torch.cpu

    for feature, answer in answers.items():
        name = _QUERIES[feature]
        if hasattr(torch.cpu, name):  # an older torch may lack a query
            setattr(torch.cpu, name, _answering(name, answer))
    return level


def inductor_cache_dir(level: str) -> str:
    """The torch inductor cache this level uses: its own folder, inside the one the user
    set (``TORCHINDUCTOR_CACHE_DIR``) or inside inductor's default.

    Inductor's caches are not keyed on the cap: graphs vLLM CPU compiled for a tiny
    bf16 GLM-5.3-Flash at ``native``, loaded from the shared cache under an ``avx2`` cap,
    served it with log-probabilities 0.5 nats off (the size of a scoring fault; a fresh
    cache at ``avx2`` serves it as ``native`` does), and an ``avx512`` engine loading that
    cache aborted (``free(): invalid pointer``). Idempotent: vLLM's workers inherit
    the variable and apply the level again."""
    leaf = f"vllm-mla-isa-{level}"
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:  # imports torch: call it after the variables torch reads at import
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    if os.path.basename(os.path.normpath(base)) == leaf:
        return base
    return os.path.join(base, leaf)


def _answering(name: str, answer: bool):
    """A ``torch.cpu`` feature query that always says ``answer`` (hidden or claimed)."""

    def query() -> bool:
        return answer

    query.__name__ = name
    query.__doc__ = f"{answer}: {'claimed' if answer else 'hidden'} by VLLM_MLA_CPU_ISA={_applied}"
    return query


def host_flags() -> frozenset[str]:
    """The host's own CPU flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vllm_cpu_libraries() -> list[str]:
    """vLLM CPU's kernel libraries installed beside vLLM (found without importing it)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return []
    folder = Path(spec.origin).parent
    return sorted(p.name for p in folder.glob("_C_AVX*.so"))


def _refuse_claim_over_kernels(level: str) -> None:
    """A claimed feature the host lacks must never reach a kernel that executes it."""
    if "amx_tile" in host_flags():
        return  # the host has AMX: the claim changes nothing
    libraries = vllm_cpu_libraries()
    if libraries:
        raise ValueError(
            f"VLLM_MLA_CPU_ISA={level} claims AMX tiles this host lacks, and the installed "
            f"vLLM ships CPU kernels ({', '.join(libraries)}) that would execute AMX "
            "instructions; use it with the CUDA wheel in CPU platform mode only"
        )


def applied() -> str | None:
    """The level this process was capped at, or None if ``apply`` never ran."""
    return _applied


def start_up() -> None:
    """The ``.pth`` hook: apply the environment's level, do nothing when it is native.

    Never raises: a bad value is reported when the suite starts (``apply()`` again)."""
    try:
        if envs.cpu_isa() != "native":
            apply()
    except ValueError:
        pass
