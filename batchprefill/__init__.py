"""batchprefill: offline batch LLM inference that computes every shared prompt prefix once."""

__version__ = "0.1.0"
