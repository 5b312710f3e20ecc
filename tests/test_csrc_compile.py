"""csrc/query_bmm.cu compiles against the installed torch's stable ABI, and setup.py decides well.

No GPU needed: nvcc compiles one arch to an object (the same defines as setup.py), the object
must reference only the stable C shim (no ATen / c10 C++ symbols), and, linked against the CPU
libraries plus cudart, it must register the op next to the Python fake / CPU impls.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from vllm_mla.ops import query_bmm
from vllm_mla.ops.query_bmm import custom_op as query_bmm_op

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "query_bmm.cu"
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="vllm_mla_setup")  # no setup() call
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def cuda_home() -> Path:
    """Where cudart lives; nvcc on PATH may be a wrapper script outside the toolkit."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    if Path("/usr/local/cuda").is_dir():
        return Path("/usr/local/cuda")
    return Path(os.path.realpath(NVCC)).parents[1]


def compile_object(obj: Path, torch_version: str) -> Path:
    """nvcc -c for sm_90 with setup.py's defines for ``torch_version``."""
    cmd = [
        NVCC,
        "-c",
        str(SOURCE),
        "-o",
        str(obj),
        "-std=c++17",
        "-O3",
        "-Xcompiler",
        "-fPIC",
        "-gencode",
        "arch=compute_90,code=sm_90",
        *SETUP["defines"](torch_version),
        *cpp_extension.COMMON_NVCC_FLAGS,  # what BuildExtension adds (e.g. no bf16 conversions)
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{cuda_home() / 'include'}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    return obj


# torch >= 2.13 targets the 2.13 stable ABI (the stream through torch_stream_native_handle);
# older torch the 2.10 one (the stream from libtorch_cuda's aoti_torch_get_current_cuda_stream)
TARGET_2_13 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
STREAM_SYMBOL = (
    "torch_stream_native_handle" if TARGET_2_13 else "aoti_torch_get_current_cuda_stream"
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_object(tmp_path_factory.mktemp("csrc") / "query_bmm.o", torch.__version__)


@needs_nvcc
def test_compiles_for_torch_before_2_13(tmp_path):
    """GPU images may carry torch 2.10-2.12: the 2.10 stable-ABI target must build too."""
    obj = compile_object(tmp_path / "old.o", "2.11.0+cu130")
    undefined = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True).stdout
    assert "aoti_torch_get_current_cuda_stream" in undefined


@pytest.mark.parametrize(
    ("version", "target"),
    [("2.14.0+cu130", "0x020d"), ("2.13.0", "0x020d"), ("2.11.0", "0x020a"), ("2.10.1", "0x020a")],
)
def test_stable_abi_target_follows_the_torch_we_build_against(version, target):
    assert f"-DTORCH_TARGET_VERSION={target}" in SETUP["defines"](version)[0]


def test_cuda_op_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_CUDA_ARCHS", "none")
    assert SETUP["cuda_build_decision"]() == (False, "VLLM_MLA_CUDA_ARCHS=none")


def test_torch_without_the_stable_abi_is_refused():
    with pytest.raises(RuntimeError, match="predates"):
        SETUP["defines"]("2.9.1")


@needs_nvcc
def test_compiles_for_sm90(compiled):
    assert compiled.stat().st_size > 0


@needs_nvcc
def test_object_uses_only_the_stable_c_shim(compiled):
    undefined = subprocess.run(
        ["nm", "-uC", str(compiled)], capture_output=True, text=True, check=True
    ).stdout
    leaks = [line for line in undefined.splitlines() if re.search(r"\b(at|c10|torch)::", line)]
    assert not leaks, f"non-stable libtorch C++ symbols: {leaks}"
    # The registration really went through the stable C API.
    for symbol in ("torch_library_impl", "aoti_torch_library_def", STREAM_SYMBOL):
        assert symbol in undefined


@needs_nvcc
def test_cpp_registration_coexists_with_python_impls(compiled, tmp_path):
    """Loaded into this (CPU) torch, the library defines the op; Python adds fake + CPU impls."""
    lib_dir = tmp_path / "ext"
    lib_dir.mkdir()
    torch_lib = Path(torch.__file__).parent / "lib"
    cudart = cuda_home() / "lib64"
    link = ["g++", "-shared", "-o", str(lib_dir / "_C.abi3.so"), str(compiled)]
    link += [f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-L{cudart}", "-lcudart"]
    if not TARGET_2_13:  # the 2.10 target's stream shim lives in libtorch_cuda
        link += ["-ltorch_cuda"]
    link += [f"-Wl,-rpath,{cudart}"]
    linked = subprocess.run(link, capture_output=True, text=True, check=False)
    assert linked.returncode == 0, f"{' '.join(link)}\n{linked.stderr}"
    script = textwrap.dedent(
        f"""
        import torch, vllm_mla
        vllm_mla.__path__.append({str(lib_dir)!r})  # find_spec("vllm_mla._C") finds our build
        from vllm_mla.ops import query_bmm
        assert query_bmm.cuda_op_available(), query_bmm.cuda_op_error()
        op = torch.ops.vllm_mla.safe_mla_query_bmm
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), "CUDA")
        q = torch.randn(5, 4, 96).bfloat16()[..., :32].transpose(0, 1)
        w = torch.randn(4, 32, 40).bfloat16()
        out = torch.empty(4, 5, 40, dtype=torch.bfloat16)
        # opcheck's fake-tensor test runs the pystub check: the C++ set_python_module must
        # name the module that registers the fake impl.
        torch.library.opcheck(op, (q, w, out))
        query_bmm.safe_mla_query_bmm(q, w, out)
        assert torch.equal(out, torch.bmm(q, w))
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_python_schema_matches_cpp():
    defined = re.search(r'm\.def\("([^"]+)"\)', SOURCE.read_text()).group(1)
    assert defined == query_bmm.SCHEMA
    assert f'set_python_module("{query_bmm_op.__name__}")' in SOURCE.read_text()


# --- setup.py's decision logic ----------------------------------------------------------------


def test_no_extension_when_torch_has_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    build, why = SETUP["cuda_build_decision"]()
    assert not build
    assert "no CUDA" in why


def test_no_extension_when_torch_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    build, why = SETUP["cuda_build_decision"]()
    assert not build
    assert "torch is not importable" in why


def test_no_extension_without_nvcc(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    build, why = SETUP["cuda_build_decision"]()
    assert not build
    assert "nvcc not found" in why


def test_extension_with_cuda_torch_and_nvcc(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    build, why = SETUP["cuda_build_decision"]()
    assert build, why
    assert str(nvcc) in why


def test_cuda_archs(monkeypatch):
    monkeypatch.delenv("VLLM_MLA_CUDA_ARCHS", raising=False)
    assert SETUP["cuda_archs"]() == ["80", "86", "89", "90", "100", "120"]
    monkeypatch.setenv("VLLM_MLA_CUDA_ARCHS", "9.0; 12.0")
    assert SETUP["cuda_archs"]() == ["90", "120"]
    assert SETUP["gencode_flags"](["90", "120"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_120,code=sm_120",
        "-gencode=arch=compute_120,code=compute_120",
    ]
    monkeypatch.setenv("VLLM_MLA_CUDA_ARCHS", "75")
    with pytest.raises(SystemExit, match=r"compute capability >= 8\.0"):
        SETUP["cuda_archs"]()
