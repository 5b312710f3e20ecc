"""DeepSeek-V4's attention pieces in torch: its fp8 cache record (``record``) and its
sparse attention over the window and compressed sources with the sink (``attention``)."""
