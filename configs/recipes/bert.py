"""BERT-base's pretraining (Devlin et al., 2019) as one run in two phases.

Published (`--config=configs/recipes/bert.py`), from the paper's appendix A.2
and google-research/bert (README.md, run_pretraining.py, optimization.py,
create_pretraining_data.py):

  phase  steps    T    masking             schedule                       batch  lr
  short  900,000  128  15%, 80/10/10, NSP  10k warm-up, linear decay      256    1e-4
  long   100,000  512  15%, 80/10/10, NSP  linear decay to 0 (continued)  256    1e-4

Adam (betas 0.9, 0.999, eps 1e-6) with decoupled weight decay 0.01 and
clipping at global norm 1.0; the optimizer's moments and the learning rate
carry over the boundary. Point config.data.corpus at your corpus (BERT's:
BooksCorpus and English Wikipedia, 3.3B words).

Tiny (`:tiny`): the same two phases on the built-in corpus with
configs/bert_tiny.py's model and tokenizer, 64 then 128 tokens (the model's
position table holds 128), 5,400 + 600 steps of 16 rows: 6.8M tokens
(5.5M at T=64, 1.2M at T=128).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs import base
from configs import bert_tiny
from configs.recipes import common

_PAPER = 'Devlin et al. 2019, appendix A.2'
_REPO = 'google-research/bert'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' : the published recipe; 'tiny': its phases on a 2-core CPU; 'smoke': tiny, cut."""
  return common.variant('bert', arg, _published, _tiny)


def _bert_recipe(config: ml_collections.ConfigDict) -> None:
  """What both variants take from BERT: the objective, the masking, the optimizer and the
  learning rate's shape (continued over the two phases)."""
  # Next sentence prediction beside MLM, its loss added with weight 1 (_PAPER, section 3.1).
  config.sentence_pair.task = 'nsp'
  config.sentence_pair.loss_weight = 1.0
  # 15% of the tokens: 80% [MASK], 10% a random token, 10% kept (_PAPER, section 3.1); the
  # random token drawn uniformly from the vocabulary (_REPO create_pretraining_data.py).
  config.masking.select_rate = 0.15
  config.masking.mask_prob = 0.8
  config.masking.random_prob = 0.1
  config.masking.random_source = 'uniform'
  config.masking.mode = 'token'
  # Adam with L2 weight decay 0.01 (decoupled: _REPO optimization.py AdamWeightDecayOptimizer),
  # beta1 0.9, beta2 0.999 (_PAPER), epsilon 1e-6 and clipping at global norm 1.0
  # (_REPO optimization.py).
  config.train.optimizer = 'adamw'
  config.train.weight_decay = 0.01
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.999
  config.train.adam_eps = 1e-6
  config.train.grad_clip_norm = 1.0
  # Linear warm-up, then a linear decay to 0 at the last step of both phases (_REPO
  # optimization.py: polynomial_decay to 0 over num_train_steps, power 1). The first phase
  # decays linearly from the peak (after its warm-up) to 0.1 x the peak, where BERT's single
  # schedule is at 90% of its steps; the second goes on from there to 0.
  config.train.schedule = 'wsd'
  config.train.decay_fraction = 1.0
  config.train.decay_shape = 'linear'
  config.train.final_lr_ratio = 0.1


def _long_phase(learning_rate: float, seq_len: int, max_predictions: int) -> dict:
  """The second phase: longer rows, the learning rate going on linearly from 0.1 x the peak
  to 0."""
  return dict(
      data=dict(seq_len=seq_len),
      masking=dict(max_predictions=max_predictions),
      train=dict(schedule='decay', decay_shape='linear', final_lr_ratio=0.0,
                 learning_rate=0.1 * learning_rate, warmup_steps=0))


def _published() -> ml_collections.ConfigDict:
  # BERT-base: L=12, d=768, 12 heads, d_ff=3,072, 512 positions, 2 segments, GELU, LayerNorm
  # eps 1e-12 (_PAPER section 3; _REPO bert_config.json of uncased_L-12_H-768_A-12).
  config = base.get_config()
  config.model.variant = 'bert'
  # "a dropout probability of 0.1 on all layers" (_PAPER); attention_probs_dropout_prob 0.1
  # (_REPO bert_config.json). This rules out the fused attention kernels (dense attention).
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.1
  # Your corpus (BooksCorpus + English Wikipedia in the paper): --config.data.corpus=...
  config.data.corpus = ''
  # WordPiece, uncased, 30,522 pieces (_REPO uncased_L-12_H-768_A-12 vocab.txt; the paper:
  # "a 30,000 token vocabulary").
  config.tokenizer.kind = 'wordpiece'
  config.tokenizer.vocab_size = 30_522
  config.tokenizer.lowercase = True
  _bert_recipe(config)
  # "a batch size of 256 sequences" (_PAPER).
  config.train.batch_size = 256
  # "Adam with learning rate of 1e-4 ... learning rate warmup over the first 10,000 steps"
  # (_PAPER).
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 10_000
  # "sequence length of 128 for 90% of the steps ... the rest 10% of the steps of sequence of
  # 512" (_PAPER), of 1,000,000 steps; max_predictions_per_seq 20 at 128 and 80 at 512
  # (_REPO README.md).
  config.data.seq_len = 128
  config.masking.max_predictions = 20
  config.phases = (
      dict(name='short', steps=900_000, overrides=dict(data=dict(seq_len=128))),
      dict(name='long', steps=100_000, overrides=_long_phase(1e-4, 512, 80)),
  )
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/bert_tiny.py: its model (L=4, d=128, 4 heads, d_ff=512, 128 positions, no dropout:
  # a run this short does not overfit), tokenizer (1,000 pieces on the built-in corpus), batch
  # of 16, peak rate 2e-3 and 100 warm-up steps.
  config = bert_tiny.get_config()
  _bert_recipe(config)
  # The position table holds 128: 64 then 128 tokens (BERT: 128 then 512), P = 5T/32 as
  # BERT's 20 and 80.
  config.data.seq_len = 64
  config.masking.max_predictions = 10
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.checkpoint_every = 500
  config.phases = (
      dict(name='short', steps=5_400, overrides=dict(data=dict(seq_len=64))),
      dict(name='long', steps=600, overrides=_long_phase(config.train.learning_rate, 128, 20)),
  )
  return config
