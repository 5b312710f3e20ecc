"""Rules the whole tree keeps: format constants defined once (``vllm_mla.formats``), and
no text pointing at a file outside the repository."""

from __future__ import annotations

import io
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ROOT / "vllm_mla" / "formats.py"
# values whose meaning is a format constant wherever they appear in code: e4m3's maximum,
# the fp8_ds_mla record, the latent query / KV row; and the sparse backend's name
LITERAL_NUMBERS = {"448", "448.0", "656", "576"}
LITERAL_STRINGS = {'"B12X_MLA_SPARSE"', "'B12X_MLA_SPARSE'"}
OUTSIDE = ("REFERENCE.md", "DESIGN.md", "STYLE.md", "../shared")


def tracked(*suffixes: str) -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.splitlines() if p.endswith(suffixes) and (ROOT / p).is_file()]


def literals(path: Path) -> list[str]:
    """``file:line: code`` for every format literal among ``path``'s code tokens (not its
    comments or docstrings' prose: those name the value for the reader)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        number = tok.type == tokenize.NUMBER and tok.string in LITERAL_NUMBERS
        string = tok.type == tokenize.STRING and tok.string in LITERAL_STRINGS
        if number or string:
            found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.line.strip()}")
    return found


def test_format_constants_are_defined_once():
    code = [p for p in tracked(".py") if p.parts[len(ROOT.parts)] in ("vllm_mla", "benchmarks")]
    assert FORMATS in code
    found = [hit for p in code if p != FORMATS for hit in literals(p)]
    assert not found, "use vllm_mla.formats:\n" + "\n".join(found)


def test_the_literal_scan_sees_a_literal(tmp_path):
    """The scan above can fail: a literal in code is found, the same value in prose not."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""clamp to 448"""\nX = 448.0  # 448\nNAME = "B12X_MLA_SPARSE"\n')
    real_root = globals()["ROOT"]
    try:
        globals()["ROOT"] = tmp_path
        assert [hit.split(":")[1] for hit in literals(probe)] == ["2", "3"]
    finally:
        globals()["ROOT"] = real_root


def test_nothing_points_outside_the_repository():
    texts = tracked(".py", ".md", ".sh", ".toml", ".cu", ".h", ".cfg", ".txt", ".yml", ".yaml")
    this = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in texts
        if p.resolve() != this
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if any(name in line for name in OUTSIDE)
    ]
    assert not hits, "\n".join(hits)


def test_the_readme_shows_every_environment_variable():
    from vllm_mla import envs

    readme = (ROOT / "README.md").read_text()
    begin = readme.index("<!-- envs table: begin")
    shown = readme[readme.index("\n", begin) + 1 : readme.index("<!-- envs table: end")]
    assert shown.strip() == envs.markdown_table()


def test_every_variable_the_package_reads_is_in_the_table():
    """``os.environ`` is read in ``envs.py`` only (``cpu_isa`` writes the variables torch
    and oneDNN read; ``registration`` exports its claim), and each name is in the table."""
    import re

    from vllm_mla import envs

    package = [p for p in tracked(".py") if p.parts[len(ROOT.parts)] == "vllm_mla"]
    names = {v.name for v in envs.VARIABLES}
    read = re.compile(r"os\.environ\.get\(\s*([\"'A-Z_]+)|os\.getenv\(")
    for path in package:
        text = path.read_text()
        for match in read.finditer(text):
            assert path.name in ("envs.py", "cpu_isa.py"), f"{path}: {match.group(0)}"
    for name in re.findall(
        r'"((?:VLLM_MLA|TRITON)_?[A-Z_]*)"', (ROOT / "vllm_mla/envs.py").read_text()
    ):
        assert name in names, name
