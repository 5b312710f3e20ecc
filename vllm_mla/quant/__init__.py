"""Bit-exact weight quantization codecs: MXFP8 (OCP MX v1.0) and DeepSeek-style block FP8."""

from vllm_mla.quant import fp8_block, mxfp8
from vllm_mla.quant.fp8_block import FP8BlockTensor
from vllm_mla.quant.mxfp8 import MXFP8Tensor

__all__ = ["FP8BlockTensor", "MXFP8Tensor", "fp8_block", "mxfp8"]
