"""Text to masked batches: corpus -> tokenizer -> prepare (packed rows on disk) -> pipeline (grain) -> masking. Numpy only; nothing here imports the model."""
