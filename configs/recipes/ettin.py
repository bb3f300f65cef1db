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

from configs.recipes import common

# The three encoder yamls (JHU-CLSP/ettin-encoder-vs-decoder, pretraining/configs/standard/base/;
# the README there: "de_decay is the context extension", "prolong_decay is the final decay").
_PRETRAIN = 'pretraining/configs/standard/base/encoder_base.yaml'
_CONTEXT = 'pretraining/configs/standard/base/de_decay/encoder_base.yaml'
_DECAY = 'pretraining/configs/standard/base/prolong_decay/encoder_base.yaml'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' : the published recipe; 'tiny': its phases on a 2-core CPU; 'smoke': tiny, cut."""
  return common.variant('ettin', arg, _published, _tiny)


def _published() -> ml_collections.ConfigDict:
  # ModernBERT-base's shape (vocab 50,368): model_config of _PRETRAIN, under FlexBERT's trainer
  # (common.flexbert). sequence_packing: false, so the bert24 text loader masks (transformers'
  # DataCollatorForLanguageModeling): 80% [MASK], 10% a random id drawn uniformly, 10% kept.
  config = common.flexbert(
      # seed: 21 (_PRETRAIN).
      seed=21,
      # max_seq_len: 1024 (_PRETRAIN).
      seq_len=1024,
      # mlm_probability: 0.3 (_PRETRAIN).
      select_rate=0.3,
      # rotary_emb_base: 10000.0 for every layer (_PRETRAIN; local_attn_rotary_emb_base unset:
      # -1, the same base for the local layers, ModernBERT's src/bert_layers/configuration_bert.py).
      rope_theta=10_000.0,
      # optimizer: decoupled_stableadamw, lr: 8e-4, betas [0.9, 0.98], eps 1.0e-06 (_PRETRAIN).
      learning_rate=8e-4, betas=(0.9, 0.98), eps=1e-6,
      # weight_decay: 1.0e-5 (_PRETRAIN), fully decoupled (decouple_lr=True).
      decoupled_weight_decay=1e-5,
      # global_train_batch_size: 4608, device_train_microbatch_size: 72 (_PRETRAIN): 64
      # micro-batches of 72 rows.
      batch_size=4608, micro_batches=64,
      # batch_size_warmup_min_size: ${device_train_microbatch_size} = 72, batch_size_warmup_tokens:
      # 50_000_000_000tok (_PRETRAIN). Ours grows the batch linearly in tokens, a micro-batch at
      # a time; bert24's scheduler spends steps in proportion to each batch size.
      batch_warmup_start=72, batch_warmup_tokens=50_000_000_000,
      # device_eval_batch_size: 48 (_PRETRAIN): rows per evaluation step (global here; the yamls'
      # global_eval_batch_size 1024 is many devices' worth). The yamls evaluate at 15% masking,
      # ours at the phase's select_rate; eval_interval is "don't do this" (off): every 4,000
      # steps here, as ModernBERT's.
      eval_batch_size=48, eval_every=4000,
      # console_log_interval: 100ba (_PRETRAIN); save_interval: 8_500_000_000tok, about 1,800
      # steps of 4,608 x 1,024 tokens.
      log_every=100, checkpoint_every=1800)
  # Your corpus: Ettin's 1.7T-token open mixture (DCLM, Dolma, code, papers, books) is on the
  # Hugging Face hub as MosaicML streaming shards, which mlm_jax does not read; set
  # --config.data.corpus=... to text, jsonl or parquet files.
  config.data.corpus = ''
  # tokenizer_name: bclavie/olmo_bert_template (_PRETRAIN): ModernBERT's byte-level BPE. Set
  # config.tokenizer.model_file to its tokenizer.json to use it; left empty, a byte-level BPE
  # of 50,368 pieces is trained on your corpus.
  config.tokenizer.kind = 'bpe'
  # scheduler warmup_stable_decay, t_warmup: 3_000_000_000tok, t_decay: 0tok (_PRETRAIN): a
  # warm-up, then the peak to the phase's end ('constant'). The warm-up's steps are set below.
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
  config.train.warmup_steps = common.warmup_to(config, 3_000_000_000)
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/tiny.py's model trained as the published recipe (common.flexbert_tiny): 30%
  # masking, StableAdamW, no global-norm clipping, rotary base 10,000 everywhere until the
  # context phase, random replacements drawn uniformly; the batch warmed up from 8 rows to 16
  # over the first 0.3M tokens (Ettin: 72 -> 4,608 over 50B tokens).
  config = common.flexbert_tiny()
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
