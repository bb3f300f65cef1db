"""Hugging Face transformers: weight layout, export, import."""
