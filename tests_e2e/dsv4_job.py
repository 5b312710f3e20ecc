"""One vLLM CPU engine serving a tiny DeepSeek-V4 through vLLM's own V4 path, as its own
process: the short prompt alone, then the long and the short prompt in one batch (then,
with ``--selecting``, the selecting prompt alone).

Usage: python dsv4_job.py MODEL OUT.json [--perturb SEED] [--tp N] [--reload MODEL2]
[--selecting] [--mtp N] [--chunked N].
bf16 (vLLM CPU's V4 path serves bf16 only), eager, the engine core in this process,
greedy with the top log-probabilities. The long prompt (``LONG`` tokens) has more 4:1
compressed entries than the checkpoint's ``index_topk`` of 512 (the only top-k vLLM
CPU's V4 indexer serves), so the indexer selects; the short one is under the window's
reach of a C128 entry or two.

``--selecting``: then the ``SELECTING``-token prompt alone (``selecting``): 1050
compressed entries of which the indexer keeps 512, so which it keeps decides the output
(of the long prompt's 525 it drops only 13: the comparison with transformers' DeepSeek-V4
needs this one to tell a wrong selection from noise). ``--reload MODEL2``: then
``reload_weights`` with MODEL2 and the batch again (``reloaded``). ``--tp N``: tensor
parallel over N worker processes (one core each, round robin). ``--perturb SEED``: every
sparse-attention output of vLLM's kernel moves by one bf16 step, up or down at random
(seeded): the noise floor an implementation that rounds its attention differently stays
within. ``--mtp N``: speculative decoding by the checkpoint's MTP layers, N tokens a step.
``--chunked N``: scheduled as vLLM CPU schedules V4 on an AMX host (chunked prefill and
prefix caching on; elsewhere it turns both off), at most N tokens a step: prompts run in
chunks, and the selecting prompt finds the long one's first blocks cached (both start
with the same tokens).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

LONG, SHORT = 2100, 150  # 525 and 37 compressed entries at 4:1; 16 and 1 at 128:1
SELECTING = 4200  # 1050 at 4:1: the indexer keeps about half, and which half decides
MAX_TOKENS = 8
TOP_LOGPROBS = 5
MAX_MODEL_LEN = SELECTING + 64


def prompt(length: int, stride: int, vocab: int) -> list[int]:
    """Deterministic token ids past the three special tokens."""
    return [3 + (stride * i) % (vocab - 3) for i in range(length)]


def prompts(vocab: int) -> tuple[list[int], list[int], list[int]]:
    """The long, the short and the selecting prompt."""
    return prompt(LONG, 7, vocab), prompt(SHORT, 11, vocab), prompt(SELECTING, 7, vocab)


def _generate(llm, batch: list[list[int]]) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS
    )
    out = []
    for request in llm.generate([{"prompt_token_ids": p} for p in batch], params):
        o = request.outputs[0]
        out.append(
            {
                "cached": request.num_cached_tokens or 0,  # prompt tokens found cached
                "token_ids": list(o.token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in s.items()} for s in o.logprobs],
            }
        )
    return out


def _telemetry(model) -> dict:
    from vllm_mla.vllm import telemetry

    return telemetry.snapshot()


def perturb_attention(seed: int) -> None:
    """vLLM's ``flash_mla_with_kvcache_cpu`` outputs times ``1 +- 2**-8``, then bf16."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    kernel = torch.ops._C.flash_mla_with_kvcache_cpu
    gen = torch.Generator().manual_seed(seed)

    def perturbed(out, *args):
        kernel(out, *args)
        sign = torch.randint(0, 2, out.shape, generator=gen).float() * 2 - 1
        out.copy_((out.float() * (1 + sign * 2.0**-8)).to(out.dtype))

    torch.ops._C.flash_mla_with_kvcache_cpu = perturbed


def schedule_as_on_amx() -> None:
    """vLLM CPU's config step sees AMX tiles, which is all that decides V4's chunked
    prefill and prefix caching there (the kernels are this host's: nothing else asks)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        real = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            original(cls, vllm_config)
        finally:
            torch.cpu._is_amx_tile_supported = real

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main(
    model: str,
    out_path: str,
    perturb_seed: int | None = None,
    tp: int = 1,
    reload: str | None = None,
    selecting: bool = False,
    mtp: int = 0,
    chunked: int = 0,
) -> None:
    from vllm import LLM

    if perturb_seed is not None:
        perturb_attention(perturb_seed)
    options = {}
    if tp > 1:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(cores[rank % len(cores)]) for rank in range(tp)
        )
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's function
        options = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    if mtp:
        options["speculative_config"] = {"method": "mtp", "num_speculative_tokens": mtp}
    if chunked:
        schedule_as_on_amx()
        options.update(
            enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=chunked
        )

    config = json.loads(Path(model, "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]  # V4.1 nests the text model
    long, short, selecting_prompt = prompts(vocab)
    start = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        seed=0,
        **options,
    )
    config = llm.llm_engine.vllm_config
    report = {
        "load_s": time.perf_counter() - start,
        "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "prefix_caching": config.cache_config.enable_prefix_caching,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    t = time.perf_counter()
    report["alone"] = _generate(llm, [short])
    report["batched"] = _generate(llm, [long, short])
    if selecting:
        report["selecting"] = _generate(llm, [selecting_prompt])
    report["generate_s"] = time.perf_counter() - t
    if reload is not None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": reload})
        report["reloaded"] = _generate(llm, [long, short])
    report["telemetry"] = llm.apply_model(_telemetry)[0]
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    seed = int(args[args.index("--perturb") + 1]) if "--perturb" in args else None
    tp = int(args[args.index("--tp") + 1]) if "--tp" in args else 1
    reload = args[args.index("--reload") + 1] if "--reload" in args else None
    mtp = int(args[args.index("--mtp") + 1]) if "--mtp" in args else 0
    chunked = int(args[args.index("--chunked") + 1]) if "--chunked" in args else 0
    main(args[0], args[1], seed, tp, reload, "--selecting" in args, mtp, chunked)
