"""mlm_jax: masked language model pretraining with JAX and Flax."""

__version__ = '0.1.0'
