"""The portable kpool indexer (``vllm_mla.vllm.sparse.kpool_indexer``) inside vLLM's own
GLM-5.3-Flash indexer, on CPU.

vLLM's ``Indexer`` (``vllm/models/glm5next/common/attention.py``) is built from a tiny
``Glm5NextTextConfig`` under a real ``VllmConfig``: it constructs ``SparseAttnIndexerKpool``
(ours, by ``register_oot``), its pool cache and tail ring (whose KV-cache specs size the
caches here), and quantizes the query with ``fwht128_quant_fp8`` (our stand-in). Each
step's metadata comes from vLLM's own builders (``DeepseekV32IndexerMetadataBuilder`` over
the pool cache's spec, through our ``CompressedSlotMappingKernel`` stand-in and the
V3.2 prefill-chunk stand-in, and ``KpoolTailMetadataBuilder``), read in vLLM's forward
context. The oracle is ``ops.kpool_indexer.reference`` on the op's own inputs: every
step's top-k rows, and the pool cache built by prefill pooling of every token so far
(so decode through the ring must write what prefill writes).

``torch.compile`` is off (``torch.compiler.set_stance("force_eager")``): the indexer's
compiled leaves (k norm, weight scale, head padding) run eagerly, the same ops, without
minutes of inductor compilation on a small CPU.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
from types import SimpleNamespace

import interpreted
import pytest
import torch

from vllm_mla.formats import INDEX_HEAD_DIM, INDEX_RECORD_BYTES
from vllm_mla.ops.kpool_indexer import reference as ref
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.sparse import kpool_indexer

glm5 = pytest.importorskip("vllm.models.glm5next.common.attention")

HIDDEN, HEADS, Q_LORA, TOPK, KPOOL, BLOCK = 64, 4, 32, 16, 4, 64
WIDTH = 4  # block-table columns
D = INDEX_HEAD_DIM


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from vllm_mla.vllm import patches
    from vllm_mla.vllm.sparse import cpu as sparse_cpu

    assert kpool_indexer.register("cpu")  # the op and our stand-ins
    sparse_cpu.register()  # the V3.2 prefill-chunk metadata stand-in the builder needs
    # on vLLM CPU: the indexer keeps wk_weights_proj's weight (cpu_glm5next_indexer_weights)
    patches.apply(frozenset({"sparse-cpu"}))
    yield
    patches.revert()


@pytest.fixture(autouse=True)
def _eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def config_with(**parallel):
    """vllm_layers' VllmConfig with 64-token blocks (the ring must divide them), the sparse
    prefill workspace factor vLLM's indexer sizes with, a fresh layer registry."""
    import vllm_layers

    base = vllm_layers.vllm_config()
    config = copy.copy(base)
    for name, fields in (
        ("cache_config", {"block_size": BLOCK}),
        ("attention_config", {"sparse_mla_prefill_workspace_factor": 5}),
        ("compilation_config", {"static_forward_context": {}}),
        ("parallel_config", parallel),
    ):
        part = copy.copy(getattr(base, name))
        for key, value in fields.items():
            object.__setattr__(part, key, value)
        object.__setattr__(config, name, part)
    return config


class Rig:
    """vLLM's GLM-5.3-Flash indexer, its caches and metadata builders; requests by name."""

    def __init__(self, seed: int = 0):
        from transformers import Glm5NextTextConfig
        from vllm.config import set_current_vllm_config
        from vllm.utils.torch_utils import set_default_torch_dtype
        from vllm.v1.attention.backends.mla.indexer import (
            DeepseekV32IndexerMetadataBuilder,
            KpoolTailMetadataBuilder,
        )

        self.config = config = config_with()
        text = Glm5NextTextConfig(
            hidden_size=HIDDEN,
            index_n_heads=HEADS,
            index_head_dim=D,
            index_topk=TOPK,
            index_kpool=KPOOL,
            q_lora_rank=Q_LORA,
            qk_rope_head_dim=0,  # GLM-5.3-Flash's: NoPE
            num_hidden_layers=1,
        )
        self.buffer = torch.full((96, ref.output_width(TOPK, KPOOL)), 7, dtype=torch.int32)
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            self.indexer = glm5.Indexer(
                config, text, HIDDEN, Q_LORA, None, config.cache_config, self.buffer, "l0.indexer"
            )
        self.gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self.indexer.named_parameters():
                scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0
                p.copy_((torch.randn(p.shape, generator=self.gen) * scale).to(p.dtype))
        # vLLM's own post-load pass: the quant methods bind the CPU GEMM; 0.34 then runs the
        # modules' own hooks (the Indexer builds its fp32 head-gate projection there)
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with set_current_vllm_config(config), torch.no_grad():
            process_weights_after_loading(self.indexer, config.model_config, torch.device("cpu"))
        self.op = self.indexer.indexer_op
        pool_spec = self.indexer.k_cache.get_kv_cache_spec(config)
        tail_spec = self.indexer.tail_cache.get_kv_cache_spec(config)
        assert pool_spec.tokens_per_state == KPOOL and tail_spec.block_size % KPOOL == 0
        self.pools_per_block = pool_spec.block_size // pool_spec.tokens_per_state
        self.op.k_cache.kv_cache = torch.zeros(
            12, self.pools_per_block, INDEX_RECORD_BYTES, dtype=torch.uint8
        )
        self.op.tail_cache.kv_cache = torch.zeros(
            12, 2, tail_spec.block_size, D, dtype=torch.bfloat16
        )
        with set_current_vllm_config(config):
            self.pool_builder = DeepseekV32IndexerMetadataBuilder(
                pool_spec,
                [self.op.k_cache.prefix],
                config,
                torch.device("cpu"),
                block_table_width=WIDTH,
            )
            self.tail_builder = KpoolTailMetadataBuilder(
                tail_spec, [self.op.tail_cache.prefix], config, torch.device("cpu")
            )
        self.requests = {}  # name -> dict(table, tail_block, length, k, gate)
        self.inputs = None
        self.op.register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, module, args, kwargs):
        self.inputs = (args, kwargs)

    def add(self, name: str, table: list[int], tail_block: int):
        self.requests[name] = {"table": table, "tail": tail_block, "length": 0, "k": [], "g": []}

    def _common(self, names, counts, tables, slots, positions):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        seq = torch.tensor(
            [self.requests[n]["length"] + c for n, c in zip(names, counts, strict=True)]
        )
        qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq.int(),
            seq_lens_cpu_upper_bound=seq.int(),
            num_reqs=len(names),
            num_actual_tokens=sum(counts),
            max_query_len=max(counts),
            max_seq_len=int(seq.max()),
            block_table_tensor=tables,
            slot_mapping=slots,
            positions=positions,
        )

    def step(self, batch: list[tuple[str, int]]) -> torch.Tensor:
        """One engine step (decodes first, as vLLM orders them): ``(request, new tokens)``;
        returns the step's top-k rows."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        names, counts = [n for n, _ in batch], [c for _, c in batch]
        req = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(counts))
        start = torch.tensor([self.requests[n]["length"] for n in names])
        offset = torch.arange(sum(counts)) - torch.tensor([0, *counts]).cumsum(0)[req]
        positions = start[req] + offset
        tables = torch.tensor([self.requests[n]["table"] for n in names], dtype=torch.int32)
        slots = tables[req, positions // BLOCK].long() * BLOCK + positions % BLOCK
        tails = torch.tensor([[self.requests[n]["tail"]] for n in names], dtype=torch.int32)
        with set_current_vllm_config(self.config):
            meta = self.pool_builder.build(0, self._common(names, counts, tables, slots, positions))
            ring = torch.zeros_like(slots)  # the tail group's own slots: its builder's
            tail_meta = self.tail_builder.build(
                0, self._common(names, counts, tails, ring, positions)
            )
        t = sum(counts)
        hidden = torch.randn(t, HIDDEN, generator=self.gen).to(torch.bfloat16)
        qr = torch.randn(t, Q_LORA, generator=self.gen).to(torch.bfloat16)
        prefixes = {self.op.k_cache.prefix: meta, self.op.tail_cache.prefix: tail_meta}
        with set_forward_context(prefixes, self.config):
            out = self.indexer(hidden, qr, positions, None)
        assert out is self.buffer
        (_, q, k, weights), kw = self.inputs
        self.last = (q, weights, positions, tables[req], req, names)
        for i, name in enumerate(names):
            rows = req == i
            self.requests[name]["k"].append(k[rows])
            self.requests[name]["g"].append(kw["gate_score"][rows])
            self.requests[name]["length"] += counts[i]
        return self.buffer[:t].clone()

    def reference_cache(self) -> torch.Tensor:
        """The pool cache prefill pooling of every token so far writes (the oracle)."""
        cache = torch.zeros_like(self.op.k_cache.kv_cache)
        ape = self.indexer.index_kpool_compress_ape.detach()
        for r in self.requests.values():
            if r["length"] < KPOOL:  # no pool yet (or not started)
                continue
            k, gate = torch.cat(r["k"]), torch.cat(r["g"])
            positions = torch.arange(k.shape[0])
            table = torch.tensor(r["table"]).expand(k.shape[0], -1)
            slots = ref.compressed_slot_mapping(positions, table, self.pools_per_block, KPOOL)
            ref.insert_pools(cache, ref.request_pools(k, gate, ape), slots[slots >= 0])
        return cache

    def reference_topk(self) -> torch.Tensor:
        q, weights, positions, tables, _, _ = self.last
        t = positions.shape[0]
        return ref.index_topk(
            q[:t].float(),
            weights[:t],
            self.reference_cache(),
            tables,
            positions + 1,
            TOPK,
            KPOOL,
            width=self.buffer.shape[1],
        )


def test_prefill_then_decode_through_the_ring_equals_the_reference():
    """Step 1 prefills A (37 tokens), B (21) and C (3: no pool, its chunk request index
    clamped); step 2 decodes them with D's 2-token prefill (no pool: vLLM builds no chunk;
    its rows get their tail); 5 more decode steps cross pool boundaries (A at 39, B at 23,
    C at 3 and 7 from the prefill-seeded ring, D at 3 and 7). Every step's top-k equals the
    reference's on the op's own inputs, and the pool cache equals prefill pooling."""
    telemetry.reset()
    rig = Rig()
    assert type(rig.op).__qualname__ == kpool_indexer.CLASS_NAME
    for name, block, tail in (("A", 1, 5), ("B", 2, 6), ("C", 3, 7), ("D", 4, 8)):
        rig.add(name, [block, 0, 0, 0], tail)
    steps = [[("A", 37), ("B", 21), ("C", 3)], [("A", 1), ("B", 1), ("C", 1), ("D", 2)]]
    steps += [[("A", 1), ("B", 1), ("C", 1), ("D", 1)]] * 5
    for i, batch in enumerate(steps):
        before = rig.buffer.clone()
        got = rig.step(batch)
        assert torch.equal(got, rig.reference_topk()), i
        assert torch.equal(rig.op.k_cache.kv_cache, rig.reference_cache()), i
        assert torch.equal(rig.buffer[got.shape[0] :], before[got.shape[0] :])  # untouched
    lengths = {n: r["length"] for n, r in rig.requests.items()}
    assert lengths == {"A": 43, "B": 27, "C": 9, "D": 7}
    assert telemetry.snapshot()["sparse"] == {"indexer:kpool:cpu": len(steps)}
    # the query went through the fwht stand-in: rotated, ue8m0 e4m3 per (token, head), the
    # heads vLLM pads for DeepGEMM zero
    q = rig.last[0]
    assert q.dtype == torch.float8_e4m3fn and q.shape[1] == 32
    assert (q[:, HEADS:].float() == 0).all()


def test_the_compressed_slot_mapping_stand_in_is_the_reference_with_vllms_pad_rule():
    """vLLM's ``get_compressed_slot_mapping`` on CPU (our stand-in): the reference's pool
    slots, except where the token's own slot is PAD (SWA replay)."""
    from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping

    seq = torch.tensor([12, 9], dtype=torch.int32)  # request 0 resumes at position 6
    qsl = torch.tensor([0, 6, 15], dtype=torch.int32)
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    positions = torch.cat([torch.arange(6, 12), torch.arange(9)])
    req = torch.tensor([0] * 6 + [1] * 9)
    own = torch.arange(15, dtype=torch.int64)
    own[5] = -1  # position 11 of request 0 (completes pool 2): replayed, PAD
    got = get_compressed_slot_mapping(15, own, qsl, seq, table, 2, KPOOL)
    want = ref.compressed_slot_mapping(positions, table[req], 2, KPOOL)
    assert want[5] >= 0
    want[5] = -1
    assert got.tolist() == want.tolist()
    assert (want >= 0).sum() == 3  # position 7 of request 0, 3 and 7 of request 1


def test_the_fwht_stand_in_is_the_reference_query_quantization():
    """vLLM's ``fwht128_quant_fp8`` on CPU (launcher unchanged, kernel ours) returns the
    reference's ``quantize_query``: values and scales bit for bit, scales ``[rows, 1]``."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import fwht128_quant_fp8

    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(45, D, generator=gen) * torch.logspace(-4, 3, 45)[:, None]).bfloat16()
    values, scales = fwht128_quant_fp8(q)
    want_values, want_scales = ref.quantize_query(q[:, None])
    assert scales.shape == (45, 1)
    assert torch.equal(values.view(torch.uint8), want_values[:, 0].view(torch.uint8))
    assert torch.equal(scales[:, 0], want_scales[:, 0])


# -- the ring update: spec-decode batches and chunks starting mid-pool ----------------------
def ring_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 12, D, generator=gen).bfloat16()
    gate = (torch.randn(2, 12, D, generator=gen) * 3).bfloat16()
    ape = torch.randn(KPOOL, D, generator=gen)
    return k, gate, ape


def run_steps(sizes: list[int], ring: int, *, prefill_first: int = 0, tail_out=None):
    """Two requests (pool pages 2 and 0, ring blocks 1 and 3), each ``prefill_first``
    prefill tokens and then steps of ``sizes`` tokens (both requests per step, request 0's
    tokens first), through ``update_pools``; returns the pool cache."""
    k, gate, ape = ring_case(7)
    cache = torch.zeros(4, 8, INDEX_RECORD_BYTES, dtype=torch.uint8)
    tail = torch.zeros(4, 2, ring, D, dtype=torch.bfloat16)
    tables, blocks = torch.tensor([[2, 1], [0, 3]]), torch.tensor([1, 3])
    start = 0
    for size, stash_all in [(prefill_first, False)] * bool(prefill_first) + [
        (s, True) for s in sizes
    ]:
        pos = torch.arange(start, start + size).repeat(2)
        req = torch.arange(2).repeat_interleave(size)
        pslots = ref.compressed_slot_mapping(pos, tables[req], 8, KPOOL)
        tslots = blocks[req] * ring + pos % ring
        kpart, gpart = k[req, pos], gate[req, pos]
        kpool_indexer.update_pools(
            cache, tail, kpart, gpart, ape, pos, pslots, tslots, stash_all=stash_all
        )
        start += size
        if tail_out is not None:
            tail_out.append(tail.clone())
    want = torch.zeros_like(cache)
    for r in range(2):
        n = start // KPOOL * KPOOL
        slots = ref.compressed_slot_mapping(torch.arange(n), tables[r].expand(n, -1), 8, KPOOL)
        ref.insert_pools(want, ref.request_pools(k[r, :n], gate[r, :n], ape), slots[slots >= 0])
    return cache, want


@pytest.mark.parametrize("sizes", [[3, 3, 3, 3], [1, 2, 4, 1, 4], [4] * 3])
def test_spec_decode_steps_through_the_ring_equal_prefill(sizes):
    """Up to 4 tokens per request per step (drafts), ring 8 >= kpool + drafts: a pool
    completed mid-step reads its earlier tokens from this step's rows and the ring."""
    cache, want = run_steps(sizes, ring=8)
    assert torch.equal(cache, want)


def test_a_prefill_chunk_starting_mid_pool_reads_the_seeded_ring():
    """A 6-token prefill chunk seeds its last kpool tokens; the next chunk (2 tokens from
    position 6, mid-pool) completes pool 1 from the ring."""
    cache, want = run_steps([2, 4], ring=KPOOL, prefill_first=6)
    assert torch.equal(cache, want)


def test_prefill_seeds_only_each_requests_last_kpool_tokens():
    """vLLM's seed rule (``kpool_seed_tail_cache``): a 12-token prefill into an 8-slot ring
    writes positions 8..11 (slots 0..3) and leaves slots 4..7 as they were."""
    k, gate, _ = ring_case(7)
    tails = []
    run_steps([], ring=8, prefill_first=12, tail_out=tails)
    (tail,) = tails
    for r, block in enumerate((1, 3)):
        assert torch.equal(tail[block, 0, :4], k[r, 8:12])
        assert torch.equal(tail[block, 1, :4], gate[r, 8:12])
        assert (tail[block, :, 4:] == 0).all()


def test_every_token_completing_a_pool_matches_the_sequential_reference():
    """``update_pools`` equals ``reference.decode_step`` (vLLM's per-token order) on a step
    of two requests x 3 tokens whose ring holds earlier steps' tokens."""
    k, gate, ape = ring_case(9)
    ring = 8
    tables, blocks = torch.tensor([[2, 1], [0, 3]]), torch.tensor([1, 3])
    caches = [torch.zeros(4, 8, INDEX_RECORD_BYTES, dtype=torch.uint8) for _ in range(2)]
    tails = [torch.zeros(4, 2, ring, D, dtype=torch.bfloat16) for _ in range(2)]
    for first, size in ((0, 5), (5, 3), (8, 3)):
        pos = torch.arange(first, first + size).repeat(2)
        req = torch.arange(2).repeat_interleave(size)
        pslots = ref.compressed_slot_mapping(pos, tables[req], 8, KPOOL)
        tslots = blocks[req] * ring + pos % ring
        args = (k[req, pos], gate[req, pos], ape, pos, pslots, tslots)
        kpool_indexer.update_pools(caches[0], tails[0], *args, stash_all=True)
        ref.decode_step(caches[1], tails[1], *args)
        assert torch.equal(caches[0], caches[1]) and torch.equal(tails[0], tails[1]), first


def test_only_a_pools_last_token_writes_it():
    """A pool slot on a token that does not end its pool (position 1) writes nothing, as
    vLLM's decode kernel (``slot == POOL_SIZE - 1``) and the reference."""
    k, gate, ape = ring_case(3)
    cache = torch.zeros(2, 8, INDEX_RECORD_BYTES, dtype=torch.uint8)
    tail = torch.zeros(2, 2, 8, D, dtype=torch.bfloat16)
    one = torch.tensor([1])
    kpool_indexer.update_pools(
        cache, tail, k[0, :1], gate[0, :1], ape, one, one * 0, one * 9, stash_all=True
    )
    assert (cache == 0).all() and torch.equal(tail[1, 0, 1], k[0, 0])


def test_a_pool_never_takes_another_requests_rows():
    """Request 1's rows follow request 0's with consecutive positions (0: 5, 6; 1: 7, 8):
    request 1's pool 4..7 takes 4..6 from its own ring, not request 0's rows (the tail
    block tells requests apart)."""
    k, gate, ape = ring_case(11)
    ring, tables, blocks = 8, torch.tensor([[2, 1], [0, 3]]), torch.tensor([1, 3])
    caches = [torch.zeros(4, 8, INDEX_RECORD_BYTES, dtype=torch.uint8) for _ in range(2)]
    tails = [torch.zeros(4, 2, ring, D, dtype=torch.bfloat16) for _ in range(2)]
    steps = [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]), ([5, 6], [7, 8]), ([7, 8, 9], [9, 10, 11])]
    for first, second in steps:
        pos = torch.tensor(first + second)
        req = torch.tensor([0] * len(first) + [1] * len(second))
        pslots = ref.compressed_slot_mapping(pos, tables[req], 8, KPOOL)
        tslots = blocks[req] * ring + pos % ring
        args = (k[req, pos], gate[req, pos], ape, pos, pslots, tslots)
        kpool_indexer.update_pools(caches[0], tails[0], *args, stash_all=True)
        ref.decode_step(caches[1], tails[1], *args)
    assert torch.equal(caches[0], caches[1]) and torch.equal(tails[0], tails[1])


# -- refusals: one per setting ------------------------------------------------------------------
def construct(cls, config=None, *, kpool=KPOOL, topk=TOPK, width=None, **kwargs):
    from vllm.config import set_current_vllm_config

    width = ref.output_width(TOPK, KPOOL) if width is None else width
    kwargs.setdefault("tail_cache", SimpleNamespace(prefix="l.tail_cache"))
    with set_current_vllm_config(config or config_with()):
        return cls(
            SimpleNamespace(prefix="l.k_cache", _index_kpool=kpool),
            128,
            "ue8m0",
            topk,
            kwargs.pop("head_dim", D),
            512,
            4096,
            torch.full((8, width), -1, dtype=torch.int32),
            **kwargs,
        )


REFUSALS = {
    "decode_context_parallel_size=2": {"config": {"decode_context_parallel_size": 2}},
    "prefill_context_parallel_size=2": {"config": {"prefill_context_parallel_size": 2}},
    "use_fp4_cache=True": {"use_fp4_cache": True},
    "skip_k_cache_insert=True": {"skip_k_cache_insert": True},
    "tail_cache=None": {"tail_cache": None},
    "head_dim=64": {"head_dim": 64},
    "index_topk=18": {"topk": 18},
    "a top-k buffer 16 wide": {"width": 16},
}


@pytest.mark.parametrize("setting", REFUSALS)
def test_each_unserved_setting_is_refused_at_construction_by_name(setting):
    kwargs = dict(REFUSALS[setting])
    config = config_with(**kwargs.pop("config")) if "config" in kwargs else None
    with pytest.raises(NotImplementedError, match="does not serve " + setting):
        construct(kpool_indexer.make_indexer(), config, **kwargs)


@pytest.mark.parametrize(
    ("method", "on_cpu", "refused"),
    [("mtp", True, True), ("mtp", False, False), ("ngram", True, False), (None, True, False)],
)
def test_mtp_on_vllms_v1_proposer_is_refused_with_its_reason(method, on_cpu, refused):
    """vLLM CPU 0.32 stops such an engine after loading with 'All drafting layers should
    belong to the same kv cache group'; this says why, at construction. Elsewhere (the GPU
    model runner v2, other methods, no speculation) nothing is refused."""
    import importlib.util

    speculative = None if method is None else SimpleNamespace(method=method)
    reason = kpool_indexer.speculative_refusal(speculative, on_cpu)
    has_v1 = importlib.util.find_spec(kpool_indexer.V1_PROPOSER) is not None
    assert (reason is not None) == (refused and has_v1)
    if reason is not None:
        assert "speculative_config method=mtp" in reason and "second KV-cache group" in reason


def test_vllms_v1_proposer_wants_one_group_and_the_tail_ring_is_its_own():
    """The two facts the refusal rests on, read from the installed vLLM."""
    import importlib
    import inspect

    proposer = pytest.importorskip(kpool_indexer.V1_PROPOSER)
    check = inspect.getsource(proposer.SpecDecodeBaseProposer.validate_same_kv_cache_group)
    assert "All drafting layers should belong to the same kv cache group" in check
    attention = importlib.import_module("vllm.models.glm5next.common.attention")
    tail = inspect.getsource(attention.Glm5NextTailCache.get_kv_cache_spec)
    assert "CircularBufferSpec(" in tail and "block_size=ring" in tail


def test_the_default_settings_construct():
    made = construct(kpool_indexer.make_indexer())
    assert made.vllm_mla_ours and made.topk_tokens == TOPK


# -- registration ----------------------------------------------------------------------------
def test_register_installs_the_op_and_the_stand_ins(registered):
    """``register`` installs the op and the stand-ins at once (the plugin defers it to the
    model's import: ``test_glm5next_wiring``)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.triton_utils import dispatcher

    assert "kpool" in kpool_indexer.register("cpu")
    assert op_registry_oot["SparseAttnIndexerKpool"].__qualname__ == kpool_indexer.CLASS_NAME
    for stand_in in kpool_indexer.STAND_INS:
        host, attr = dispatcher._resolve_kernel(stand_in.kernel)
        assert getattr(host, attr).func is stand_in.impl
        assert stand_in.why and stand_in.how and stand_in.removal


def test_the_stand_ins_register_once(monkeypatch):
    """A second registration (the plugin runs in every process, maybe twice) does not wrap
    vLLM's kernel wrapper again."""
    from vllm.triton_utils import dispatcher

    calls = []
    monkeypatch.setattr(dispatcher, "register_kernels", calls.append)
    kpool_indexer.register_stand_ins()
    assert calls == []


def test_a_vllm_without_glm5next_skips_by_name(monkeypatch):
    monkeypatch.setattr(kpool_indexer, "BASE_MODULE", "vllm.models.no_such_model.sparse_indexer")
    assert kpool_indexer.register("cpu").startswith("kpool indexer skipped: vllm.models.no_such")


def test_a_profile_run_returns_the_buffer_untouched():
    """No metadata dict (vLLM's dummy / profile run): nothing written, nothing selected."""
    from vllm.forward_context import set_forward_context

    made = construct(kpool_indexer.make_indexer())
    before = made.topk_indices_buffer.clone()
    with set_forward_context(None, config_with()):
        out = made.forward_cpu(
            torch.zeros(3, HIDDEN),
            torch.zeros(3, 32, D).to(torch.float8_e4m3fn),
            torch.zeros(3, D),
            torch.zeros(3, 32),
            gate_score=torch.zeros(3, D),
            compress_ape=torch.zeros(KPOOL, D),
            index_kpool=KPOOL,
            positions=torch.arange(3),
        )
    assert out is made.topk_indices_buffer and torch.equal(out, before)


# -- CUDA: the choice, the guard ---------------------------------------------------------------
def test_the_deepgemm_guard_we_lift_is_the_one_vllm_has():
    module = importlib.import_module(kpool_indexer.BASE_MODULE)
    source = inspect.getsource(module.SparseAttnIndexerKpool.__init__)
    assert "if current_platform.is_cuda() and not has_deep_gemm():" in source
    assert source.count("has_deep_gemm") == 1


def test_on_cuda_without_deepgemm_ours_constructs_and_vllms_raises(monkeypatch):
    """CUDA stood in for by the platform's ``is_cuda``; DeepGEMM absent."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.platforms import current_platform

    from vllm_mla.vllm.sparse import indexer

    config = config_with()
    module = importlib.import_module(kpool_indexer.BASE_MODULE)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(module, "has_deep_gemm", lambda: False)
    monkeypatch.setattr(indexer, "vllm_indexer_runs", lambda device=None: (False, "no DeepGEMM"))
    monkeypatch.setenv("VLLM_MLA_INDEXER", "auto")
    made = construct(kpool_indexer.make_indexer(), config)
    assert made.vllm_mla_ours
    monkeypatch.delitem(op_registry_oot, module.SparseAttnIndexerKpool.__name__, raising=False)
    with pytest.raises(RuntimeError, match="requires DeepGEMM"):
        construct(module.SparseAttnIndexerKpool, config)


def test_where_vllms_indexer_runs_it_is_kept_untouched(monkeypatch):
    """CUDA with DeepGEMM: ``register("cuda")`` keeps vLLM's; forced ours aside, our class
    built there is vLLM's (no refusal, its forward)."""
    from vllm.platforms import current_platform

    from vllm_mla.vllm.sparse import indexer

    monkeypatch.setattr(indexer, "vllm_indexer_runs", lambda device=None: (True, ""))
    monkeypatch.setenv("VLLM_MLA_INDEXER", "auto")
    assert kpool_indexer.register("cuda").startswith("vLLM's kpool indexer kept")
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    base = importlib.import_module(kpool_indexer.BASE_MODULE)
    monkeypatch.setattr(base, "has_deep_gemm", lambda: True)  # the premise: DeepGEMM there
    made = construct(kpool_indexer.make_indexer(), use_fp4_cache=True)  # vLLM's: allowed
    assert not made.vllm_mla_ours
    module = importlib.import_module(kpool_indexer.BASE_MODULE)
    calls = []
    monkeypatch.setattr(
        module.SparseAttnIndexerKpool, "forward_cuda", lambda *a, **k: calls.append("vllm")
    )
    made.forward_cuda(None, None, None, None, index_kpool=KPOOL)
    assert calls == ["vllm"]


# -- the stand-ins against vLLM's Triton kernels, interpreted ----------------------------------
INTERPRETED = r"""
import types
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter
import vllm.models.glm5next.nvidia.ops.kpool_compress as kc
from vllm.v1.attention.backends.mla.compressor_utils import CompressedSlotMappingKernel
from vllm.models.common.ops.fused_qk_rmsnorm import FusedQKVRMSNormKernel
from vllm_mla.vllm.sparse.kpool_indexer import STAND_INS, compressed_slot_mapping_kernel, fwht_quant

# The interpreter's float casts are not a GPU's: fp32 -> bf16 truncates, and fp32 -> e4m3
# drops the carry when rounding up crosses a power of two (125.2 -> 64). A GPU rounds to
# nearest even (cvt.rn): the casts below are torch's, which do.
TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16,
         tl.float8e4nv: torch.float8_e4m3fn, tl.float16: torch.float16}
INTS = {8: torch.int8, 16: torch.int16, 32: torch.int32}
original = interpreter._convert_float

def gpu_cast(data, src, dst, rounding_mode):
    if src not in TORCH or dst not in TORCH:
        return original(data, src, dst, rounding_mode)
    bits = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=f"int{src.primitive_bitwidth}"))
    out = bits.view(TORCH[src]).to(TORCH[dst]).view(INTS[dst.primitive_bitwidth])
    unsigned = getattr(np, f"uint{dst.primitive_bitwidth}")
    return out.numpy().view(unsigned).reshape(data.shape)

interpreter._convert_float = gpu_cast

def real(fn, **helpers):
    # without a GPU driver vLLM's triton.jit is a placeholder returning the function
    fn = getattr(fn, "fn", fn)
    g = {**fn.__globals__, "tl": tl, "triton": triton, **helpers}
    return triton.jit(types.FunctionType(fn.__code__, g, fn.__name__))

fwht = real(kc._fwht_quant_kernel, _fwht_stage=real(kc._fwht_stage))
gen = torch.Generator().manual_seed(0)
q = (torch.randn(70, 128, generator=gen) * torch.logspace(-5, 3, 70)[:, None]).bfloat16()
q[5] = 0
outs = []
for run in ("vllm", "ours"):
    values = torch.full((72, 128), 3.0).to(torch.float8_e4m3fn)
    scales = torch.full((72, 1), -1.0)
    if run == "vllm":
        fwht[(3,)](q, values, scales, 70, BLOCK_R=32)
    else:
        fwht_quant(q, values, scales, 70, BLOCK_R=32, num_warps=2)
    outs.append((values.view(torch.uint8), scales))
for a, b in zip(*outs):
    assert torch.equal(a, b), (a != b).nonzero()[:8].tolist()

slot = real(CompressedSlotMappingKernel.kernel)
qsl = torch.tensor([0, 6, 15, 15, 27], dtype=torch.int32)
seq = torch.tensor([14, 9, 0, 40], dtype=torch.int32)
table = torch.arange(4 * 6, dtype=torch.int32).view(4, 6).flip(1).contiguous()
own = torch.arange(27, dtype=torch.int64)
own[[4, 20]] = -1
for world, interleave in ((1, 1), (2, 8), (2, 4)):
    outs = []
    for run in ("vllm", "ours"):
        out = torch.full((30,), -1, dtype=torch.int64)
        args = (out, own, qsl, seq, table, 6, 2, world, interleave)
        if run == "vllm":
            slot[(4,)](*args, COMPRESS_RATIO=4, PAD_ID=-1, TRITON_BLOCK_SIZE=1024)
        else:
            compressed_slot_mapping_kernel(*args, COMPRESS_RATIO=4, PAD_ID=-1)
        outs.append(out)
    assert torch.equal(*outs), (world, interleave, outs)
    assert (outs[0] >= 0).sum() > 2

# the fused q / kv RMSNorm: strided rows (the split of one [T, 128 + 512] projection)
norm = real(FusedQKVRMSNormKernel.kernel)
(norm_stand_in,) = [s.impl for s in STAND_INS if s.kernel.endswith("FusedQKVRMSNormKernel.kernel")]
fused = (torch.randn(9, 640, generator=gen) * torch.logspace(-3, 2, 9)[:, None]).bfloat16()
qr, kv = fused[:, :128], fused[:, 128:]
weights = [(torch.rand(n, generator=gen) + 0.5).bfloat16() for n in (128, 512)]
outs = []
for run in ("vllm", "ours"):
    q_out, kv_out = torch.full((9, 128), 7.0).bfloat16(), torch.full((9, 512), 7.0).bfloat16()
    kwargs = dict(q_ptr=qr, q_out_ptr=q_out, q_weight_ptr=weights[0], q_in_stride=640,
                  q_out_stride=128, kv_ptr=kv, kv_out_ptr=kv_out, kv_weight_ptr=weights[1],
                  kv_in_stride=640, kv_out_stride=512, eps=1e-6, Q_SIZE=128, KV_SIZE=512,
                  BLOCK_SIZE=512, launch_pdl=False)
    if run == "vllm":
        norm[(9, 2)](**kwargs)
    else:
        norm_stand_in(**kwargs, num_warps=4)  # as vLLM's jit-warmup launch passes it
    outs.append((q_out, kv_out))
for a, b in zip(*outs):
    # the same fp32 arithmetic but for the order of the row's sum of squares: at most one
    # bf16 step apart, and in a few elements only
    step = (a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-30)
    assert step.max() <= 2.0**-7 and (a != b).float().mean() < 0.02, (step.max(), (a != b).sum())
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_stand_ins_equal_vllms_triton_kernels_in_the_interpreter():
    """Our ``fwht_quant`` and ``compressed_slot_mapping_kernel`` against vLLM's own
    ``_fwht_quant_kernel`` and ``CompressedSlotMappingKernel.kernel`` in Triton's CPU
    interpreter, its float casts made a GPU's (round to nearest even: the script says
    where the interpreter's differ): every output byte equal, rows past the launch left;
    the fused q / kv RMSNorm stand-in against ``FusedQKVRMSNormKernel.kernel`` within one
    bf16 step (the order of a fp32 sum)."""
    interpreted.run(INTERPRETED)
