"""GLM-5.3-Flash's KDA layers on CPU: the four stand-ins (``cpu_glm5next_kda_*``) against
transformers' own KDA, their dispatch, and what they refuse.

transformers' ``chunk_kimi_delta_attention`` is an independent implementation (chunked,
``[K, V]`` state, gate given as a log-decay): it and ours are fp32 and differ by summation
order, about 64 * 2**-24 relative per 64-token chunk; 2e-5 absolute on O(1) values.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_mla.ops.kda import KDAError
from vllm_mla.vllm import patches

H, D, T = 2, 128, 70  # two chunks of 64 in transformers' implementation
LOWER = -5.0
TOL = 2e-5  # fp32 reassociation (module docstring)
KDA = "vllm.models.glm5next.common.kda"


def _patched(name: str):
    patch = next(p for p in patches.PATCHES if p.name == name)
    original = getattr(importlib.import_module(KDA), patch.qualname)
    if getattr(original, patches.MARK, None):  # the plugin applied it in this process
        original = original.__wrapped__
    return patch.build(original)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(*shape, generator=gen)
        for name, shape in {
            "q": (1, T, H, D),
            "k": (1, T, H, D),
            "v": (1, T, H, D),
            "raw_g": (1, T, H, D),
            "beta": (1, T, H),
            "A_log": (1, 1, H, 1),
            "g_bias": (H * D,),
        }.items()
    }


def test_prefill_matches_transformers_kimi_delta_attention():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    x = _inputs()
    beta = x["beta"].sigmoid()
    initial = torch.randn(1, H, D, D) * 0.1  # vLLM's [H, V, K]
    chunk = _patched("cpu_glm5next_kda_chunk")
    out, final = chunk(
        x["q"],
        x["k"],
        x["v"],
        x["raw_g"],
        beta,
        x["A_log"],
        x["g_bias"],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor([0, T]),
        safe_gate=True,
        lower_bound=LOWER,
    )
    # transformers' forget gate: lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    g = LOWER * torch.sigmoid(x["A_log"].exp() * (x["raw_g"] + x["g_bias"].view(1, 1, H, D)))
    want, want_state = hf.chunk_kimi_delta_attention(
        x["q"],
        x["k"],
        x["v"],
        g=g,
        beta=beta,
        initial_state=initial.transpose(-1, -2),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    torch.testing.assert_close(final, want_state.transpose(-1, -2), atol=TOL, rtol=0)


def test_decode_matches_transformers_recurrent_kimi_delta_attention_in_the_cache():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    x = {n: t[:, :1] if t.ndim == 4 and n != "A_log" else t for n, t in _inputs(1).items()}
    x["beta"] = x["beta"][:, :1]
    cache = torch.randn(3, H, D, D) * 0.1
    start = cache[2].clone()
    recurrent = _patched("cpu_glm5next_kda_recurrent")
    out, state = recurrent(
        x["q"],
        x["k"],
        x["v"],
        x["raw_g"],
        beta=x["beta"],
        initial_state=cache,
        cu_seqlens=torch.tensor([0, 1]),
        ssm_state_indices=torch.tensor([2]),
        sigmoid_beta=True,
        a_log=x["A_log"],
        g_bias=x["g_bias"],
        compute_gate=True,
        lower_bound=LOWER,
    )
    g = LOWER * torch.sigmoid(x["A_log"].exp() * (x["raw_g"] + x["g_bias"].view(1, 1, H, D)))
    want, want_state = hf.recurrent_kimi_delta_attention(
        x["q"],
        x["k"],
        x["v"],
        g=g,
        beta=x["beta"].sigmoid(),
        initial_state=start[None].transpose(-1, -2),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert state is cache  # in place, as the kernel's inplace_final_state
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    torch.testing.assert_close(cache[2], want_state[0].transpose(-1, -2), atol=TOL, rtol=0)


def test_tensors_off_the_cpu_go_to_vllms_kernels():
    seen = []
    patch = next(p for p in patches.PATCHES if p.name == "cpu_glm5next_kda_gather")
    gather = patch.build(lambda *args: seen.append(args) or "vllm")
    meta = torch.empty(4, 2, device="meta")
    index = torch.zeros(1, dtype=torch.int32, device="meta")
    assert gather(meta, index, index.bool()) == "vllm" and len(seen) == 1


def test_settings_the_reference_does_not_serve_are_refused_by_name():
    x = _inputs()
    chunk = _patched("cpu_glm5next_kda_chunk")
    with pytest.raises(KDAError, match="safe_gate=False"):
        chunk(
            x["q"],
            x["k"],
            x["v"],
            x["raw_g"],
            x["beta"],
            x["A_log"],
            x["g_bias"],
            use_qk_l2norm_in_kernel=True,
            safe_gate=False,
        )
    recurrent = _patched("cpu_glm5next_kda_recurrent")
    with pytest.raises(KDAError, match="inplace_final_state=False"):
        recurrent(x["q"], x["k"], x["v"], x["raw_g"], x["beta"], inplace_final_state=False)


def test_scatter_keeps_the_warmup_registration_the_layer_calls():
    scatter = _patched("cpu_glm5next_kda_scatter")
    original = scatter.__wrapped__
    assert scatter.register_warmup == original.register_warmup
