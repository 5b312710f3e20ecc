"""The topology matrix: the tiny DSA model (one MTP layer) through B12X_MLA_SPARSE in
multi-process vLLM CPU engines at TP {1, 2, 3 padded, 4} x DCP {1, 2, 4 where TP allows it;
3 at TP 3} x MTP {0, 3} (and MTP 1 at TP 2 / DCP 2), DCP interleave 1, 16 and 64 (a page),
both record formats (and nvfp4_ds_mla records at the seeds' TP 4 / DCP 4 / MTP 3), each
against TP 1 / DCP 1 / MTP 0 with the same records (``sparse_engine``, ``nvfp4_tp1``:
the same target weights).

Per row and record format: greedy tokens identical and top-5 log-probabilities within
``compare.SPARSE_LOGPROB_TOL`` (its error model: TP, DCP and speculation change only the
order of fp32 sums, and the decisions that order can flip, never the selection rule), for
the first checkpoint and after ``reload_weights`` of the second; no ERROR line in the
engine's log; MTP drafts k = 3 tokens per request and step; under DCP every rank ran our
DCP indexer and attention on its shard; at TP 3 (``VLLM_MLA_TP_PAD=1``: 4 heads padded to
6, the MLP 512 -> 513, the vocabulary 1024 -> 1152) the padded heads' attention outputs
were exactly 0 on every step, their absorbed pair is exactly 0, and o_proj's own kernel
gives exactly 0 from their columns.

Tiers (``VLLM_MLA_TEST_MATRIX``): ``ci`` (default) runs the rows marked ci, among them the
seeds' production shape TP 4 / DCP 4 / MTP 3 (every record format) and TP 3 (padded) /
DCP 3 / MTP 3; ``full``
every row (about 25 min on 2 cores; ``scripts/test.sh`` documents it). The table (TP, DCP,
MTP, interleave, record format, result, acceptance, time) is printed at the end of the
session and written to ``VLLM_MLA_TOPOLOGY_TABLE`` when that names a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from compare import NVFP4_FLIP_SCALE, assert_dense_match, assert_sparse_match
from conftest import (
    KV_DTYPES,
    NVFP4,
    RECORDS,
    RUNS,
    SPARSE_ENV,
    TIER,
    TOPOLOGY_TABLE,
    run_engine_jobs,
)
from engine_job import MAX_TOKENS

from vllm_mla import envs

pytestmark = pytest.mark.topology
PHASES = ("first", "reloaded")
MTP_K = 3
REAL_HEADS = 4  # the tiny model's


@dataclass(frozen=True)
class Row:
    tp: int
    dcp: int = 1
    mtp: int = 0
    interleave: int = 1
    kv: tuple[str, ...] = tuple(KV_DTYPES)
    ci: bool = False  # in the default tier

    @property
    def id(self) -> str:
        pad = "p" if self.tp % REAL_HEADS and REAL_HEADS % self.tp else ""
        return f"tp{self.tp}{pad}-dcp{self.dcp}-mtp{self.mtp}-il{self.interleave}"

    @property
    def padded(self) -> bool:
        return REAL_HEADS % self.tp != 0

    def engine(self) -> dict:
        engine: dict = {"tensor_parallel_size": self.tp}
        if self.dcp > 1:
            engine["decode_context_parallel_size"] = self.dcp
        if self.interleave > 1:
            engine["cp_kv_cache_interleave_size"] = self.interleave
        if self.mtp:
            engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": self.mtp}
        return engine


def _rows() -> list[Row]:
    ci = {
        (4, 4, MTP_K, 1): (*KV_DTYPES, NVFP4),  # the seeds' production shape, their records
        (3, 3, MTP_K, 1): ("fp8",),  # padded TP, DCP 3, MTP 3
        (2, 2, MTP_K, 16): ("bfloat16",),
        (2, 2, 0, 64): ("fp8",),
        (2, 2, 1, 1): ("fp8",),  # MTP 1: vLLM's native [B, 2] layout, localized per token
    }
    rows = []
    for tp, dcps in ((1, (1,)), (2, (1, 2)), (3, (1, 3)), (4, (1, 2, 4))):
        for dcp in dcps:
            for mtp in (0, MTP_K):
                if (tp, dcp, mtp) != (1, 1, 0):  # the reference itself
                    rows.append(Row(tp, dcp, mtp))
    rows.append(Row(2, 2, 1))
    for interleave in (16, 64):
        for mtp in (0, MTP_K):
            rows.append(Row(2, 2, mtp, interleave))
    out = []
    for row in rows:
        kv = ci.get((row.tp, row.dcp, row.mtp, row.interleave))
        if kv is not None:
            out.append(Row(row.tp, row.dcp, row.mtp, row.interleave, kv, ci=True))
        out.append(Row(row.tp, row.dcp, row.mtp, row.interleave))  # the full tier's
    return out


ROWS = [r for r in _rows() if (r.ci if TIER == "ci" else not r.ci)]
CASES = [(row, kv) for row in ROWS for kv in row.kv]


@pytest.fixture(scope="session")
def topology(mtp_models, tmp_path_factory):
    """{row id: {kv: report}}, each row run when first asked for (its formats side by side)."""
    done: dict[str, dict] = {}

    def run(row: Row) -> dict:
        if row.id not in done:
            args = [str(mtp_models["first"]), str(mtp_models["second"])]
            jobs = {}
            for kv in row.kv:
                env = {"VLLM_MLA": "1", **SPARSE_ENV[kv]}
                if row.padded:
                    env["VLLM_MLA_TP_PAD"] = "1"
                engine = ["--engine", json.dumps(row.engine())]
                jobs[kv] = ([*args, "--sparse", kv, *engine], env)
            done[row.id] = run_engine_jobs(jobs, tmp_path_factory.mktemp(row.id), timeout_s=600)
        return done[row.id]

    return run


def test_vllm_mla_tp_pad_is_off_by_default():
    assert not envs.tp_pad()  # the padded rows turn it on per engine


@pytest.mark.parametrize(("row", "kv"), CASES, ids=[f"{r.id}-{kv}" for r, kv in CASES])
def test_row_serves_what_tp1_serves(topology, sparse_engine, request, row, kv):
    report = topology(row)[kv]
    # nvfp4 records: against TP 1 with nvfp4 records, at the tolerance scaled for e2m1 flips
    nvfp4 = kv == NVFP4
    want = request.getfixturevalue("nvfp4_tp1") if nvfp4 else sparse_engine[kv]
    errors = [line for line in report["log"].splitlines() if " ERROR " in line]
    states = report["states_first"]
    assert len(states) == row.tp and not errors, errors[:5]
    for phase in PHASES:
        match = assert_sparse_match(report[phase], want[phase], NVFP4_FLIP_SCALE if nvfp4 else 1)
    counters = report.get("spec_decode_first", {})
    for rank, state in enumerate(states):
        assert state["backend"] == "B12X_MLA_SPARSE" and state["kv_format"] == RECORDS[kv]
        sparse = state["telemetry"]["sparse"]
        if row.dcp > 1:  # DCP rank = TP rank % DCP (vLLM's grouping)
            assert sparse.get("indexer:cpu:dcp", 0) > 0, sparse
            assert sparse.get(f"forward_mqa:reference:dcp{rank % row.dcp}/{row.dcp}", 0) > 0
        else:
            assert sparse.get("indexer:cpu", 0) > 0 and sparse.get("forward_mqa:reference", 0) > 0
        heads = -(-REAL_HEADS // row.tp)  # padded up where TP does not divide
        assert all(uk[0] == uv[0] == heads for uk, uv in state["pair_shapes"].values())
        # the lifecycle as at any TP: every kv_b_proj source released, the pair resident
        assert all(r["source"] == 0 and r["absorbed"] > 0 for r in state["ledger"].values())
    if row.mtp:
        assert counters["num_draft_tokens"] == row.mtp * counters["num_drafts"] > 0
        # 3 requests, a draft each decode step; an accepted draft saves a step (the last
        # step may accept more than the request still needed)
        drafts, accepted, needed = (
            counters["num_drafts"],
            counters["num_accepted_tokens"],
            3 * (MAX_TOKENS - 1),
        )
        assert drafts <= needed <= drafts + accepted
    if row.padded:
        for phase in PHASES:
            padded = report[f"padded_{phase}"]
            assert sum(p["padded_heads"] for p in padded) == heads * row.tp - REAL_HEADS
            assert all(p["calls"] > 0 for p in padded)  # the hooks saw every layer serve
            for p in padded:
                assert p["output_max"] == p["pair_max"] == p["o_proj_max"] == 0.0, p
    TOPOLOGY_TABLE.append(
        {
            "tp": f"{row.tp} (padded)" if row.padded else str(row.tp),
            "dcp": row.dcp,
            "mtp": row.mtp,
            "interleave": row.interleave,
            "records": RECORDS[kv],
            "result": f"tokens = TP 1's; worst {match.worst:.1e} nats; errors 0",
            "accepted": (
                f"{counters['num_accepted_tokens']:.0f}/{counters['num_draft_tokens']:.0f}"
                if row.mtp
                else "-"
            ),
            "time_s": round(report["timings"]["total_s"], 1),
        }
    )


def test_dense_mla_at_tp3_padded_serves_what_tp1_serves(models, engine, tmp_path):
    """The dense tiny DeepSeek-V2 model (CPU_MLA, vLLM's own backend) at TP 3 with
    VLLM_MLA_TP_PAD=1 against the same engine at TP 1: tokens and log-probabilities within
    the dense tolerance, padded heads exactly 0 (a reload included)."""
    args = [str(models["first"]), str(models["second"]), "--engine", '{"tensor_parallel_size": 3}']
    jobs = {"tp3": (args, {**RUNS["on"], "VLLM_MLA_TP_PAD": "1"})}
    report = run_engine_jobs(jobs, tmp_path)["tp3"]
    assert "tensor_parallel_size=3 pads heads 4 -> 6" in report["log"]
    for phase in PHASES:
        assert_dense_match(report[phase], engine["on"][phase])
        padded = report[f"padded_{phase}"]
        assert [p["padded_heads"] for p in padded] == [0, 0, 2]
        for p in padded:
            assert p["calls"] > 0 and p["output_max"] == p["pair_max"] == p["o_proj_max"] == 0.0
