"""ModernBERT-base's pretraining (Warner et al., 2024) as one run in three phases.

Published (`--config=configs/recipes/modernbert.py`), from the three yamls of
AnswerDotAI/ModernBERT yamls/modernbert/ (branch pretraining_documentation):

  phase     tokens   T      masking  learning rate                 batch (rows)
  pretrain  1.719T   1,024  30%      3B-token warm-up, 8e-4 held   768 -> 4,608 over 50B tokens
  context   250B     8,192  30%      3e-4 held                     576
  decay     50B      8,192  30%      1-sqrt from 3e-4 to 0.001 x   576

StableAdamW (betas 0.9, 0.98, eps 1e-6) throughout, its moments carried over
both boundaries; the global layers' rotary base goes from 10,000 to 160,000
at the context phase. Packed documents are kept apart (attention within a
document, positions from 0 in each) and the attention output drops 10%, as
FlexBERT trains (common.flexbert). Point config.data.corpus at your corpus
(ModernBERT's 2T-token mixture is not public). The phases are the yamls'
three runs; the yamls chain them with load_path + reset_time +
restart_override, which keeps the optimizer's moments and restarts the
schedule: here, one run in phases.

Large (`:large`), from the modernbert-large-*.yaml of the same branch and
the paper (Warner et al., 2024, arXiv 2412.13663): L=28,
d=1,024, 16 heads, GeGLU 2,624.

  phase     tokens   T      masking  learning rate                 batch (rows)
  pretrain  900B     1,024  30%      2B-token warm-up, 5e-4 held   448 -> 4,928 over 10B tokens
  restart   819B     1,024  30%      5e-5 held                     4,928
  context   250B     8,192  30%      5e-5 held                     616
  decay     50B      8,192  30%      1-sqrt from 5e-5 to 0.001 x   624

ModernBERT-large started from ModernBERT-base's pretraining checkpoint,
widened (init_from_checkpoint, mode tile_weights_from_middle): `:large` alone
starts from a random initialisation; `python -m mlm_jax.widen` widens a base
run's checkpoint as the source did, and --config.init.workdir starts `:large`
from it (docs/recipes.md gives the command sequence).

Tiny (`:tiny`): the same three phases on the built-in corpus with
configs/tiny.py's model, 128 -> 256 tokens, 30% -> 15% masking in the decay
phase, the batch warmed up from 8 to 16 rows: 4.0M tokens
(pretrain 2.0M at T=128, context 1.2M and decay 0.8M at T=256).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs.recipes import common

# The three yamls of the recipe (AnswerDotAI/ModernBERT, branch pretraining_documentation).
_PRETRAIN = 'yamls/modernbert/modernbert-base-pretrain.yaml'
_CONTEXT = 'yamls/modernbert/modernbert-base-context-extension.yaml'
_DECAY = 'yamls/modernbert/modernbert-base-learning-rate-decay.yaml'
# ModernBERT-large's three yamls (the same branch), and the paper for its learning rate.
_LARGE_PRETRAIN = 'yamls/modernbert/modernbert-large-pretrain.yaml'
_LARGE_CONTEXT = 'yamls/modernbert/modernbert-large-context-extension.yaml'
_LARGE_DECAY = 'yamls/modernbert/modernbert-large-learning-rate-decay.yaml'
_PAPER = 'Warner et al. 2024, arXiv 2412.13663 (its training settings)'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '': the published base recipe; 'large': ModernBERT-large's; 'tiny': the base phases on
  a 2-core CPU; 'smoke': tiny, cut."""
  if arg == 'large':
    return _large()
  if arg in ('', 'tiny', 'smoke'):
    return common.variant('modernbert', arg, _published, _tiny)
  raise ValueError(f"configs/recipes/modernbert.py takes '', 'large', 'tiny' or 'smoke', not "
                   f'{arg!r}: e.g. --config=configs/recipes/modernbert.py:large')


def _published() -> ml_collections.ConfigDict:
  # ModernBERT-base's shape (vocab 50,368): model_config of _PRETRAIN, under FlexBERT's trainer
  # (common.flexbert: 80/10/10 masking with uniform random ids, no dropout, StableAdamW with
  # fully decoupled weight decay, no gradient clipping).
  config = common.flexbert(
      # seed: 17 (_PRETRAIN).
      seed=17,
      # max_seq_len: 1024 (_PRETRAIN).
      seq_len=1024,
      # mlm_probability: 0.3 (_PRETRAIN; "FlexBERT should use 30% masking"); P for 30% of a
      # 1,024-token row: round(0.3 x 1,022) = 307, up to a multiple of 64 (common.flexbert).
      select_rate=0.3,
      # rotary_emb_base: 10000.0 for every layer in pretraining (_PRETRAIN; no local base given).
      rope_theta=10_000.0,
      # optimizer: decoupled_stableadamw, lr: 8e-4, betas [0.9, 0.98], eps 1.0e-06 (_PRETRAIN;
      # main.py builds optimi's StableAdamW).
      learning_rate=8e-4, betas=(0.9, 0.98), eps=1e-6,
      # weight_decay: 1.0e-5, fully decoupled (_PRETRAIN; main.py: decouple_lr=True).
      decoupled_weight_decay=1e-5,
      # global_train_batch_size: 4608 (_PRETRAIN). device_train_microbatch_size: 96 per GPU
      # there; here micro-batches of 48 rows (96 of them), 12 per chip on a v5p-8: 29.17 GiB of
      # an H100's 59.74 in the pre-flight (docs/recipes.md).
      batch_size=4608, micro_batches=96,
      # batch_size_warmup_min_size: 96 (${device_train_microbatch_size}) per GPU and
      # batch_size_warmup_tokens: 50_000_000_000tok (_PRETRAIN): 96 rows x 8 GPUs = 768 rows at
      # the start (16 of our micro-batches). As ModernBERT's packer (src/sequence_packer.py
      # BatchSizeWarmupScheduler) grows each GPU's batch a micro-batch of 96 at a time, ours
      # grows 768 rows at a time, each size for as many steps (docs/recipes.md: the steps).
      batch_warmup_start=common.per_gpu_start(96), batch_warmup_tokens=50_000_000_000,
      # global_eval_batch_size: 1024 is 8 GPUs x device_eval_batch_size 128 (_PRETRAIN); our
      # evaluation has no micro-batches, so 128 rows per evaluation step (any device count
      # divides it). The yamls evaluate at 15% masking, ours at the phase's select_rate.
      # eval_interval: 4000ba, save_interval: 4000ba, console_log_interval: 100ba (_PRETRAIN);
      # save_num_checkpoints_to_keep: -1 keeps all of them; we keep the last 3 (the default).
      eval_batch_size=128, eval_every=4000, checkpoint_every=4000, log_every=100)
  # Your corpus (text files, parquet, a datasets dir): ModernBERT's 2T-token mixture of web,
  # code and scientific text is not published as files; set --config.data.corpus=...
  config.data.corpus = ''
  # tokenizer_name: answerdotai/ModernBERT-base (_PRETRAIN), a byte-level BPE (OLMo's, 50,280
  # tokens padded to 50,368). To use it, set config.tokenizer.model_file to its tokenizer.json;
  # left empty, a byte-level BPE of the same size is trained on your corpus.
  config.tokenizer.kind = 'bpe'
  # scheduler warmup_stable_decay with t_decay: 0tok and alpha_f 0.0 (_PRETRAIN): a warm-up,
  # then the peak to the end of the phase ('constant'); t_warmup: 3_000_000_000tok, set below
  # as the steps that reach 3B tokens under the batch warm-up.
  config.phases = (
      # max_duration: 1_719_000_000_000tok (_PRETRAIN).
      dict(name='pretrain', tokens=1_719_000_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # max_duration: 250_000_000_000tok (_CONTEXT). The optimizer's moments carry over (load_path
      # with restart_override: the hyperparameters and schedule restart, the state does not).
      dict(name='context', tokens=250_000_000_000, overrides=dict(
          # max_seq_len: 8192 (_CONTEXT).
          data=dict(seq_len=8192),
          # rotary_emb_base: 160000.0 (global layers), local_attn_rotary_emb_base: 10000.0.
          model=dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                     local_rope_theta=10_000.0),
          # mlm_probability: 0.3 (_CONTEXT); P for 30% of 8,192 tokens.
          masking=dict(max_predictions=common.max_predictions(0.3, 8192, 8)),
          # global_train_batch_size: 576, lr: 3e-4, scheduler constant_with_warmup with
          # t_warmup: 0tok (_CONTEXT); the decoupled weight decay 1e-5 against the new peak 3e-4
          # (restart_override resets it). device_train_microbatch_size: 12 per GPU there; here
          # micro-batches of 8 rows (72 of them), as many tokens as 64 rows of 1,024 (2 rows
          # per chip on a v5p-8).
          train=dict(batch_size=576, grad_accum_steps=72, learning_rate=3e-4, warmup_steps=0,
                     schedule='constant', weight_decay=1e-5 / 3e-4),
          # 1,024 x 1,024 evaluation tokens per step at 8,192: 16 rows.
          eval=dict(batch_size=16))),
      # max_duration: 50_000_000_000tok (_DECAY): scheduler one_minus_sqrt over t_decay:
      # ${max_duration} to alpha_f: 0.001 of lr: 3e-4; eval and save intervals 1000ba.
      dict(name='decay', tokens=50_000_000_000, overrides=dict(
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.001,
                     eval_every=1000, checkpoint_every=1000))),
  )
  config.train.warmup_steps = common.warmup_to(config, 3_000_000_000)
  return config


def _large() -> ml_collections.ConfigDict:
  # model_config of _LARGE_PRETRAIN: num_hidden_layers 28, hidden_size 1024, num_attention_heads
  # 16, intermediate_size 2624 (the rest as ModernBERT-base's: vocab 50,368, a window of 128,
  # a global layer every 3, LayerNorm eps 1e-5), under FlexBERT's trainer (common.flexbert).
  config = common.flexbert(
      shape=dict(num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
      # seed: 314 (_LARGE_PRETRAIN).
      seed=314,
      # max_seq_len: 1024, mlm_probability: 0.3 (_LARGE_PRETRAIN).
      seq_len=1024, select_rate=0.3,
      # rotary_emb_base: 10000.0, no local base: every layer (_LARGE_PRETRAIN).
      rope_theta=10_000.0,
      # decoupled_stableadamw, lr: 5e-4 ("too high and required a restart"), betas [0.9, 0.98],
      # eps 1.0e-06, weight_decay: 1.0e-5 (_LARGE_PRETRAIN).
      learning_rate=5e-4, betas=(0.9, 0.98), eps=1e-6, decoupled_weight_decay=1e-5,
      # global_train_batch_size: 4928 (_LARGE_PRETRAIN). device_train_microbatch_size: 56 per
      # GPU there; here micro-batches of 28 rows (176 of them), 7 per chip on a v5p-8: 37.70 GiB
      # of an H100's 59.74 in the pre-flight (docs/recipes.md).
      batch_size=4928, micro_batches=176,
      # batch_size_warmup_min_size: ${device_train_microbatch_size} = 56 per GPU,
      # batch_size_warmup_tokens: 10_000_000_000tok (_LARGE_PRETRAIN): 56 x 8 GPUs = 448 rows
      # at the start (16 micro-batches of 28), up to 4,928 (11 of the yaml's per-GPU steps).
      batch_warmup_start=common.per_gpu_start(56), batch_warmup_tokens=10_000_000_000,
      # global_eval_batch_size: 896 is 8 GPUs x device_eval_batch_size 112 (_LARGE_PRETRAIN):
      # 112 rows per evaluation step. eval_interval: 4000ba, save_interval: 4000ba,
      # console_log_interval: 100ba (_LARGE_PRETRAIN).
      eval_batch_size=112, eval_every=4000, checkpoint_every=4000, log_every=100)
  config.data.corpus = ''
  # tokenizer_name: answerdotai/ModernBERT-large (_LARGE_PRETRAIN): the same byte-level BPE of
  # 50,368 pieces as base's.
  config.tokenizer.kind = 'bpe'
  # The later phases: max_seq_len 8192, rotary_emb_base 160000.0 for the global layers and
  # local_attn_rotary_emb_base 10000.0 (_LARGE_CONTEXT, _LARGE_DECAY); lr 5e-5 and
  # weight_decay 1.0e-6 ("after the pretraining LR reduction"), the same decoupled decay
  # per step against the peak as 1e-5 against 5e-4.
  long_model = dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                    local_rope_theta=10_000.0)
  low = dict(learning_rate=5e-5, weight_decay=1e-6 / 5e-5, warmup_steps=0)
  config.phases = (
      # "After a 2 billion token warmup, we trained ModernBERT-large at a LR of 5e-4 for 900
      # billion tokens" (_PAPER); warmup_stable_decay, t_warmup: 2_000_000_000tok, t_decay:
      # 0tok (_LARGE_PRETRAIN): the peak held ('constant').
      dict(name='pretrain', tokens=900_000_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # "We rolled back and restarted training at 5e-5 for the remaining 800 billion tokens"
      # (_PAPER): the rest of max_duration: 1_719_000_000_000tok (_LARGE_PRETRAIN), 819B, with
      # no warm-up given. Where the roll-back went to is not published: the moments carry on.
      dict(name='restart', tokens=819_000_000_000,
           overrides=dict(train=dict(schedule='constant', **low))),
      # max_duration: 250_000_000_000tok, constant_with_warmup with t_warmup: 0tok,
      # global_train_batch_size: 616, console_log_interval: 500ba (_LARGE_CONTEXT).
      # device_train_microbatch_size: 7 per GPU there; here micro-batches of 4 rows (154 of
      # them), one per chip on a v5p-8.
      dict(name='context', tokens=250_000_000_000, overrides=dict(
          data=dict(seq_len=8192), model=long_model,
          # mlm_probability: 0.3 (_LARGE_CONTEXT); P for 30% of 8,192 tokens.
          masking=dict(max_predictions=common.max_predictions(0.3, 8192, 8)),
          train=dict(batch_size=616, grad_accum_steps=154, schedule='constant', log_every=500,
                     **low),
          # device_eval_microbatch_size: 14 (_LARGE_CONTEXT); 12 rows, which split over 4 chips.
          eval=dict(batch_size=12))),
      # max_duration: 50_000_000_000tok, one_minus_sqrt to alpha_f: 0.001 of 5e-5,
      # global_train_batch_size: 624, eval_interval and save_interval 1000ba (_LARGE_DECAY);
      # device_train_microbatch_size: 6 per GPU there, here micro-batches of 4 rows (156).
      dict(name='decay', tokens=50_000_000_000, overrides=dict(
          train=dict(batch_size=624, grad_accum_steps=156, schedule='decay',
                     decay_shape='1-sqrt', final_lr_ratio=0.001, eval_every=1000,
                     checkpoint_every=1000))),
  )
  # t_warmup: 2_000_000_000tok (_LARGE_PRETRAIN): the steps that reach 2B tokens under the
  # batch warm-up.
  config.train.warmup_steps = common.warmup_to(config, 2_000_000_000)
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/tiny.py's model trained as the published recipe (common.flexbert_tiny): 30% masking
  # at the first length, StableAdamW, no global-norm clipping, every layer at rotary base
  # 10,000 until the context phase, random replacements drawn uniformly; the batch warmed up
  # from 8 rows to 16 over the first 0.3M tokens (ModernBERT: 768 -> 4,608 over 50B tokens).
  config = common.flexbert_tiny()
  config.phases = (
      dict(name='pretrain', tokens=2_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # Rows twice as long; the global layers' rotary base 160,000 and the peak rate falling
      # by 3/8 (ModernBERT's 8e-4 -> 3e-4; here 2e-3 -> 7.5e-4). ModernBERT also cuts the rows
      # per step (4,608 -> 576, the same tokens per step); here the batch stays 16 rows, twice
      # the tokens per step.
      dict(name='context', tokens=1_200_000, overrides=dict(
          data=dict(seq_len=256),
          model=dict(max_position_embeddings=256, global_rope_theta=160_000.0),
          masking=dict(max_predictions=common.max_predictions(0.3, 256)),
          train=dict(learning_rate=7.5e-4, warmup_steps=0, schedule='constant'),
          eval=dict(batch_size=32))),
      # ModernBERT keeps 30% here; the tiny recipe drops to 15% (as Ettin's and mmBERT's last
      # phases do) so that a short run exercises a change of masking rate too.
      dict(name='decay', tokens=800_000, overrides=dict(
          masking=dict(select_rate=0.15),
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.001))),
  )
  return config
