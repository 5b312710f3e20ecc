"""Every environment variable vllm-mla reads, in one place, typed: ``VARIABLES`` (name,
default, values, what it does; the README's table is ``markdown_table()``, a test keeps
them equal) and one reader per variable. A value outside a variable's choices is a
ValueError naming the variable.

The features of ``VLLM_MLA_FEATURES``: ``lifecycle`` (lean absorbed weights in MLA
post-load, in-place reload), ``lifecycle-cpu`` (CPU platform only: a reload prepacks vLLM
CPU's MoE experts), ``query`` (the safe BMM in MLA's V up-projection where the GPU or
backend needs it, and the fused query projection on the decode path), ``sparse`` (registers
the B12X_MLA_SPARSE attention backend, makes fp8 KV caches resolve to fp8_ds_mla for it and
keeps an explicit bfloat16 cache, lets an MTP draft inherit it), ``sparse-cpu`` (CPU
platform only: DSA models may select B12X_MLA_SPARSE, 64-row KV pages, the portable
lightning indexer and torch stand-ins for vLLM's Triton-only metadata kernels),
``sparse-indexer`` (CUDA: the portable Triton DSA indexer where ``VLLM_MLA_INDEXER`` picks
it), ``dsv4-gpu`` (CUDA: DeepSeek-V4 on a GPU its attention backends declare they cannot run
on is refused at start-up, named), ``cpu-mxfp8`` (CPU platform only: vLLM's emulation MXFP8
linear kernel registered for CPU, so MXFP8 checkpoints load) and ``wake-check`` (catches MLA
weights discarded by sleep level 2 and not reloaded), ``tp-pad`` (applied only with
``VLLM_MLA_TP_PAD=1``: head-padded tensor parallelism, ``vllm_mla.tp_pad``).

Build time only, read by setup.py (which cannot import the package): ``VLLM_MLA_CUDA_ARCHS``
(listed in ``VARIABLES`` too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TRUE = ("1", "true", "yes", "on")
FEATURES = (
    "lifecycle",
    "lifecycle-cpu",
    "query",
    "sparse",
    "sparse-cpu",
    "sparse-indexer",
    "dsv4-gpu",
    "cpu-mxfp8",
    "wake-check",
    "tp-pad",
)
SAFE_BMM_MODES = ("auto", "always", "never")
ABSORBED_MODES = ("bf16", "direct", "auto")
QUERY_MODES = ("auto", "fused", "staged")
INDEXER_CHOICES = ("auto", "ours", "vllm")
WAKE_CHECK_MODES = ("raise", "warn", "off")
CPU_ISA_LEVELS = ("native", "avx512_bf16", "avx512", "avx2", "amx")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its default, its values (a tuple of choices, or a word
    for free-form ones) and what it does."""

    name: str
    default: str
    values: tuple[str, ...] | str
    what: str


VARIABLES: tuple[Variable, ...] = (
    Variable("VLLM_MLA", "1", "bool", "`0` makes the vLLM plugin apply nothing"),
    Variable(
        "VLLM_MLA_FEATURES",
        "every feature",
        "comma list of " + ", ".join(FEATURES),
        "the plugin features to apply (module docstring of `vllm_mla.envs`)",
    ),
    Variable(
        "VLLM_MLA_ABSORBED",
        "auto",
        ABSORBED_MODES,
        "the absorbed weights: the lean BF16 pair, or MXFP8 views of kv_b_proj's pack "
        "(`direct`, no pair); `auto`: direct only where the backend declares it faster",
    ),
    Variable(
        "VLLM_MLA_SAFE_BMM",
        "auto",
        SAFE_BMM_MODES,
        "every bmm on the absorbed weights through the bounds-safe BMM: `auto` on SM120/121 "
        "or where the backend asks, `always` anywhere, `never` leaves upstream's",
    ),
    Variable(
        "VLLM_MLA_QUERY",
        "auto",
        QUERY_MODES,
        "the decode query: `fused` = one `mla_query_projection` where vLLM runs bmm + "
        "concat (+ quant); `auto`: fused where the Triton kernel serves the layer (CUDA); "
        "`staged`: vLLM's own",
    ),
    Variable(
        "VLLM_MLA_INDEXER",
        "auto",
        INDEXER_CHOICES,
        "the DSA indexer on CUDA: `auto` = ours (Triton, SM80+) where vLLM's cannot run "
        "(no DeepGEMM, SM12x), else vLLM's",
    ),
    Variable(
        "VLLM_MLA_WAKE_CHECK",
        "raise",
        WAKE_CHECK_MODES,
        "what the first step after a level-2 wake-up does when an MLA layer's weights no "
        "longer match their fingerprint",
    ),
    Variable(
        "VLLM_MLA_TP_PAD",
        "0",
        "bool",
        "`1`: a TP size that does not divide the heads (or MLP widths, vocabulary) pads them "
        "with inert zero heads and rows (64 heads at TP 6: 66, 11 per rank); DeepSeek-V2/V3, "
        "V3.2 and GLM-5 checkpoints; off: vLLM refuses such a TP size",
    ),
    Variable(
        "VLLM_MLA_SPARSE_CUSTOM",
        "0",
        "bool",
        "register vLLM's shared `CUSTOM` backend slot to B12X_MLA_SPARSE at plugin load",
    ),
    Variable(
        "VLLM_MLA_CPU_ISA",
        "native",
        CPU_ISA_LEVELS,
        "test harness: hide x86 features from torch, oneDNN and vLLM CPU, so this host "
        "runs what a host with fewer features runs; amx claims AMX tiles for vLLM's "
        "decisions (CUDA wheel in CPU platform mode only)",
    ),
    Variable(
        "TRITON_INTERPRET",
        "0",
        "bool",
        "Triton's own switch: kernels in its CPU interpreter (the tests' kernel runs)",
    ),
    Variable(
        "VLLM_LOGGING_LEVEL",
        "INFO",
        "vLLM's levels",
        "vLLM's own log level, followed by vllm-mla's logger; `DEBUG` adds one start-up "
        "line per feature",
    ),
    Variable(
        "VLLM_MLA_CUDA_ARCHS",
        "80;86;89;90;100;120",
        "`;` list, or `none`",
        "build time (setup.py): the architectures the CUDA op is compiled for",
    ),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def markdown_table() -> str:
    """``VARIABLES`` as the README's markdown table."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    for v in VARIABLES:
        values = (
            " \\| ".join(f"`{c}`" for c in v.values) if isinstance(v.values, tuple) else v.values
        )
        rows.append(f"| `{v.name}` | `{v.default}` | {values} | {v.what} |")
    return "\n".join(rows)


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip().lower() or _BY_NAME[name].default


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def _choice(name: str) -> str:
    """The variable's value among its choices; a ValueError naming it otherwise."""
    value, choices = _raw(name), _BY_NAME[name].values
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def plugin_enabled() -> bool:
    """False when ``VLLM_MLA`` is set to 0/false/no/off."""
    return os.environ.get("VLLM_MLA", "1").strip().lower() not in ("0", "false", "no", "off")


def plugin_features() -> tuple[frozenset[str], tuple[str, ...]]:
    """(features asked for by ``VLLM_MLA_FEATURES``, unknown names in it)."""
    raw = os.environ.get("VLLM_MLA_FEATURES")
    if raw is None:
        return frozenset(FEATURES), ()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return frozenset(n for n in names if n in FEATURES), tuple(
        n for n in names if n not in FEATURES
    )


def tp_pad() -> bool:
    """``VLLM_MLA_TP_PAD``: the ``tp-pad`` feature applies only when it is on."""
    return _flag("VLLM_MLA_TP_PAD")


def safe_bmm_mode() -> str:
    """``VLLM_MLA_SAFE_BMM``."""
    return _choice("VLLM_MLA_SAFE_BMM")


def absorbed_mode() -> str:
    """``VLLM_MLA_ABSORBED``."""
    return _choice("VLLM_MLA_ABSORBED")


def query_mode() -> str:
    """``VLLM_MLA_QUERY``."""
    return _choice("VLLM_MLA_QUERY")


def indexer_choice() -> str:
    """``VLLM_MLA_INDEXER``."""
    return _choice("VLLM_MLA_INDEXER")


def wake_check_mode() -> str:
    """``VLLM_MLA_WAKE_CHECK``."""
    return _choice("VLLM_MLA_WAKE_CHECK")


def sparse_custom() -> bool:
    """``VLLM_MLA_SPARSE_CUSTOM`` (set by the user, or by the plugin in the process that
    spawned this one)."""
    return _flag("VLLM_MLA_SPARSE_CUSTOM")


def cpu_isa() -> str:
    """``VLLM_MLA_CPU_ISA``, lower-cased; validated by ``vllm_mla.cpu_isa.apply``."""
    return _raw("VLLM_MLA_CPU_ISA")


def logging_level() -> str:
    """``VLLM_LOGGING_LEVEL`` upper-cased (vLLM's variable; INFO by default)."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper() or "INFO"


def triton_interpret() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return _flag("TRITON_INTERPRET")
