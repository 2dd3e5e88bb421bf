"""tokentrace: token-level latency profiling for LLM inference serving."""

__version__ = "0.1.0"
