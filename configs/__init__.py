"""Experiment configs: one `get_config()` per file, used as `--config=configs/NAME.py`."""
