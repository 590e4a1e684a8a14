"""The vLLM sampling engine: the production engine beside the torch trainer."""
