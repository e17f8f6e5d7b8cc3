"""Serving: kvlab stores inside mlx-lm's own server, and a load generator for any OpenAI-compatible
endpoint (``kv.load_test``)."""
