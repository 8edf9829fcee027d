"""OpenAI's chat completions, completions and models routes."""

from tandem.frontend.api.openai.serving import routes

__all__ = ["routes"]
