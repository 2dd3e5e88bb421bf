"""A small, complete LLM serving stack in PyTorch, instrumented from outside.

This package imports nothing from tokentrace: it exposes hook points (an
observer protocol) that any tracer can attach to, exactly as a third-party
server would.
"""
