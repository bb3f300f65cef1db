"""Looking at a trained run: fill-mask predictions, what each layer knows, training curves."""
