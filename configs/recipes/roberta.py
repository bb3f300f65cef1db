"""RoBERTa-base's pretraining (Liu et al., 2019): one phase.

Published (`--config=configs/recipes/roberta.py`), from the paper's Table 9
(pretraining hyperparameters of RoBERTa-base) and section 4:

  phase  steps    T    masking                    schedule                   batch  lr
  main   500,000  512  15%, 80/10/10, dynamic     24k warm-up, linear decay  8,192  6e-4

Adam (betas 0.9, 0.98, eps 1e-6), weight decay 0.01, no gradient clipping, no
sentence-pair task (FULL-SENTENCES rows of 512 tokens, section 4.2), masks
drawn anew for every batch (dynamic masking, section 4.1: mlm_jax always
masks so). Point config.data.corpus at your corpus (RoBERTa's 160GB of
BooksCorpus, Wikipedia, CC-News, OpenWebText and Stories is not public as
one set).

Tiny (`:tiny`): the recipe on the built-in corpus with configs/bert_tiny.py's
model and tokenizer in RoBERTa's layout (one token type), 128 tokens, 1,700
steps of 32 rows (a larger batch than bert_tiny's 16, as RoBERTa's is larger
than BERT's): 7.0M tokens.
Smoke (`:smoke`): tiny cut to 3 steps, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs import base
from configs import bert_tiny
from configs.recipes import common

_TABLE9 = 'Liu et al. 2019, Table 9'
_PAPER = 'Liu et al. 2019'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' : the published recipe; 'tiny': scaled to a 2-core CPU; 'smoke': tiny, cut."""
  return common.variant('roberta', arg, _published, _tiny, _smoke)


def _roberta_recipe(config: ml_collections.ConfigDict) -> None:
  """What both variants take from RoBERTa: the layout, the objective, masking, optimizer."""
  # RoBERTa's checkpoint layout: the BERT encoder with one token type (RobertaForMaskedLM).
  config.model.variant = 'roberta'
  config.model.type_vocab_size = 1
  # MLM only: no next sentence prediction (_PAPER section 4.2, FULL-SENTENCES).
  config.sentence_pair.task = 'none'
  # 15% of the tokens, 80% [MASK], 10% random, 10% kept, drawn anew each time a row is seen
  # (_PAPER sections 2.3, 4.1); fairseq draws the random token uniformly over its dictionary.
  config.masking.select_rate = 0.15
  config.masking.mask_prob = 0.8
  config.masking.random_prob = 0.1
  config.masking.random_source = 'uniform'
  # Adam eps 1e-6, beta1 0.9, beta2 0.98, weight decay 0.01, gradient clipping 0.0 (none),
  # linear decay (_TABLE9).
  config.train.optimizer = 'adamw'
  config.train.adam_eps = 1e-6
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.98
  config.train.weight_decay = 0.01
  config.train.grad_clip_norm = 0.0
  config.train.schedule = 'linear'


def _published() -> ml_collections.ConfigDict:
  # RoBERTa-base: 12 layers, hidden 768, FFN 3,072, 12 heads of 64 (_TABLE9); 512 positions
  # (transformers' 514 counts the two past its pad id; the export adds them).
  config = base.get_config()
  _roberta_recipe(config)
  # Dropout 0.1, attention dropout 0.1 (_TABLE9). The latter rules out the fused kernels.
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.1
  # Your corpus: --config.data.corpus=...
  config.data.corpus = ''
  # A byte-level BPE of 50K pieces (_PAPER section 4.4); roberta-base's has 50,265 with its
  # special tokens. Set config.tokenizer.model_file to its tokenizer.json to reuse it.
  config.tokenizer.kind = 'bpe'
  config.tokenizer.vocab_size = 50_265
  config.tokenizer.lowercase = False
  # Rows of at most T = 512 tokens (_PAPER section 3.1, FULL-SENTENCES).
  config.data.seq_len = 512
  config.masking.max_predictions = common.max_predictions(0.15, 512, 8)
  # Batch size 8k, max steps 500k, peak learning rate 6e-4, warm-up steps 24k (_TABLE9).
  config.train.batch_size = 8192
  config.train.num_steps = 500_000
  config.train.learning_rate = 6e-4
  config.train.warmup_steps = 24_000
  # 64 micro-batches of 128 rows (32 per chip on 4): the same update in less memory.
  config.train.grad_accum_steps = 64
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/bert_tiny.py: its model (L=4, d=128, 4 heads, d_ff=512, 128 positions, no dropout:
  # a run this short does not overfit), tokenizer (1,000 pieces on the built-in corpus), T=128
  # and peak rate 2e-3 (4e-3 diverged there).
  config = bert_tiny.get_config()
  _roberta_recipe(config)
  config.masking.max_predictions = common.max_predictions(0.15, 128)
  # Twice bert_tiny's batch (RoBERTa: 8k rows against BERT's 256); warm-up 5% of the steps
  # (24k of 500k).
  config.train.batch_size = 32
  config.train.num_steps = 1700
  config.train.warmup_steps = 85
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.checkpoint_every = 500
  return config


def _smoke() -> ml_collections.ConfigDict:
  """tiny cut to 3 steps with a step or two between logs, evaluations and checkpoints."""
  config = _tiny()
  config.train.num_steps = 3
  config.train.warmup_steps = 1
  config.train.log_every, config.train.eval_every, config.train.checkpoint_every = 1, 2, 2
  config.eval.max_batches = 2
  return config
