"""The vLLM integration: a general plugin and a documented patch registry.

Only this package imports vLLM, and only lazily (inside functions).
"""
