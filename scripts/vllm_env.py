"""Install a released vLLM into a virtual environment, the package index's gaps handled here.

    python scripts/vllm_env.py install VENV VERSION [PACKAGE ...]
        VENV gets vLLM VERSION and its requirements (PACKAGEs too, e.g. pytest);
        made if missing
    python scripts/vllm_env.py newest
        the newest vLLM release the package index serves

vLLM pins some dependencies to exact versions, and the index reachable here does not serve
every pinned version: vLLM 0.34.0 pins flashinfer-python 0.7.3, and only 0.7.4 is served,
so ``pip install vllm==0.34.0`` fails to resolve. So vLLM is installed without its
dependencies, then its own requirement list (its ``Requires-Dist``, markers evaluated for
the environment's interpreter) is installed with the pins in ``OVERRIDES`` replaced. An
override names the exact pin it replaces, so a later vLLM with another pin gets its own
pin (and fails loudly if the index lacks that one too). pip then reports the moved pin as a
dependency conflict ("vllm 0.34.0 requires flashinfer-python==0.7.3, but you have ...");
that line is expected and the install succeeds. Used by ``scripts/setup.sh`` and
``scripts/check_newest_vllm.sh``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

# (package, version vLLM pins) -> (version installed instead, why)
OVERRIDES: dict[tuple[str, str], tuple[str, str]] = {
    ("flashinfer-python", "0.7.3"): (
        "0.7.4",
        "vLLM 0.34.0 pins 0.7.3, which the package index does not serve; 0.7.4 is the next "
        "patch release. Only vLLM's CUDA attention kernels use it; no CPU test runs them.",
    ),
}

# Run by the environment's own interpreter: its vLLM's requirement list, markers evaluated
# there, one JSON list of [name, specifier] pairs. pip's vendored packaging needs no install.
_READ_REQUIREMENTS = """
import json
from importlib.metadata import distribution
from pip._vendor.packaging.requirements import Requirement
out = []
for line in distribution("vllm").requires or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        out.append([req.name, str(req.specifier), str(req).split(";")[0].strip()])
print(json.dumps(out))
"""


def overridden(name: str, specifier: str) -> str | None:
    """The requirement installed instead of ``name specifier`` (None: vLLM's own)."""
    if not specifier.startswith("=="):
        return None
    replacement = OVERRIDES.get((name.lower(), specifier[2:]))
    return None if replacement is None else f"{name}=={replacement[0]}"


def requirements(python: Path) -> list[str]:
    """The installed vLLM's requirements, in ``python``'s environment, overrides applied."""
    found = subprocess.run(
        [str(python), "-c", _READ_REQUIREMENTS], check=True, capture_output=True, text=True
    )
    listed = []
    for name, specifier, line in json.loads(found.stdout):
        replacement = overridden(name, specifier)
        if replacement is not None:
            print(
                f"vllm_env: {line} -> {replacement} ({OVERRIDES[(name.lower(), specifier[2:])][1]})"
            )
        listed.append(replacement or line)
    return listed


def install(venv: Path, version: str, extra: list[str]) -> None:
    """vLLM ``version`` and its requirements (overrides applied) into ``venv``."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    subprocess.run([*pip, "--no-deps", f"vllm=={version}"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
        listing.write("\n".join(requirements(python) + extra) + "\n")
    subprocess.run([*pip, "-r", listing.name], check=True)
    Path(listing.name).unlink()


def newest() -> str:
    """The newest vLLM release on the package index (``pip index versions``)."""
    found = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"],
        check=True,
        capture_output=True,
        text=True,
    )
    first = found.stdout.strip().splitlines()[0]  # "vllm (0.34.0)"
    return first.split("(", 1)[1].rstrip(")")


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"] and len(argv) >= 3:
        install(Path(argv[1]), argv[2], argv[3:])
        return 0
    if argv == ["newest"]:
        print(newest())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
