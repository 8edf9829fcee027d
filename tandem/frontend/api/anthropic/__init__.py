"""Anthropic's Messages API."""

from tandem.frontend.api.anthropic.serving import routes

__all__ = ["routes"]
