"""The OpenAI-compatible HTTP server (``blockspec serve``) and its load generator (``blockspec loadtest``)."""
