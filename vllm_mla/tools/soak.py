"""`vllm-mla soak`: post-load, then reload with new weights many times, checking each cycle.

Each cycle gives every layer new kv_b_proj weights the way vLLM's reload does
(``qualify.load_into``: new parameters, the kernel's new state), runs the lean post-load
again and checks three things against the first post-load. The weights rotate through
``pool`` seeded sets (every cycle differs from the one before; generating and quantizing
new weights would otherwise cost more than the cycle itself).

- ``pointer_moves``: the pair's addresses (the storage a CUDA graph captured) changed;
- ``value_mismatches``: the pair differs from a fresh layer built from the same weights
  through upstream's post-load (an independent path: exact equality);
- ``ledger_growth_bytes``: the ledger's bytes per owner differ from the first post-load's
  (a leaked source, a second pair, a scale copy kept twice...).

On CUDA it also checks that the allocator's allocated bytes after a cycle never exceed
those after the first one, and ``replay`` runs a captured graph reading the pair after
every cycle (its output must equal the eager one). Nothing here imports vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from vllm_mla.geometry import preset
from vllm_mla.tools.harness import (
    QualifyError,
    act_dtype,
    check_absorbed,
    dense_pair,
    device_named,
    ledger_of,
    load_into,
    pair_pointers,
    synthetic_tensors,
    upstream_pair,
)
from vllm_mla.tools.standins import MLALayer, build_layer
from vllm_mla.weights import LifecycleConfig, post_load
from vllm_mla.weights.forms import FORM_NAMES, form

Progress = Callable[[str, int], Iterator[int]]
MAX_RECORDED = 5  # failures kept with their details; the counts cover every cycle


@dataclass(frozen=True)
class SoakConfig:
    """One soak run: geometry, kv_b_proj form, cycles, device."""

    cycles: int = 1000
    preset: str = "deepseek-v2-lite"
    tp: int = 4  # 4 heads per rank: 1,000 cycles take seconds on a CPU
    layers: int = 2
    pool: int = 3  # distinct weight sets rotated through
    max_scratch_bytes: int = 1 << 20  # two heads per dequant chunk: 2 chunks per layer
    weights: str = "fp8-block-deepgemm"
    device: str = "auto"
    dtype: str = "bfloat16"
    release: bool = True
    absorbed: str = "bf16"
    seed: int = 0
    replay: bool = True  # CUDA only: a captured graph reads the pair after every cycle


@dataclass
class SoakReport:
    """Counts over every cycle; ``ok`` when all are zero."""

    cycles: int
    layers: int
    weights: str
    device: str
    pointer_moves: int = 0
    value_mismatches: int = 0
    ledger_growth_bytes: int = 0
    allocated_growth_bytes: int | None = None  # CUDA only
    replay_mismatches: int | None = None  # CUDA graphs only
    resident_bytes: int = 0
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.pointer_moves
            or self.value_mismatches
            or self.ledger_growth_bytes
            or self.allocated_growth_bytes
            or self.replay_mismatches
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _check(cfg: SoakConfig) -> None:
    if cfg.cycles < 1:
        raise QualifyError(f"--cycles must be >= 1, got {cfg.cycles}")
    if cfg.pool < 2:
        raise QualifyError(f"--pool must be >= 2 (a reload must bring new weights), got {cfg.pool}")
    if cfg.layers < 1:
        raise QualifyError(f"--layers must be >= 1, got {cfg.layers}")
    act_dtype(cfg.dtype)
    if cfg.weights not in FORM_NAMES:
        raise QualifyError(f"--weights must be one of {', '.join(FORM_NAMES)}, got {cfg.weights!r}")
    check_absorbed(cfg.absorbed, form(cfg.weights))


def _ledger(layers: list[MLALayer]) -> dict[str, int]:
    ledger = ledger_of(layers)
    return {o: ledger.bytes_of(o) for o in ("absorbed", "source", "packed")}


class _Replay:
    """A CUDA graph that reads every layer's pair into its own output (a decode stand-in)."""

    def __init__(self, layers: list[MLALayer]) -> None:
        self.layers = layers
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.out = self._read()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph):
            self.out = self._read()

    def _read(self) -> torch.Tensor:
        sums = [t.float().sum() for layer in self.layers for t in dense_pair(layer)]
        return torch.stack(sums)

    def mismatch(self) -> bool:
        self.graph.replay()
        torch.cuda.synchronize()
        return not torch.equal(self.out, self._read())


class _Soak:
    """One soak: the layers after their first post-load, what every cycle must reproduce
    (pair addresses, values of a fresh build, ledger, device bytes) and the report."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.device = device = device_named(cfg.device)
        self.act = act = act_dtype(cfg.dtype)
        geo = preset(cfg.preset).shard(cfg.tp, 0)
        f = form(cfg.weights)
        self.lifecycle = LifecycleConfig(
            release_source=cfg.release,
            dense_mha_prefill=False,
            max_scratch_bytes=cfg.max_scratch_bytes,
            absorbed=cfg.absorbed,
        )
        self.sets = [
            [synthetic_tensors(geo, f, cfg.seed + k, i, act) for i in range(cfg.layers)]
            for k in range(cfg.pool)
        ]
        self.expected = [[upstream_pair(geo, w, device, act) for w in ws] for ws in self.sets]
        self.layers = [build_layer(geo, held, device) for held in self.sets[0]]
        for layer in self.layers:
            post_load(layer, act, self.lifecycle)
        self.pointers = [pair_pointers(layer) for layer in self.layers]
        self.owners = _ledger(self.layers)
        self.cuda = device.type == "cuda"
        self.replay = _Replay(self.layers) if self.cuda and cfg.replay else None
        if self.cuda:
            torch.cuda.synchronize(device)
        self.allocated = torch.cuda.memory_allocated(device) if self.cuda else None
        self.report = SoakReport(
            cfg.cycles,
            cfg.layers,
            f.name,
            str(device),
            allocated_growth_bytes=0 if self.cuda else None,
            replay_mismatches=0 if self.replay else None,
            resident_bytes=sum(self.owners.values()),
        )

    def fail(self, cycle: int, what: str) -> None:
        if len(self.report.failures) < MAX_RECORDED:
            self.report.failures.append(f"cycle {cycle}: {what}")

    def reload(self, cycle: int) -> None:
        """Every layer gets weight set ``cycle % pool`` as vLLM's reload gives it."""
        k = cycle % self.cfg.pool
        for i, layer in enumerate(self.layers):
            load_into(layer, self.sets[k][i], self.device)
            post_load(layer, self.act, self.lifecycle)
            if pair_pointers(layer) != self.pointers[i]:
                self.report.pointer_moves += 1
                self.fail(cycle, f"layer {i}: pair addresses moved")
            pairs = zip(dense_pair(layer), self.expected[k][i], strict=True)
            if not all(torch.equal(a, b) for a, b in pairs):
                self.report.value_mismatches += 1
                self.fail(cycle, f"layer {i}: pair differs from a fresh build of weight set {k}")

    def check_memory(self, cycle: int) -> None:
        """The ledger equals the first post-load's; device bytes and graph replay hold."""
        now = _ledger(self.layers)
        if now != self.owners:
            growth = sum(max(0, now[o] - self.owners[o]) for o in self.owners)
            self.report.ledger_growth_bytes = max(self.report.ledger_growth_bytes, growth)
            self.fail(cycle, f"ledger {now} != first post-load's {self.owners}")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            extra = torch.cuda.memory_allocated(self.device) - self.allocated
            if extra > self.report.allocated_growth_bytes:
                self.report.allocated_growth_bytes = extra
                self.fail(cycle, f"allocated bytes grew by {extra}")
        if self.replay is not None and self.replay.mismatch():
            self.report.replay_mismatches += 1
            self.fail(cycle, "graph replay read a pair different from the eager one")


def run_soak(cfg: SoakConfig, progress: Progress | None = None) -> SoakReport:
    """Run ``cfg.cycles`` reload cycles; every check counted over every cycle and layer."""
    started = time.perf_counter()
    _check(cfg)
    soak = _Soak(cfg)
    cycles = progress("soak", cfg.cycles) if progress else iter(range(cfg.cycles))
    for c in cycles:
        cycle = c + 1  # cycle 0 is the first post-load
        soak.reload(cycle)
        soak.check_memory(cycle)
    soak.report.elapsed_s = round(time.perf_counter() - started, 3)
    return soak.report
