"""KV capacity per record format (``vllm_mla.kv_capacity``, ``vllm-mla kv-capacity``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_mla import kv_capacity
from vllm_mla.ops.sparse_mla.formats import KV_FORMAT_TABLE
from vllm_mla.tools.cli import main

GIB = 1 << 30


def test_bytes_and_tokens_per_gib_per_format():
    rows = {r.kv_format: r for r in kv_capacity.capacity(1, 1.0, index_bytes=0)}
    assert {f: r.record_bytes for f, r in rows.items()} == {
        "fp8_ds_mla": 656,
        "bf16": 1152,
        "nvfp4_ds_mla": 352,
    }
    assert rows["bf16"].tokens_per_gib_layer == GIB // 1152 == 932_067
    assert rows["fp8_ds_mla"].tokens_per_gib_layer == GIB // 656 == 1_636_801
    assert rows["nvfp4_ds_mla"].tokens_per_gib_layer == GIB // 352 == 3_050_402
    # 1.86x the tokens of fp8_ds_mla without an indexer (the figure)
    ratio = rows["nvfp4_ds_mla"].context_tokens / rows["fp8_ds_mla"].context_tokens
    assert round(ratio, 2) == 1.86


def test_a_pool_counts_layers_the_indexer_and_dcp():
    """GLM-5's 78 layers at DCP 4 with the DSA indexer's 132 B a token and layer: a rank
    holds a quarter of the context, so the pool holds 4x what one rank's budget buys."""
    (nv,) = [r for r in kv_capacity.capacity(78, 20.0, dcp=4) if r.kv_format == "nvfp4_ds_mla"]
    assert nv.bytes_per_token_rank == (352 + 132) * 78 / 4
    assert nv.context_tokens == int(20 * GIB // nv.bytes_per_token_rank)
    (one,) = [r for r in kv_capacity.capacity(78, 20.0, dcp=1) if r.kv_format == "nvfp4_ds_mla"]
    assert abs(nv.context_tokens - 4 * one.context_tokens) <= 4


def test_rows_follow_the_format_table(monkeypatch):
    extra = dataclasses.replace(KV_FORMAT_TABLE[0], name="fp8_ds_mla")
    monkeypatch.setattr(kv_capacity, "KV_FORMAT_TABLE", (*KV_FORMAT_TABLE, extra))
    assert len(kv_capacity.capacity(1, 1.0)) == len(KV_FORMAT_TABLE) + 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dcp >= 1"):
        kv_capacity.capacity(78, 20.0, dcp=0)


def test_cli_view_and_json(capsys):
    assert main(["kv-capacity", "--json", "--dcp", "4", "--budget-gib", "20"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kv_format"] for r in rows] == [f.name for f in KV_FORMAT_TABLE]
    assert main(["kv-capacity", "--preset", "glm-5"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4_ds_mla" in out and "78 layers" in out
    assert main(["kv-capacity", "--preset", "nope"]) == 2


def test_qualify_reports_the_records(capsys):
    code = main(["qualify", "--preset", "deepseek-v2-lite", "--layers", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {r["format"]: r["bytes_per_token"] for r in report["kv_records"]} == {
        "fp8_ds_mla": 2 * 656,
        "bf16": 2 * 1152,
        "nvfp4_ds_mla": 2 * 352,
    }
