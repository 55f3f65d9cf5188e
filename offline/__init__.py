"""The offline `LLM` API: a client of one replica over the same protocol as the HTTP frontend."""
