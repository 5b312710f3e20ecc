"""Reload soak, as its own process: one engine alternates two checkpoints N times.

Usage: python reload_soak_job.py MODEL_A MODEL_B OUT.json [CYCLES] [--fresh-b]. CYCLES
defaults to 50. ``--fresh-b``: load MODEL_B fresh, generate, stop (MODEL_B's reference);
the engine keeps MODEL_A's tokenizer, as a reload does (the tiny checkpoints' tokenizers
differ by seed), so both see the same prompt ids.
The engine loads MODEL_A, generates, then cycle i reloads MODEL_B (i even) or MODEL_A
(i odd) through ``collective_rpc("reload_weights", weights_path=...)``, which repoints
the model config at that folder and loads it in place. After every reload: greedy
tokens, the absorbed pair's addresses, the plugin's post-load count, and this process's
RSS (vLLM runs in this one process, no engine-core subprocess, so VmRSS covers it all).
"""

from __future__ import annotations

import json
import os
import sys
import time

from engine_job import MAX_TOKENS, PROMPTS, _pair_pointers, engine_kwargs


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, params, use_tqdm=False)]


def _cycle_state(model) -> dict:
    """Read inside the worker: pair addresses and the plugin's post-load record."""
    from vllm_mla.vllm import telemetry

    return {
        "pid": os.getpid(),
        "pointers": _pair_pointers(model),
        "post_load": telemetry.snapshot()["post_load"],
    }


def main(
    model_a: str, model_b: str, out_path: str, cycles: int = 50, fresh_b: bool = False
) -> None:
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(model_b if fresh_b else model_a), tokenizer=model_a)
    cycles = 0 if fresh_b else cycles
    report = {"pid": os.getpid(), "vllm_mla_env": os.environ.get("VLLM_MLA"), "cycles": []}
    report["first"] = _tokens(llm)
    (report["state_first"],) = llm.apply_model(_cycle_state)
    seen = len(report["state_first"]["post_load"])
    report["rss_first"] = _rss_bytes()
    report["load_s"] = time.perf_counter() - start
    soak_start = time.perf_counter()
    for i in range(cycles):
        loaded = "b" if i % 2 == 0 else "a"
        path = model_b if loaded == "b" else model_a
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        reload_s = time.perf_counter() - t
        tokens = _tokens(llm)
        (state,) = llm.apply_model(_cycle_state)
        rss = _rss_bytes()
        events = state.pop("post_load")
        report["cycles"].append(
            {
                "loaded": loaded,
                "tokens": tokens,
                "rss": rss,
                "reload_s": reload_s,
                "cycle_s": time.perf_counter() - t,
                "post_load_total": len(events),
                "post_load_new": events[seen:],  # this reload's post-loads
                **state,
            }
        )
        seen = len(events)
    report["soak_s"] = time.perf_counter() - soak_start
    report["total_s"] = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    args = [a for a in sys.argv[1:] if a != "--fresh-b"]
    main(*args[:3], *(int(a) for a in args[3:4]), fresh_b="--fresh-b" in sys.argv)
