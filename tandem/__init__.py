"""tandem: serve LLMs on vLLM across many processes and machines."""

__version__ = "0.1.0"
