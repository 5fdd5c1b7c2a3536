"""Serving: the continuous-batching engine (`engine`), incremental text with stop strings (`text`), the API
request models and their adapters (`protocol`) and the HTTP application (`app`; FastAPI, the `serve` extra)."""
