"""The tools that prove the weights: qualify, soak, plot, tiny checkpoints, the CLI, and
the stand-in layers and checkpoint reader they share. Imports the core, never vLLM."""
