"""DeepSeek-V4's attention pieces in torch (no vLLM import): its fp8 cache record
(``record``), its sparse attention over the window and compressed sources with the sink
(``attention``), its RoPE (``rope``), compressors (``compressor``), indexer queries
(``indexer``) and MoE routing (``routing``). Each is the contract of one of vLLM CPU's
V4 kernels; ``vllm_mla.vllm.sparse.dsv4_ops`` serves them in vLLM's place where its
kernel library lacks them. The record writer and the attention also run in Triton on any
GPU from SM80 (``triton_kernels``), picked by ``dispatch`` and seen by torch.compile as
``custom_op``'s ops."""
