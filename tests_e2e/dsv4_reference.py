"""The fp32 reference for the DeepSeek-V4 end-to-end runs: transformers' own
``DeepseekV4ForCausalLM`` (its weights, projections, compressors' windows, mHC, routers and
experts), made to compute what vLLM CPU computes where the two legitimately differ.

transformers and vLLM CPU already agree on the layout: interleaved (GPT-J) RoPE on the last
64 channels (transformers' ``apply_rotary_pos_emb`` / vLLM's ``build_deepseek_v4_rope``
with ``is_neox_style=False``), ``rope_theta`` on window-only layers and
``compress_rope_theta`` on compressed ones (this checkpoint: no YaRN), each entry turned at
its window's first position, RMSNorm before RoPE, the window of ``sliding_window`` tokens,
the causal rule for compressed entries (``(pos + 1) // ratio`` of them) and the sink. What
differs, each switchable (``Emulation``) to measure what it is worth:

- ``kv_record``: vLLM CPU's cache is ``fp8_ds_mla`` always (``DeepseekV4CPUAttention.
  _fused_qnorm_rope_kv_insert``, ``vllm/models/deepseek_v4/cpu/cpu_sparse.py``), and its
  attention (``forward_mqa`` -> ``flash_mla_with_kvcache_cpu``) reads even the current
  token's latent back from it: the roped latent passes through the 584-byte record
  (bf16, then e4m3 per 64 NoPE values under a power-of-two scale, bf16 RoPE part;
  ``vllm_mla.ops.dsv4.record``, writer ``"cpu"``). transformers attends to the fp32 latent.
- ``compressed_record``: the compressors' entries are stored the same way
  (``compress_norm_rope_store_cpu``, ``vllm_mla.ops.dsv4.compressor.store_entries``);
  transformers concatenates the fp32 entries.
- ``indexer`` ``"vllm"``: vLLM's lightning indexer scores e4m3 queries (RoPE in fp32, one
  power-of-two scale per token and head, amax floored, folded into the head weights:
  ``fused_indexer_q_rope_quant_cpu``, ``vllm_mla.ops.dsv4.indexer``) against e4m3 keys
  (the bf16-rounded entry, one power-of-two scale per row: ``compress_norm_rope_store_
  indexer_cpu``, ``compressor.index_key_bytes``), ``k_scale * sum_h w * relu(q . k)``, top
  512 with ties toward the lower entry (``fp8_paged_mqa_logits_cpu`` /
  ``topk_transform_512_cpu``; ``vllm_mla.ops.sparse_indexer.reference``, the V3.2 oracle).
  transformers (``DeepseekV4IndexerScorer``) scores fp32 queries and keys. ``"fp32"``:
  transformers' scoring; ``"negated"``: vLLM's scores negated (the 512 worst entries
  selected: the fault control and the "selection reversed" probe).
- ``bf16``: vLLM CPU serves V4 in bf16 only; the reference rounds to bf16 where the engine
  stores bf16: every GEMM output (``nn.Linear`` here; the router logits stay fp32, vLLM's
  ``GateLinear(out_dtype=float32)``), the norms' outputs (``attn_norm`` / ``ffn_norm`` /
  ``q_norm`` / ``kv_norm``), the query after its norm and RoPE (``fused_qnorm_rope``'s
  bf16 output), the attention output and its inverse RoPE (``_o_proj``'s ``.to(bf16)``),
  the mHC streams and block inputs (``mhc_pre_torch`` / ``mhc_post_torch``,
  ``vllm/model_executor/kernels/mhc/torch.py``), the experts' GEMMs and activations, the MoE
  output, ``hc_head``, the final norm and the logits. The compressors run in fp32 on the
  bf16 projections (vLLM's fp32 state cache, ``save_partial_states_cpu``), as here.
- ``sink`` False: the sink dropped (fault control). ``noise`` (a seed): the latent before
  its record and each attention output multiplied by ``1 + 2**-8 * N(0, 1)``: what the
  bf16 engine's own roundings differ by (the error model's floor).

transformers' experts clamp at ``swiglu_limit`` and vLLM's bf16 routed experts do not
(``docs/deepseek-v4.md``); the tiny checkpoint's limit (1000) never engages, so neither
does that difference. Each call is a whole-prefix forward without a cache (transformers'
stateless compressor path: windows from position 0, the first C4 window's previous half
empty, as vLLM's state slots before the sequence are).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from dsa_reference import replaced

from vllm_mla.ops.dsv4 import compressor as v4_compressor
from vllm_mla.ops.dsv4 import indexer as v4_indexer
from vllm_mla.ops.dsv4 import record
from vllm_mla.ops.sparse_indexer import reference as index_reference

_MODEL_ROPE: list = [None]  # the model's rotary embedding while emulating (attention's)
BF16_NOISE = 2.0**-8  # bf16's unit roundoff: the relative size of the engine's noise
INDEXERS = ("vllm", "fp32", "negated")


@dataclasses.dataclass(frozen=True)
class Emulation:
    """What the reference emulates (the module docstring); the defaults: all of it."""

    kv_record: bool = True
    compressed_record: bool = True
    indexer: str = "vllm"
    bf16: bool = True
    sink: bool = True
    noise: int | None = None

    def __post_init__(self) -> None:
        if self.indexer not in INDEXERS:
            raise ValueError(f"indexer must be one of {INDEXERS}, got {self.indexer!r}")


TRANSFORMERS = Emulation(
    kv_record=False, compressed_record=False, indexer="fp32", bf16=False
)  # transformers' own arithmetic, through the same code


def through_record(rows: torch.Tensor) -> torch.Tensor:
    """``[..., 512]`` rows as vLLM CPU's ``fp8_ds_mla`` record gives them back."""
    flat = rows.reshape(-1, rows.shape[-1])
    return record.dequantize(*record.quantize(flat, writer="cpu")).view(rows.shape)


class _Run:
    """One forward's emulation state: the switches and the noise generator."""

    def __init__(self, how: Emulation) -> None:
        self.how = how
        self.gen = None if how.noise is None else torch.Generator().manual_seed(how.noise)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float() if self.how.bf16 else x

    def noisy(self, x: torch.Tensor) -> torch.Tensor:
        if self.gen is None:
            return x
        return x * (1 + BF16_NOISE * torch.randn(x.shape, generator=self.gen))


def _rope(module, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False):
    """transformers' interleaved RoPE on ``x`` ``[B, S, ..., D]`` at ``positions`` ``[B, S]``
    with ``module``'s table (its ``rope_layer_type`` of its ``rotary_emb``, the model's for
    an attention block; ``inverse``: turned back)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    rotary = getattr(module, "rotary_emb", None) or _MODEL_ROPE[0]
    cos, sin = rotary(x, position_ids=positions, layer_type=module.rope_layer_type)
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(2)
    out = m.apply_rotary_pos_emb(x.float(), cos, -sin if inverse else sin, unsqueeze_dim=2)
    return out.squeeze(2) if squeeze else out


def _window_entries(module, hidden: torch.Tensor, overlap: bool) -> torch.Tensor:
    """A compressor's (or the indexer's) fp32 entries before their norm: per complete window
    of ``ratio`` tokens a softmax over tokens (per channel) of gate + position bias weighting
    the projected values; with ``overlap`` (C4) over the previous window's first halves and
    this window's second halves (transformers' stateless path, vLLM's ``compress``)."""
    ratio, dim = module.compress_rate, module.head_dim
    kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)  # bf16 GEMMs (hooked)
    batch, usable = kv.shape[0], (kv.shape[1] // ratio) * ratio
    windows = usable // ratio
    kv = kv[:, :usable].float().view(batch, windows, ratio, -1)
    gate = gate[:, :usable].float().view(batch, windows, ratio, -1) + module.position_bias.float()
    if overlap:
        prev_kv = torch.zeros(batch, windows, ratio, dim)
        prev_gate = torch.full((batch, windows, ratio, dim), float("-inf"))
        prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :dim], gate[:, :-1, :, :dim]
        kv = torch.cat([prev_kv, kv[..., dim:]], dim=2)
        gate = torch.cat([prev_gate, gate[..., dim:]], dim=2)
    return (kv * gate.softmax(dim=2)).sum(dim=2)


def _entries(module, hidden: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Normed, roped fp32 entries ``[B, N, D]``, entry ``w`` turned at ``w * ratio``."""
    entries = module.kv_norm(_window_entries(module, hidden, overlap))
    positions = torch.arange(entries.shape[1]) * module.compress_rate
    return _rope(module, entries, positions.expand(entries.shape[0], -1))


def _selection(run: _Run, indexer, hidden, q_residual, positions) -> torch.Tensor:
    """The indexer's top-k ``[B, S, k]`` (-1: none) of every query's causal entries."""
    keys = _entries(indexer, hidden, overlap=True)  # [B, N, 128]
    batch, seq, count = hidden.shape[0], hidden.shape[1], keys.shape[1]
    q = indexer.q_b_proj(q_residual).float().view(batch, seq, -1, indexer.head_dim)
    weights = indexer.scorer.weights_proj(hidden).float()
    lengths = (positions + 1) // indexer.compress_rate
    out = []
    for b in range(batch):
        if run.how.indexer == "fp32":  # transformers' scorer
            rotated = _rope(indexer, q[b : b + 1], positions[b : b + 1])[0]
            dots = torch.einsum("shd,nd->shn", rotated, keys[b]).relu()
            scale = indexer.scorer.softmax_scale * indexer.scorer.weights_scaling
            scores = torch.einsum("shn,sh->sn", dots, weights[b]) * scale
        else:  # vLLM's: e4m3 queries and keys under power-of-two scales
            cos, sin = indexer.rotary_emb(
                q, position_ids=positions[b : b + 1], layer_type="compress"
            )
            cos_sin = torch.cat([cos[0], sin[0]], -1).float()
            q_fp8, folded = v4_indexer.quantize_queries(
                q[b],
                torch.arange(seq),
                cos_sin,
                weights[b],
                indexer.scorer.softmax_scale,
                indexer.scorer.weights_scaling,
            )
            k_bytes, k_scale = v4_compressor.index_key_bytes(keys[b])
            k_fp8 = k_bytes.view(torch.float8_e4m3fn)
            scores = index_reference.logits(q_fp8.float(), folded, k_fp8, k_scale)
            if run.how.indexer == "negated":
                scores = -scores
        picked = index_reference.select_topk(scores, lengths[b], indexer.index_topk)
        out.append(picked[:, : min(indexer.index_topk, count)].long())
    return torch.stack(out)


def _compressed(run: _Run, attn, hidden, q_residual, positions):
    """(entries ``[B, N, 512]`` as the engine reads them, additive mask ``[B, S, N]``)."""
    comp = attn.compressor
    csa = comp.compress_rate == 4
    entries = _entries(comp, hidden, overlap=csa)
    if run.how.compressed_record:
        entries = through_record(entries)
    count = entries.shape[1]
    allowed = (
        torch.arange(count).view(1, 1, -1) < ((positions + 1) // comp.compress_rate)[..., None]
    )
    if csa and count:
        picked = _selection(run, comp.indexer, hidden, q_residual, positions)
        chosen = torch.zeros(*picked.shape[:2], count + 1, dtype=torch.bool)
        chosen.scatter_(-1, torch.where(picked >= 0, picked, count), True)
        allowed = allowed & chosen[..., :count]
    return entries, torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def _attention(run: _Run, attn, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """vLLM CPU's V4 attention block on transformers' weights: ``[B, S, hidden]``."""
    batch, seq, _ = hidden.shape
    q_residual = run.bf16(attn.q_a_norm(attn.q_a_proj(hidden)))
    q = attn.q_b_proj(q_residual).float().view(batch, seq, attn.num_heads, attn.head_dim)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + attn.q_b_norm.eps)
    q = run.bf16(_rope(attn, q, positions))  # [B, S, H, D]
    latent = run.bf16(attn.kv_norm(attn.kv_proj(hidden)))
    latent = run.noisy(_rope(attn, latent, positions))  # [B, S, D]
    if run.how.kv_record:
        latent = through_record(latent)
    offset = torch.arange(seq)
    window = (offset[None, :] <= offset[:, None]) & (
        offset[None, :] > offset[:, None] - attn.sliding_window
    )
    mask = torch.zeros(batch, seq, seq).masked_fill(~window, float("-inf"))
    keys = latent
    if attn.compressor is not None:
        entries, bias = _compressed(run, attn, hidden, q_residual, positions)
        keys, mask = torch.cat([latent, entries], 1), torch.cat([mask, bias], -1)
    logits = torch.einsum("bshd,bnd->bhsn", q, keys) * attn.scaling + mask[:, None]
    if run.how.sink:
        sinks = attn.sinks.float().view(1, -1, 1, 1).expand(batch, -1, seq, 1)
        probs = torch.cat([logits, sinks], -1).softmax(-1)[..., :-1]
    else:
        probs = logits.softmax(-1)
    out = run.bf16(run.noisy(torch.einsum("bhsn,bnd->bshd", probs, keys)))
    out = run.bf16(_rope(attn, out, positions, inverse=True))
    grouped = run.bf16(attn.o_a_proj(out.reshape(batch, seq, attn.config.o_groups, -1)))
    return attn.o_b_proj(grouped.flatten(2))


def _experts(run: _Run, experts, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts with vLLM's bf16 GEMM outputs and activations."""
    final = torch.zeros_like(hidden)
    for expert in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == expert)
        gate_up = run.bf16(F.linear(hidden[token], experts.gate_up_proj[expert]))
        act = run.bf16(experts._apply_gate(gate_up))
        out = run.bf16(F.linear(act, experts.down_proj[expert]))
        final.index_add_(0, token, out * top_k_weights[token, slot, None])
    return run.bf16(final)


def _decoder(run: _Run, layer, streams: torch.Tensor, positions, input_ids) -> torch.Tensor:
    """One decoder layer on ``[B, S, hc, hidden]`` streams, vLLM's bf16 stores included."""
    post, comb, block = layer.attn_hc(streams)
    attn = _attention(
        run, layer.self_attn, run.bf16(layer.input_layernorm(run.bf16(block))), positions
    )
    streams = run.bf16(_hc_post(attn, streams, post, comb))
    post, comb, block = layer.ffn_hc(streams)
    x = run.bf16(layer.post_attention_layernorm(run.bf16(block)))
    mlp = layer.mlp
    flat = x.view(-1, x.shape[-1])
    if mlp.is_hash:
        _, weights, indices = mlp.gate(x, input_ids)
    else:
        _, weights, indices = mlp.gate(x)
    routed = _experts(run, mlp.experts, flat, indices, weights).view(x.shape)
    shared = mlp.shared_experts
    gate = shared.gate_proj(x).clamp(max=shared.limit)
    act = run.bf16(shared.act_fn(gate) * shared.up_proj(x).clamp(-shared.limit, shared.limit))
    out = run.bf16(routed + shared.down_proj(act))
    return run.bf16(_hc_post(out, streams, post, comb))


def _hc_post(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """mHC expansion: ``post_j * out + sum_i comb_ij * stream_i``."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def _bf16_output(module, inputs, output):
    return output.to(torch.bfloat16).float()


@contextlib.contextmanager
def emulating_vllm(model, how: Emulation = Emulation()) -> Iterator[_Run]:
    """``model`` (transformers' DeepseekV4ForCausalLM) computing as the module docstring
    says for the block: every ``nn.Linear`` output rounded to bf16 (with ``how.bf16``),
    each decoder layer replaced by ``_decoder``, ``hc_head`` rounded."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    run = _Run(how)
    _MODEL_ROPE[0] = model.model.rotary_emb
    hooks = []
    if how.bf16:
        linears = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
        hooks = [mod.register_forward_hook(_bf16_output) for mod in linears]
        hooks += [model.model.norm.register_forward_hook(_bf16_output)]
    original_head = m.DeepseekV4HyperHead.forward

    def decoder_forward(self, hidden_states, input_ids=None, **kwargs):
        return _decoder(run, self, hidden_states, kwargs["position_ids"], input_ids)

    def head_forward(self, x):
        return run.bf16(original_head(self, x))

    try:
        with (
            replaced(m.DeepseekV4DecoderLayer, forward=decoder_forward),
            replaced(m.DeepseekV4HyperHead, forward=head_forward),
        ):
            yield run
    finally:
        for hook in hooks:
            hook.remove()


def load(model_dir):
    """transformers' DeepseekV4ForCausalLM in fp32 from ``model_dir``: every checkpoint
    tensor used, every parameter loaded (asserted)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    assert not bad and not info.get("error_msgs"), info
    return model.eval()


def reference(
    model_dir,
    prompt_ids: list[list[int]],
    forced: list[list[int]],
    how: Emulation = Emulation(),
    model=None,
) -> list[dict]:
    """Teacher-forced on ``forced[i]`` (an engine's tokens for prompt i): per prompt the
    tokens and ``[steps, vocab]`` float64 log-probabilities at every generated position
    (one whole-prefix forward each)."""
    model = model if model is not None else load(model_dir)
    results = []
    with torch.no_grad(), emulating_vllm(model, how):
        for ids, tokens in zip(prompt_ids, forced, strict=True):
            sequence = list(ids) + list(tokens[:-1])
            logits = model(torch.tensor([sequence]), use_cache=False).logits[0]
            full = torch.log_softmax(logits.double(), -1)[len(ids) - 1 :]
            results.append({"token_ids": list(tokens), "logprobs": full})
    return results
