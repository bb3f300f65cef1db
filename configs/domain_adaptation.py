"""The worked example of continued pretraining (python -m mlm_jax.domain_adaptation).

configs/tiny.py (a small ModernBERT) with a byte-level BPE tokenizer of
2,000 ids, 5% of the documents held out, evaluated and saved only at the
end. docs/continued_pretraining.md gives its figures.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  config = tiny.get_config()
  # A byte-level BPE tokenizer (RoBERTa's and ModernBERT's kind)...
  config.tokenizer.kind = 'bpe'
  # ...of 2,000 ids.
  config.tokenizer.vocab_size = 2000
  # 5% of the documents held out.
  config.data.val_fraction = 0.05
  # Evaluated only at the end...
  config.train.eval_every = 1_000_000
  # ...and saved only there.
  config.train.checkpoint_every = 1_000_000
  return config
