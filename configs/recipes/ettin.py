"""Ettin-encoder-150m's pretraining (Weller et al., 2025) as one run in three phases.

Published (`--config=configs/recipes/ettin.py`), from the encoder yamls of
JHU-CLSP/ettin-encoder-vs-decoder pretraining/configs/standard/base/ (the
recipe of ModernBERT, with open data, for an encoder of ModernBERT-base's shape):

  phase     tokens  T      masking  learning rate                      batch (rows)
  pretrain  1.7T    1,024  30%      3B-token warm-up, 8e-4 held        72 -> 4,608 over 50B tokens
  context   250B    7,999  30%      1-sqrt from 8e-4 to 0.5 x          4,608
  decay     50B     7,999  15%      1-sqrt from 4e-4 to 0.04 x         4,608

StableAdamW (betas 0.9, 0.98, eps 1e-6) throughout, its moments carried over
both boundaries; every layer's rotary base goes from 10,000 to 160,000 at the
context phase. Each phase reads its own data in the original (the pretraining
mixture, a 250B-token sample of it, ProLong's long documents): point
config.data.corpus (and each phase's data.corpus override) at yours.

Tiny (`:tiny`): the same three phases on the built-in corpus with
configs/tiny.py's model, 128 -> 256 tokens, 30% -> 15% masking, the batch
warmed up from 8 to 16 rows: 4.0M tokens (pretrain 2.0M at T=128, context
1.2M and decay 0.8M at T=256).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs import modern_base
from configs import tiny
from configs.recipes import common
from mlm_jax import phases

# The three encoder yamls (JHU-CLSP/ettin-encoder-vs-decoder, pretraining/configs/standard/base/;
# the README there: "de_decay is the context extension", "prolong_decay is the final decay").
_PRETRAIN = 'pretraining/configs/standard/base/encoder_base.yaml'
_CONTEXT = 'pretraining/configs/standard/base/de_decay/encoder_base.yaml'
_DECAY = 'pretraining/configs/standard/base/prolong_decay/encoder_base.yaml'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' : the published recipe; 'tiny': its phases on a 2-core CPU; 'smoke': tiny, cut."""
  if arg == '':
    return _published()
  if arg == 'tiny':
    return _tiny()
  if arg == 'smoke':
    return common.smoke(_tiny())
  raise ValueError(f"configs/recipes/ettin.py takes '', 'tiny' or 'smoke', not {arg!r}: "
                   'e.g. --config=configs/recipes/ettin.py:tiny')


def _published() -> ml_collections.ConfigDict:
  # ModernBERT-base's shape (L=22, d=768, 12 heads, GeGLU 1152, local window 128, a global
  # layer every 3, LayerNorm eps 1e-5, vocab 50,368): model_config of _PRETRAIN.
  config = modern_base.get_config()
  # seed: 21 (_PRETRAIN).
  config.seed = 21
  # Your corpus: Ettin's 1.7T-token open mixture (DCLM, Dolma, code, papers, books) is on the
  # Hugging Face hub as MosaicML streaming shards, which mlm_jax does not read; set
  # --config.data.corpus=... to text, jsonl or parquet files.
  config.data.corpus = ''
  # max_seq_len: 1024 (_PRETRAIN).
  config.data.seq_len = 1024
  # tokenizer_name: bclavie/olmo_bert_template (_PRETRAIN): ModernBERT's byte-level BPE. Set
  # config.tokenizer.model_file to its tokenizer.json to use it; left empty, a byte-level BPE
  # of 50,368 pieces is trained on your corpus.
  config.tokenizer.kind = 'bpe'
  # mlm_probability: 0.3 (_PRETRAIN).
  config.masking.select_rate = 0.3
  # P for 30% of a 1,024-token row: round(0.3 x 1,022) = 307, up to a multiple of 8 (common.py).
  config.masking.max_predictions = common.max_predictions(0.3, 1024, 8)
  # sequence_packing: false, so the bert24 text loader masks (transformers'
  # DataCollatorForLanguageModeling): 80% [MASK], 10% a random id drawn uniformly, 10% kept.
  config.masking.mask_prob = 0.8
  config.masking.random_prob = 0.1
  config.masking.random_source = 'uniform'
  # embed_dropout_prob 0.0, mlp_dropout_prob 0.0, attention_probs_dropout_prob 0.0 (_PRETRAIN);
  # its attn_out_dropout_prob 0.1 (on the attention output only) has no field here: 0, as the
  # published jhu-clsp/ettin-encoder-150m config.json (attention_dropout 0.0).
  config.model.dropout_rate = 0.0
  config.model.attention_dropout_rate = 0.0
  # rotary_emb_base: 10000.0 for every layer (_PRETRAIN; local_attn_rotary_emb_base unset: -1,
  # the same base for the local layers, ModernBERT's src/bert_layers/configuration_bert.py).
  config.model.global_rope_theta = 10_000.0
  config.model.local_rope_theta = 10_000.0
  # Rows of max_seq_len in this phase (rotary positions: no table; the context phase raises it).
  config.model.max_position_embeddings = 1024
  # optimizer: decoupled_stableadamw, lr: 8e-4, betas [0.9, 0.98], eps 1.0e-06 (_PRETRAIN).
  config.train.optimizer = 'stable_adamw'
  config.train.learning_rate = 8e-4
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.98
  config.train.adam_eps = 1e-6
  # weight_decay: 1.0e-5 (_PRETRAIN), fully decoupled (decouple_lr=True: the weights shrink by
  # 1e-5 x lr/peak per step); ours is scaled by the learning rate, so 1e-5 / 8e-4.
  # filter_bias_norm_wd: true: biases and norms are not decayed (ours neither).
  config.train.weight_decay = 1e-5 / 8e-4
  # No gradient clipping in the yamls: StableAdamW's per-tensor update clipping instead.
  config.train.grad_clip_norm = 0.0
  # global_train_batch_size: 4608, device_train_microbatch_size: 72 (_PRETRAIN): 64
  # micro-batches of 72 rows.
  config.train.batch_size = 4608
  config.train.grad_accum_steps = 64
  # batch_size_warmup_min_size: ${device_train_microbatch_size} = 72, batch_size_warmup_tokens:
  # 50_000_000_000tok (_PRETRAIN). Ours grows the batch linearly in tokens, a micro-batch at
  # a time; bert24's scheduler spends steps in proportion to each batch size.
  config.train.batch_warmup_start = 72
  config.train.batch_warmup_tokens = 50_000_000_000
  # device_eval_batch_size: 48 (_PRETRAIN): rows per evaluation step (global here; the yamls'
  # global_eval_batch_size 1024 is many devices' worth). The yamls evaluate at 15% masking,
  # ours at the phase's select_rate; eval_interval is "don't do this" (off): every 4,000 steps
  # here, as ModernBERT's.
  config.eval.batch_size = 48
  config.train.eval_every = 4000
  # console_log_interval: 100ba (_PRETRAIN); save_interval: 8_500_000_000tok, about 1,800
  # steps of 4,608 x 1,024 tokens.
  config.train.log_every = 100
  config.train.checkpoint_every = 1800
  # scheduler warmup_stable_decay, t_warmup: 3_000_000_000tok, t_decay: 0tok (_PRETRAIN): a
  # warm-up, then the peak to the phase's end ('constant'). The warm-up's steps are set below.
  config.train.warmup_steps = 0
  # The later phases: max_seq_len 7999 (_CONTEXT, _DECAY), rotary_emb_base 160000.0 and no
  # local base (every layer at 160,000).
  long_rows = dict(seq_len=7999)
  long_model = dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                    local_rope_theta=160_000.0)
  config.phases = (
      # max_duration: 1_700_000_000_000tok (_PRETRAIN).
      dict(name='pretrain', tokens=1_700_000_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # max_duration: 250_000_000_000tok (_CONTEXT), load_path + reset_time: the optimizer's
      # state carries over, the schedule restarts: one_minus_sqrt over the whole phase with
      # alpha_f: 0.5, lr 8e-4 (_CONTEXT).
      dict(name='context', tokens=250_000_000_000, overrides=dict(
          data=long_rows, model=long_model,
          # mlm_probability: 0.3 (_CONTEXT); P for 30% of 7,999 tokens.
          masking=dict(max_predictions=common.max_predictions(0.3, 7999, 8)),
          # global_train_batch_size: 4608 (_CONTEXT). device_train_microbatch_size is 16 there;
          # here micro-batches of 12 rows (384 of them), which split over 4 chips.
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.5,
                     warmup_steps=0, grad_accum_steps=384),
          # device_eval_batch_size: 16 (_CONTEXT).
          eval=dict(batch_size=16))),
      # max_duration: 50_000_000_000tok (_DECAY), with restart_override: lr 4e-4 (half the first
      # peak, where the context phase ended), one_minus_sqrt with alpha_f: 0.04 (to 1.6e-5,
      # "0.02 of the LR" of the pretraining, pretraining/README.md), the decoupled weight decay
      # 1e-5 against the new peak.
      dict(name='decay', tokens=50_000_000_000, overrides=dict(
          # mlm_probability: 0.15 (_DECAY); P for 15% of 7,999 tokens.
          masking=dict(select_rate=0.15, max_predictions=common.max_predictions(0.15, 7999, 8)),
          train=dict(learning_rate=4e-4, final_lr_ratio=0.04, weight_decay=1e-5 / 4e-4),
          # device_eval_batch_size: 12 (_DECAY).
          eval=dict(batch_size=12))),
  )
  # t_warmup: 3_000_000_000tok (_PRETRAIN): the steps that reach 3B tokens under the batch
  # warm-up.
  config.train.warmup_steps = phases.Plan(config).steps_for_tokens(0, 3_000_000_000)
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/tiny.py: its model (L=4, d=128, GeGLU 344, 4 heads), tokenizer (1,000 pieces,
  # trained on the built-in corpus), peak rate 2e-3, 100 warm-up steps, Adam beta2 0.98.
  config = tiny.get_config()
  # As the published recipe: 30% masking, StableAdamW, no global-norm clipping, rotary base
  # 10,000 everywhere until the context phase, random replacements drawn uniformly.
  config.masking.select_rate = 0.3
  config.masking.max_predictions = common.max_predictions(0.3, 128)
  config.masking.random_source = 'uniform'
  config.model.global_rope_theta = 10_000.0
  config.model.local_rope_theta = 10_000.0
  config.train.optimizer = 'stable_adamw'
  config.train.grad_clip_norm = 0.0
  # The batch warms up from 8 rows to 16 (tiny.py's) over the first 0.3M tokens, a micro-batch
  # of 8 at a time (Ettin: 72 -> 4,608 over 50B tokens).
  config.train.batch_size = 16
  config.train.grad_accum_steps = 2
  config.train.batch_warmup_start = 8
  config.train.batch_warmup_tokens = 300_000
  config.train.log_every = 50
  config.train.eval_every = 250
  config.train.checkpoint_every = 250
  long_model = dict(max_position_embeddings=256, global_rope_theta=160_000.0,
                    local_rope_theta=160_000.0)
  config.phases = (
      dict(name='pretrain', tokens=2_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # Rows twice as long (Ettin: 1,024 -> 7,999), every rotary base 160,000, a 1-sqrt decay to
      # half the peak.
      dict(name='context', tokens=1_200_000, overrides=dict(
          data=dict(seq_len=256), model=long_model,
          masking=dict(max_predictions=common.max_predictions(0.3, 256)),
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.5,
                     warmup_steps=0),
          eval=dict(batch_size=32))),
      # 15% masking; from half the peak (1e-3) down to 0.04 of it, as Ettin's 4e-4 -> 1.6e-5.
      dict(name='decay', tokens=800_000, overrides=dict(
          masking=dict(select_rate=0.15),
          train=dict(learning_rate=1e-3, final_lr_ratio=0.04))),
  )
  return config
