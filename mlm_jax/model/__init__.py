"""Flax Linen encoders and the MLM head: pure functions of (params, batch); logical axis names, no configs files or data."""
