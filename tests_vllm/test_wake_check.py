"""Weights lost to sleep level 2 and not reloaded are caught before they serve.

Sleep mode needs CUDA (its allocator unmaps and remaps the weights pool), so here the
worker methods are vLLM's patched ``Worker.sleep`` / ``wake_up`` / ``execute_model``
replacements wrapped around stand-in originals, and the discard is what a remapped
pool reads as: every byte of the layer's weight storages overwritten (zeros, or the
bytes another owner left there). The layers, their post-load (which records the
fingerprints) and the reload are vLLM's own (``MLAAttention``, a real fp8-block
``kv_b_proj``, vLLM's layerwise reload).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import model_with, reload_through_vllm
from vllm_layers import post_load

from vllm_mla.memory.ledger import layer_owners
from vllm_mla.vllm import wake_check
from vllm_mla.vllm.patches import MARK, PATCHES
from vllm_mla.vllm.patches.wake_check_execute_model import make_execute_model
from vllm_mla.vllm.patches.wake_check_sleep import make_sleep
from vllm_mla.vllm.patches.wake_check_wake_up import make_wake_up

STATE = wake_check.STATE


pytestmark = pytest.mark.usefixtures("no_default_quant_scales")


class Worker:
    """The three patched methods around originals that record their calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sleep = make_sleep(lambda w, level: self.calls.append(f"sleep({level})")).__get__(self)
        self.wake_up = make_wake_up(lambda w, tags: self.calls.append(f"wake({tags})")).__get__(
            self
        )
        self.execute_model = make_execute_model(lambda w, out: self.calls.append("step")).__get__(
            self
        )


def loaded(registered, seed=0, **kw):
    model = model_with("fp8-block", seed, **kw)
    with torch.no_grad():
        post_load(model.attn, torch.bfloat16)
    return model


def discard(layer) -> None:
    """What a discarded, remapped weights pool reads as: other bytes everywhere."""
    with torch.no_grad():
        for group in layer_owners(layer).values():
            for t in group:
                if t.numel():
                    t.view(torch.uint8).zero_() if t.is_contiguous() else t.zero_()


def test_a_level2_wake_without_reload_raises_naming_the_layer(registered):
    model = loaded(registered)
    name = model.attn.layer_name
    assert STATE.layers[name]() is model.attn  # the post-load registered it
    worker = Worker()
    worker.sleep(2)
    discard(model.attn)
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])
    with pytest.raises(wake_check.WeightsDiscarded, match=r"weights of 1 MLA layers were"):
        worker.execute_model(None)
    assert worker.calls[-1] != "step"  # nothing served
    worker.execute_model(None)  # said once: the next step runs (the user was told)
    assert worker.calls[-1] == "step"


def test_a_proper_recovery_raises_no_alarm(registered):
    model = loaded(registered)
    worker = Worker()
    worker.sleep(2)
    discard(model.attn)
    worker.wake_up(["weights"])
    reload_through_vllm(model, seed=1)  # vLLM's reload -> our post-load re-records
    worker.wake_up(["kv_cache"])
    worker.execute_model(None)
    assert worker.calls[-1] == "step" and not STATE.due


def test_weights_kept_through_the_sleep_raise_no_alarm(registered):
    """Weights that survive (a preserved pool, sleep_preserve_parameter_names): intact."""
    model = loaded(registered)
    worker = Worker()
    worker.sleep(2)
    assert set(STATE.prints) == {model.attn.layer_name}  # taken before vLLM's sleep ran
    assert worker.calls == ["sleep(2)"]
    worker.wake_up(None)
    worker.execute_model(None)
    assert worker.calls[-1] == "step"


def test_the_fingerprint_is_taken_before_vllms_sleep_discards(registered):
    model = loaded(registered)
    intact = STATE.fingerprint_of(model.attn)
    seen = []

    def original_sleep(worker, level):  # vLLM's sleep: what was recorded by then
        seen.append(dict(STATE.prints))
        discard(model.attn)

    make_sleep(original_sleep)(None, 2)
    assert seen == [{model.attn.layer_name: intact}]
    assert STATE.fingerprint_of(model.attn) != intact  # the discard is visible


@pytest.mark.parametrize("sequence", ["level1", "no sleep", "kv only"])
def test_no_check_without_a_level2_weights_wake(registered, sequence):
    model = loaded(registered)
    worker = Worker()
    if sequence == "level1":  # weights offloaded and restored by vLLM: intact
        worker.sleep(1)
        worker.wake_up(None)
    elif sequence == "kv only":
        worker.sleep(2)
        worker.wake_up(["kv_cache"])
    discard(model.attn)  # even if something else clobbered them: not this check's call
    worker.execute_model(None)
    assert worker.calls[-1] == "step"


def test_warn_mode_logs_one_line_and_serves(registered, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_MLA_WAKE_CHECK", "warn")
    model = loaded(registered)
    worker = Worker()
    worker.sleep(2)
    discard(model.attn)
    worker.wake_up(None)
    with caplog.at_level(logging.WARNING, logger="vllm_mla"):
        worker.execute_model(None)
    assert worker.calls[-1] == "step"
    assert [r.message for r in caplog.records if "not reloaded" in r.message] == [
        "vllm-mla: " + wake_check.MESSAGE.format(n=1, layers=model.attn.layer_name)
    ]


def test_off_fingerprints_and_checks_nothing(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_WAKE_CHECK", "off")
    model = loaded(registered)
    worker = Worker()
    worker.sleep(2)
    assert STATE.prints == {} and not STATE.armed
    discard(model.attn)
    worker.wake_up(None)
    worker.execute_model(None)
    assert worker.calls[-1] == "step"
    monkeypatch.setenv("VLLM_MLA_WAKE_CHECK", "loud")
    with pytest.raises(ValueError, match="VLLM_MLA_WAKE_CHECK must be one of"):
        worker.sleep(2)


def test_the_released_source_layer_is_checked_through_its_pair(registered):
    """B12X_MLA_SPARSE releases kv_b_proj: the pair alone carries the fingerprint."""
    model = loaded(registered, backend="B12X_MLA_SPARSE", dense_prefill=False)
    assert model.attn.kv_b_proj.weight.numel() == 0
    worker = Worker()
    worker.sleep(2)
    discard(model.attn)
    worker.wake_up(["weights"])
    with pytest.raises(wake_check.WeightsDiscarded):
        worker.execute_model(None)


def test_the_patches_wrap_vllms_worker(registered):
    from vllm.v1.worker.gpu_worker import Worker as VllmWorker

    names = {p.name for p in PATCHES if p.feature == "wake-check"}
    for method in ("sleep", "wake_up", "execute_model"):
        assert getattr(getattr(VllmWorker, method), MARK) in names, method
