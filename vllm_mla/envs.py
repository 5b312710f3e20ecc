"""Every environment variable vllm-mla reads, in one place, typed.

``VLLM_MLA`` (bool, default on): ``0`` makes the vLLM plugin apply nothing.

``VLLM_MLA_FEATURES`` (comma list, default every known feature):
the plugin features to apply; known: ``lifecycle`` (lean absorbed weights in MLA post-load),
``query`` (the safe BMM in MLA's V up-projection where the GPU or backend needs it) and
``sparse`` (registers the B12X_MLA_SPARSE attention backend, makes fp8 KV caches resolve
to fp8_ds_mla for it and keeps an explicit bfloat16 cache) and ``sparse-cpu`` (on a CPU
platform only: lets DSA models select B12X_MLA_SPARSE, 64-row KV pages, and the CPU
lightning indexer in ``vllm_mla.ops.sparse_indexer``) and ``sparse-indexer`` (on CUDA:
the portable Triton DSA indexer where ``VLLM_MLA_INDEXER`` picks it), ``wake-check``
(catches MLA weights discarded by sleep level 2 and not reloaded, see
``VLLM_MLA_WAKE_CHECK``) and ``cpu-mxfp8`` (on a CPU
platform only: vLLM's emulation MXFP8 linear kernel registered for CPU, so MXFP8
checkpoints load).

``VLLM_MLA_SAFE_BMM`` (``auto`` | ``always`` | ``never``, default ``auto``): whether every
bmm on MLA's absorbed weights (W_UK_T in the query absorption, W_UV in the V
up-projection, on every forward path) runs through the safe BMM: ``auto`` on SM120/121
or when the backend's capability asks, ``always`` on any device (e.g. a GPU with the
same cuBLAS over-read that is not gated yet), ``never`` leaves upstream's bmm everywhere.

``VLLM_MLA_ABSORBED`` (``bf16`` | ``direct`` | ``auto``, default ``auto``): what the absorbed
weights are. ``bf16``: the lean BF16 pair. ``direct``: MXFP8 views of kv_b_proj's pack,
no pair (an MXFP8 kv_b_proj is required; start-up fails naming the reason otherwise).
``auto``: ``direct`` only where the backend declares it at least as fast, else ``bf16``.

``VLLM_MLA_INDEXER`` (``auto`` | ``ours`` | ``vllm``, default ``auto``): the DSA lightning
indexer on CUDA. ``auto``: ours (Triton, SM80+) where vLLM's cannot run (no DeepGEMM, or
an SM12x GPU), vLLM's elsewhere; ``ours`` / ``vllm`` force one (vLLM's fails at start-up
without DeepGEMM).

``VLLM_MLA_WAKE_CHECK`` (``raise`` | ``warn`` | ``off``, default ``raise``): what the
first step after a level-2 wake-up does when an MLA layer's weights no longer match
their fingerprint from the last (re)load (``vllm_mla.vllm.wake_check``).

``VLLM_MLA_SPARSE_CUSTOM`` (bool, default off): register vLLM's shared ``CUSTOM``
attention-backend slot to B12X_MLA_SPARSE at plugin load (otherwise the slot is claimed
only when a config selects the backend by name).

``VLLM_MLA_CPU_ISA`` (``native`` | ``avx512_bf16`` | ``avx512`` | ``avx2``, default
``native``): a test-harness switch that hides x86 CPU features from torch, oneDNN and vLLM
CPU, so one host runs what a host with fewer features runs (``vllm_mla.cpu_isa``; the test
environments apply it at interpreter start-up).

``TRITON_INTERPRET`` (bool, default off): Triton's own switch to run kernels in its
CPU interpreter; it also lets the fused query projection take CPU tensors (tests).

Build time only, read by setup.py (which cannot import the package):
``VLLM_MLA_CUDA_ARCHS`` (e.g. ``"90;120"``, default sm_80/86/89/90/100/120): the GPU
architectures the CUDA op is compiled for; ``none`` skips the CUDA op.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


FEATURES = (
    "lifecycle",
    "query",
    "sparse",
    "sparse-cpu",
    "sparse-indexer",
    "cpu-mxfp8",
    "wake-check",
)


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


SAFE_BMM_MODES = ("auto", "always", "never")


def safe_bmm_mode() -> str:
    """``VLLM_MLA_SAFE_BMM``; any other value is a ValueError naming the variable."""
    mode = os.environ.get("VLLM_MLA_SAFE_BMM", "auto").strip().lower() or "auto"
    if mode not in SAFE_BMM_MODES:
        raise ValueError(f"VLLM_MLA_SAFE_BMM must be one of {SAFE_BMM_MODES}, got {mode!r}")
    return mode


ABSORBED_MODES = ("bf16", "direct", "auto")


def absorbed_mode() -> str:
    """``VLLM_MLA_ABSORBED``; any other value is a ValueError naming the variable."""
    mode = os.environ.get("VLLM_MLA_ABSORBED", "auto").strip().lower() or "auto"
    if mode not in ABSORBED_MODES:
        raise ValueError(f"VLLM_MLA_ABSORBED must be one of {ABSORBED_MODES}, got {mode!r}")
    return mode


INDEXER_CHOICES = ("auto", "ours", "vllm")


def indexer_choice() -> str:
    """``VLLM_MLA_INDEXER``; any other value is a ValueError naming the variable."""
    choice = os.environ.get("VLLM_MLA_INDEXER", "auto").strip().lower() or "auto"
    if choice not in INDEXER_CHOICES:
        raise ValueError(f"VLLM_MLA_INDEXER must be one of {INDEXER_CHOICES}, got {choice!r}")
    return choice


WAKE_CHECK_MODES = ("raise", "warn", "off")


def wake_check_mode() -> str:
    """``VLLM_MLA_WAKE_CHECK``; any other value is a ValueError naming the variable."""
    mode = os.environ.get("VLLM_MLA_WAKE_CHECK", "raise").strip().lower() or "raise"
    if mode not in WAKE_CHECK_MODES:
        raise ValueError(f"VLLM_MLA_WAKE_CHECK must be one of {WAKE_CHECK_MODES}, got {mode!r}")
    return mode


CPU_ISA_LEVELS = ("native", "avx512_bf16", "avx512", "avx2")


def cpu_isa() -> str:
    """``VLLM_MLA_CPU_ISA``, lower-cased; validated by ``vllm_mla.cpu_isa.apply``."""
    return os.environ.get("VLLM_MLA_CPU_ISA", "native").strip().lower() or "native"


def triton_interpret() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return _flag("TRITON_INTERPRET")
