"""Sparse MLA attention over KPool-selected keys (absorbed latent form), see api.py."""
