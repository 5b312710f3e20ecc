"""vLLM glue of ``B12X_MLA_SPARSE`` (imports vLLM; loaded by the plugin's 'sparse' feature).

``backend`` (the class vLLM resolves), ``impl`` (forward_mqa, preparation, owners),
``metadata`` (lean builder), ``registration`` (idempotent register_backend).
"""
