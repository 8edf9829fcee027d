"""The OpenAI-compatible frontend: `tandem frontend` / `python -m tandem.frontend`."""
