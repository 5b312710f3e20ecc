"""Build hook for the optional CUDA op ``vllm_mla._C`` (csrc/query_bmm.cu); metadata is in
pyproject.toml.

The extension is built only when the build environment imports a torch with CUDA and finds nvcc
(CUDA_HOME or PATH); otherwise this is a plain pure-Python install and vllm_mla falls back to
torch.bmm. pip's build isolation hides the installed torch, so the CUDA op builds only with

    pip install --no-build-isolation -e .

Target GPUs come from explicit -gencode flags (no GPU detection): sm_80 sm_86 sm_89 sm_90 sm_100
sm_120 (+ PTX of the newest), or ``VLLM_MLA_CUDA_ARCHS``, e.g. ``VLLM_MLA_CUDA_ARCHS="90;120"``.
The library uses only PyTorch's stable C ABI (torch >= 2.10) and no CPython API at all, so one
abi3 binary serves every Python and torch version from those floors on.
"""

from __future__ import annotations

import os
import re
import shutil

from setuptools import setup

DEFAULT_ARCHS = ("80", "86", "89", "90", "100", "120")
# Stable-ABI targets: 2.13 (current stream through the accelerator API), 2.10 for older torch.
TORCH_TARGETS = {(2, 13): "0x020d000000000000", (2, 10): "0x020a000000000000"}


def defines(torch_version: str) -> list[str]:
    """Compiler defines for the torch we build against (``torch.__version__``)."""
    major, minor = (int(x) for x in re.findall(r"\d+", torch_version)[:2])
    for floor, target in TORCH_TARGETS.items():
        if (major, minor) >= floor:
            return [f"-DTORCH_TARGET_VERSION={target}", "-DUSE_CUDA"]
    raise RuntimeError(f"torch {torch_version} predates the stable ABI this op needs (2.10)")


def find_nvcc() -> str | None:
    """nvcc under CUDA_HOME, else on PATH; sets CUDA_HOME when unset so torch links its cudart."""
    if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    home = os.environ.get("CUDA_HOME")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc and not home:
        os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return nvcc


def cuda_build_decision() -> tuple[bool, str]:
    """(build the CUDA extension?, why). Never raises: no CUDA means a pure-Python install."""
    if os.environ.get("VLLM_MLA_CUDA_ARCHS", "").strip().lower() == "none":
        return False, "VLLM_MLA_CUDA_ARCHS=none"
    try:
        import torch
    except ImportError:
        return False, "torch is not importable here (pip build isolation? use --no-build-isolation)"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    nvcc = find_nvcc()
    if nvcc is None:
        return False, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {nvcc}"


def cuda_archs() -> list[str]:
    """Compute capabilities to build, e.g. ["90", "120"], from VLLM_MLA_CUDA_ARCHS or defaults."""
    raw = os.environ.get("VLLM_MLA_CUDA_ARCHS", "").strip()
    if not raw:
        return list(DEFAULT_ARCHS)
    archs = []
    for item in re.split(r"[;,\s]+", raw):
        arch = item.replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch) or int(re.sub(r"\D", "", arch)) < 80:
            raise SystemExit(
                f"VLLM_MLA_CUDA_ARCHS: {item!r} is not a compute capability >= 8.0 "
                "(the kernel needs bf16 tensor cores), e.g. '90;120'"
            )
        archs.append(arch)
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for each arch plus PTX of the newest, so later GPUs can JIT it."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=lambda a: int(re.sub(r"\D", "", a)))
    return [*flags, f"-gencode=arch=compute_{newest},code=compute_{newest}"]


def ext_modules_and_cmdclass() -> tuple[list, dict]:
    build, why = cuda_build_decision()
    if not build:
        print(f"vllm_mla: building without the CUDA op: {why}")
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    print(f"vllm_mla: building the CUDA op vllm_mla._C with {why}")
    ext = CUDAExtension(
        "vllm_mla._C",
        ["csrc/query_bmm.cu"],
        py_limited_api=True,
        extra_compile_args={
            "cxx": ["-O3", *defines(torch.__version__)],
            "nvcc": ["-O3", *defines(torch.__version__), *gencode_flags(cuda_archs())],
        },
    )
    return [ext], {"build_ext": BuildExtension}


if __name__ == "__main__":  # setuptools' build backend also runs this file as __main__
    ext_modules, cmdclass = ext_modules_and_cmdclass()
    # Tag wheels abi3: the library calls no CPython API, so one binary fits every Python.
    options = {"bdist_wheel": {"py_limited_api": "cp311"}} if ext_modules else {}
    setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
