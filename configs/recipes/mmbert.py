"""mmBERT-base's pretraining (Marone et al., 2025) as one run in three phases.

Published (`--config=configs/recipes/mmbert.py`, or `...mmbert.py:data=ROOT` for a data root
other than ./mmbert-data), from JHU-CLSP/mmBERT configs/mmBERT-base*.yaml and the paper
(arXiv 2509.06888, section 3):

  phase     tokens  T      masking  languages  learning rate            batch (rows)
  pretrain  2.3T    1,024  30%      61         3B-token warm-up, held   384 -> 4,608 *
  ext       600B    8,192  15%      110        8e-4 held                4,608
  decay     100B    8,192  5%       110        1-sqrt to 0.02 x         4,608
  (* over the first 60B tokens; the peak is 8e-4)

StableAdamW (betas 0.9, 0.95, eps 1e-8) throughout, its moments carried over
both boundaries; every layer's rotary base goes from 10,000 to 160,000 at the
ext phase. Packed documents are kept apart and the attention output drops 10%
(common.flexbert). The sources are one directory per language,
ROOT/PHASE/LANGUAGE (text, jsonl or parquet files), named as in
statistics/language_counts.csv, each drawn with the share of the tokens that
language has in mmBERT's data of that phase (mmbert_languages.COUNTS): the
csv counts the data mmBERT trained on, already sampled at its exponents 0.7,
0.5 and 0.3 (p ∝ n^0.7 over the raw sizes n), so drawing in proportion to
them is that sampling, whatever a directory holds, and no temperature is
applied again. The decay phase is the Decay-Eng variant (110 languages).
mmBERT merges its decay variants (Decay-Eng, Decay-Cont, Decay-All with 1,833
languages): docs/recipes.md says how with `python -m mlm_jax.average`.

Small (`:small`, or `:small,data=ROOT`), from configs/mmBERT-small*.yaml: L=22,
d=384, 6 heads, GeGLU 1,152; the batch warmed up from 384 rows over 100B
tokens, a 4B-token warm-up; 4e-4 from the ext phase on, and a linear decay to
0.04 x.

Tiny (`:tiny`): the same three phases on the built-in corpus (one source: no
mixture) with configs/tiny.py's model, 128 -> 256 tokens, 30% -> 15% -> 5%
masking, the batch warmed up from 8 to 16 rows: 4.0M tokens (pretrain 2.0M at
T=128, ext 1.2M and decay 0.8M at T=256).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs.recipes import common
from configs.recipes import mmbert_languages

# The yamls (JHU-CLSP/mmBERT) and the paper.
_PRETRAIN = 'configs/mmBERT-base.yaml'
_EXT = 'configs/mmBERT-base-ext.yaml'
_DECAY = 'configs/mmBERT-base-decay.yaml'
_SMALL = 'configs/mmBERT-small.yaml'
_SMALL_EXT = 'configs/mmBERT-small-ext.yaml'
_SMALL_DECAY = 'configs/mmBERT-small-decay.yaml'
_PAPER = 'Marone et al. 2025, arXiv 2509.06888, section 3'

# The languages (ISO 639-3, and 'code') with tokens in each phase: JHU-CLSP/mmBERT
# statistics/language_counts.csv, columns 'pretrain' (61) and 'ext' (110; the same set as
# 'decay-eng' and 'decay-mid'; 'decay-all' adds the rest of its 1,833).
PRETRAIN_LANGUAGES = tuple(mmbert_languages.COUNTS['pretrain'])
EXT_LANGUAGES = tuple(mmbert_languages.COUNTS['ext'])
# Where the published variants look for ROOT/PHASE/LANGUAGE unless given `data=ROOT`.
DEFAULT_ROOT = 'mmbert-data'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '', 'small', 'data=ROOT' or 'small,data=ROOT': a published recipe; 'tiny': its phases
  on a 2-core CPU; 'smoke': tiny, cut."""
  if arg == 'tiny':
    return _tiny()
  if arg == 'smoke':
    return common.smoke(_tiny())
  parts = arg.split(',') if arg else []
  roots = [p[len('data='):] for p in parts if p.startswith('data=')]
  sizes = [p for p in parts if not p.startswith('data=')]
  if sizes in ([], ['small']) and len(roots) <= 1 and all(roots):
    return _published(roots[0] if roots else DEFAULT_ROOT, small=bool(sizes))
  raise ValueError(f"configs/recipes/mmbert.py takes '', 'small', 'data=ROOT', "
                   f"'small,data=ROOT', 'tiny' or 'smoke', not {arg!r}: e.g. "
                   '--config=configs/recipes/mmbert.py:small,data=/mnt/mmbert')


def language_sources(root: str, phase: str, column: str) -> tuple[dict, ...]:
  """config.data.sources of one directory per language, ROOT/PHASE/LANGUAGE, each weighted by
  its tokens in the csv's `column`: the phase's share of that language in mmBERT's data."""
  return tuple({'name': language, 'corpus': f'{root}/{phase}/{language}', 'weight': tokens}
               for language, tokens in mmbert_languages.COUNTS[column].items())


def _published(root: str, small: bool) -> ml_collections.ConfigDict:
  # ModernBERT-base's shape: model_config of _PRETRAIN (num_hidden_layers 22, hidden_size 768,
  # intermediate_size 1152, num_attention_heads 12), or _SMALL's (22, 384, 1152, 6), under
  # FlexBERT's trainer (common.flexbert). sequence_packing: true (_PRETRAIN, _SMALL):
  # ModernBERT's packer masks 80% [MASK], 10% a random id drawn uniformly, 10% kept
  # (src/sequence_packer.py of AnswerDotAI/ModernBERT).
  config = common.flexbert(
      shape=dict(num_heads=6, hidden_size=384) if small else None,
      # seed: 21 (_PRETRAIN, _SMALL; _SMALL_EXT and _SMALL_DECAY say 12345, but a run has one
      # seed).
      seed=21,
      # max_seq_len: 1024 (_PRETRAIN).
      seq_len=1024,
      # 30% masking (_PAPER and _SMALL's mlm_probability: 0.3; _PRETRAIN has 0.25).
      select_rate=0.3,
      # rotary_emb_base: 10000, local_attn_rotary_emb_base: 10000 (_PRETRAIN, _SMALL).
      rope_theta=10_000.0,
      # optimizer: decoupled_stableadamw, lr: 0.0008, eps: 1.0e-08, betas: [0.9, 0.95]
      # (_PRETRAIN, _SMALL).
      learning_rate=8e-4, betas=(0.9, 0.95), eps=1e-8,
      # weight_decay: 8.0e-05, fully decoupled (_PRETRAIN, _SMALL).
      decoupled_weight_decay=8e-5,
      # global_train_batch_size: 4608, device_train_microbatch_size: 48 per GPU (_PRETRAIN,
      # _SMALL): 96 micro-batches of 48 rows.
      batch_size=4608, micro_batches=96,
      # batch_size_warmup_min_size: 48 per GPU, batch_size_warmup_tokens: 60000000000tok
      # (_PRETRAIN; _SMALL: 100000000000tok): 48 rows x 8 GPUs = 384 at the start (8
      # micro-batches), growing 384 rows at a time, each size for as many steps, as the
      # published packer grows each GPU's batch 48 rows at a time.
      batch_warmup_start=common.per_gpu_start(48),
      batch_warmup_tokens=100_000_000_000 if small else 60_000_000_000,
      # device_eval_batch_size: 36 (_PRETRAIN, _SMALL): rows per evaluation step (global
      # here). The yamls turn evaluation off (eval_interval: 100000000000ba and
      # 99999999999999999999999999999999ba): every 4,000 steps here, at the phase's rate.
      eval_batch_size=36, eval_every=4000,
      # console_log_interval: 25ba; save_interval: 10000000000tok, about 2,100 steps of
      # 4,608 x 1,024 tokens (_PRETRAIN, _SMALL).
      log_every=25, checkpoint_every=2100)
  # tokenizer_name: google/gemma-2-9b, vocab_size: 256000 (_PRETRAIN, _SMALL): Gemma 2's
  # sentencepiece BPE with byte fallback. Set config.tokenizer.model_file to its
  # tokenizer.json (or tokenizer.model) to use it; left empty, a sentencepiece BPE of 256,000
  # pieces is trained.
  config.tokenizer.kind = 'sentencepiece'
  config.tokenizer.model_type = 'bpe'
  config.tokenizer.vocab_size = 256_000
  # The pretraining mixture: 61 languages and code (_PAPER), each weighted by its tokens in
  # the csv's 'pretrain' column. No temperature: the counts are already mmBERT's draw.
  config.data.sources = language_sources(root, 'pretrain', 'pretrain')
  config.data.temperature = None
  # save_num_checkpoints_to_keep: 10 (_PRETRAIN).
  config.train.keep_checkpoints = 10
  # scheduler warmup_stable_decay, t_warmup: 3000000000tok (_SMALL: 4000000000tok), t_decay:
  # 0tok (_PRETRAIN): a warm-up, then the peak ('constant'); the warm-up's steps are set below.
  # The ext and decay phases: max_seq_len: 8192, rotary_emb_base and local_attn_rotary_emb_base
  # 160000.0 (_EXT, _DECAY); device_train_microbatch_size: 6 (_SMALL_EXT: 8) there, here
  # micro-batches of 8 rows (576 of them): 4,608 / 6 does not split over 4 chips.
  long_model = dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                    local_rope_theta=160_000.0)
  # lr: 0.0004 and weight_decay: 4.0e-05 (_SMALL_EXT, _SMALL_DECAY: half the first peak, with
  # the same decoupled decay against it); base keeps 8e-4 (_EXT, _DECAY).
  rate = dict(learning_rate=4e-4, weight_decay=4e-5 / 4e-4) if small else {}
  # Base: one_minus_sqrt over t_decay: 100000000000tok to alpha_f: 0.02 (_DECAY). Small:
  # warmup_stable_decay with t_decay: 100000000000tok to alpha_f: 0.04 (_SMALL_DECAY), whose
  # decay is linear (src/scheduler.py: 1 - fraction x (1 - alpha_f)).
  decay = (dict(decay_shape='linear', final_lr_ratio=0.04) if small
           else dict(decay_shape='1-sqrt', final_lr_ratio=0.02))
  config.phases = (
      # 2.3T tokens (_PAPER; _PRETRAIN's max_duration: 400000000000tok is one stretch of it;
      # _SMALL_EXT's max_duration: 2900000000000tok counts from the start: 2.3T + 600B).
      dict(name='pretrain', tokens=2_300_000_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # max_duration: 600000000000tok (_EXT), reset_time_once: the schedule restarts, the
      # optimizer's state carries over: warmup_stable_decay with t_warmup 0tok and t_decay
      # 0tok, the peak throughout. 110 languages (_PAPER), weighted by the csv's 'ext'.
      dict(name='ext', tokens=600_000_000_000, overrides=dict(
          data=dict(seq_len=8192, sources=language_sources(root, 'ext', 'ext')),
          model=long_model,
          # mlm_probability: 0.15 (_EXT); P for 15% of 8,192 tokens.
          masking=dict(select_rate=0.15, max_predictions=common.max_predictions(0.15, 8192, 8)),
          train=dict(schedule='constant', warmup_steps=0, grad_accum_steps=576, **rate),
          # About the tokens of 36 rows of 1,024 per evaluation step: 4 rows of 8,192 (the
          # logits at P slots over 256,000 pieces grow with the rows).
          eval=dict(batch_size=4))),
      # max_duration: 100000000000tok (_DECAY; _SMALL_DECAY: 3000000000000tok from the
      # start). Decay-Eng's 110 languages (_PAPER), weighted by the csv's 'decay-eng'.
      dict(name='decay', tokens=100_000_000_000, overrides=dict(
          data=dict(sources=language_sources(root, 'decay', 'decay-eng')),
          # mlm_probability: 0.05 (_DECAY); P for 5% of 8,192 tokens.
          masking=dict(select_rate=0.05, max_predictions=common.max_predictions(0.05, 8192, 8)),
          train=dict(schedule='decay', **decay))),
  )
  # t_warmup: 3000000000tok (_PRETRAIN; _SMALL: 4000000000tok): the steps that reach them
  # under the batch warm-up.
  config.train.warmup_steps = common.warmup_to(config, 4_000_000_000 if small else 3_000_000_000)
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/tiny.py's model trained as the published recipe (common.flexbert_tiny): 30%
  # masking, StableAdamW with betas (0.9, 0.95) and eps 1e-8, no global-norm clipping, rotary
  # base 10,000 until the ext phase, random replacements drawn uniformly; the batch warmed up
  # from 8 rows to 16 over the first 0.3M tokens (mmBERT: 384 -> 4,608 over 60B tokens). The
  # built-in corpus is one source: no language mixture, no temperature.
  config = common.flexbert_tiny(betas=(0.9, 0.95), eps=1e-8)
  long_model = dict(max_position_embeddings=256, global_rope_theta=160_000.0,
                    local_rope_theta=160_000.0)
  config.phases = (
      dict(name='pretrain', tokens=2_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # Rows twice as long (mmBERT: 1,024 -> 8,192), every rotary base 160,000, 15% masking,
      # the peak held.
      dict(name='ext', tokens=1_200_000, overrides=dict(
          data=dict(seq_len=256), model=long_model,
          masking=dict(select_rate=0.15, max_predictions=common.max_predictions(0.15, 256)),
          train=dict(schedule='constant', warmup_steps=0),
          eval=dict(batch_size=32))),
      # 5% masking and a 1-sqrt decay to 0.02 of the peak.
      dict(name='decay', tokens=800_000, overrides=dict(
          masking=dict(select_rate=0.05),
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.02))),
  )
  return config
