"""Serving: the continuous-batching engine (`engine`, driving the runtime's programs: glm53.runtime), its synchronous
front for callers that want tokens for prompts (`offline`), incremental text with stop strings (`text`), the API
request models and their adapters (`protocol`) and the HTTP application (`app`; FastAPI, the `serve` extra)."""
