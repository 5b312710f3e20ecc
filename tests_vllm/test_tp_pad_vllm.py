"""Head-padded TP (feature ``tp-pad``) on vLLM's own classes: its ``ModelConfig`` built from
the tiny DSA checkpoint, the default loader's weight iterator, the vocabulary padding. The
engines (TP 3 = TP 1's tokens, padded heads exactly zero) are in tests_e2e/test_topology.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model
from vllm_mla.vllm.patches import tp_pad_config, tp_pad_vocab, tp_pad_weights

REFUSAL = r"Total number of attention heads \(4\) must be divisible by tensor parallel size \(3\)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-dsa"), TinyModelSpec(sparse=True))


def model_config(path):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True)


def parallel(tp: int):
    from vllm.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp)


def test_vllm_refuses_tp3_without_the_feature(tiny):
    with pytest.raises(ValueError, match=REFUSAL):
        model_config(tiny).verify_with_parallel_config(parallel(3))


def test_the_patched_verify_pads_the_config_once_and_vllm_accepts_it(tiny):
    from vllm.config import ModelConfig

    config = model_config(tiny)
    verify = tp_pad_config.make_verify_with_parallel_config(ModelConfig.verify_with_parallel_config)
    verify(config, parallel(3))
    text = config.hf_text_config
    assert text.num_attention_heads == 6 and text.intermediate_size == 513
    assert config.model_arch_config.total_num_attention_heads == 6
    assert config.get_num_attention_heads(parallel(3)) == 2  # per rank, as vLLM asks
    record = getattr(text, tp_pad_config.RECORD)
    assert record["widths"]["heads"] == [4, 6]
    verify(config, parallel(3))  # the MTP draft's pass, or a second verify: no double pad
    assert text.num_attention_heads == 6


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nothing_changes_where_tp_divides(tiny, tp):
    config = model_config(tiny)
    before = config.hf_text_config.to_dict()
    assert tp_pad_config.pad_model_config(config, tp) is None
    assert config.hf_text_config.to_dict() == before
    assert getattr(config.hf_text_config, tp_pad_config.RECORD, None) is None


def test_the_loaders_weights_are_padded_by_name_and_untouched_without_a_record(tiny):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig())
    get_all = tp_pad_weights.make_get_all_weights(DefaultModelLoader.get_all_weights)
    plain = model_config(tiny)
    model = torch.nn.Module()
    stock = dict(DefaultModelLoader.get_all_weights(loader, plain, model))
    assert {n: t.shape for n, t in get_all(loader, plain, model)} == {
        n: t.shape for n, t in stock.items()
    }
    padded = model_config(tiny)
    tp_pad_config.pad_model_config(padded, 3)
    got = dict(get_all(loader, padded, model))
    q_b = got["model.layers.0.self_attn.q_b_proj.weight"]
    assert q_b.shape == (6 * 192, 128) and not q_b[4 * 192 :].any()
    assert torch.equal(q_b[: 4 * 192], stock["model.layers.0.self_attn.q_b_proj.weight"])
    assert got["model.layers.1.self_attn.kv_b_proj.weight"].shape == (6 * 256, 512)
    assert got["model.layers.1.self_attn.o_proj.weight"].shape == (256, 6 * 128)
    assert got["model.layers.0.mlp.down_proj.weight"].shape == (256, 513)
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (513, 256)
    assert got["lm_head.weight"].shape == (1024, 256)  # vLLM's embedding pads the vocabulary


def test_the_vocabulary_is_padded_only_at_a_tp_size_that_does_not_divide_it(monkeypatch):
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab

    pad = tp_pad_vocab.make_pad_vocab_size(vocab.pad_vocab_size)
    assert pad(1000) == vocab.pad_vocab_size(1000) == 1024  # no TP group: unchanged
    monkeypatch.setattr(tp_pad_vocab, "_tp_size", lambda: 3)
    assert pad(1000) == 1152 and pad(1000, 64) % 3 == 0
    monkeypatch.setattr(tp_pad_vocab, "_tp_size", lambda: 4)
    assert pad(1000) == 1024
