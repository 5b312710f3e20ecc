import pytest

from vllm_mla.vllm.capabilities import (
    BackendCapabilities,
    CapabilityError,
    capabilities_for,
    lifecycle_config,
)


def test_unknown_backends_keep_everything():
    caps = capabilities_for("FLASHMLA")
    assert caps == BackendCapabilities("FLASHMLA")
    config = lifecycle_config(caps)
    assert not config.release_source and config.dense_mha_prefill


def test_mqa_only_sparse_backend_releases():
    config = lifecycle_config(capabilities_for("B12X_MLA_SPARSE"), max_scratch_bytes=1 << 20)
    assert config.release_source and not config.dense_mha_prefill
    config.check_release()  # allowed: no MHA prefill
    assert config.max_scratch_bytes == 1 << 20


def test_release_without_mqa_only_serving_is_a_configuration_error():
    with pytest.raises(CapabilityError, match="serves_extend_through_absorbed"):
        BackendCapabilities("X", releases_absorbed_source=True)
