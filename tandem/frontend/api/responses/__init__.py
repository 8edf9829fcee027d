"""OpenAI's Responses API."""

from tandem.frontend.api.responses.serving import routes

__all__ = ["routes"]
