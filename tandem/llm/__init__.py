"""LLM-level pieces shared by the frontend and the workers: wire protocols, model cards,
tokenization, chat templates, detokenization and stop conditions."""
