"""mmBERT-base's pretraining (Marone et al., 2025) as one run in three phases.

Published (`--config=configs/recipes/mmbert.py`, or `...mmbert.py:data=ROOT` for a data root
other than ./mmbert-data), from JHU-CLSP/mmBERT configs/mmBERT-base*.yaml and the paper
(arXiv 2509.06888, section 3):

  phase     tokens  T      masking  languages (exponent)  learning rate            batch (rows)
  pretrain  2.3T    1,024  30%      61 (0.7)              3B-token warm-up, held   48 -> 4,608 *
  ext       600B    8,192  15%      110 (0.5)             8e-4 held                4,608
  decay     100B    8,192  5%       110 (0.3)             1-sqrt to 0.02 x         4,608
  (* over the first 60B tokens; the peak is 8e-4)

StableAdamW (betas 0.9, 0.95, eps 1e-8) throughout, its moments carried over
both boundaries; every layer's rotary base goes from 10,000 to 160,000 at the
ext phase. The languages are drawn with p ∝ n^(1/tau) over each language's
tokens n: mmBERT's exponents 0.7, 0.5, 0.3 are tau = 1/0.7, 2, 1/0.3 here
(config.data.temperature). The sources are one directory per language,
ROOT/PHASE/LANGUAGE (text, jsonl or parquet files), named as in
statistics/language_counts.csv; the decay phase is the Decay-Eng variant
(110 languages). mmBERT merges its decay variants (Decay-Eng, Decay-Cont,
Decay-All with 1,833 languages): docs/recipes.md says how with
`python -m mlm_jax.average`.

Tiny (`:tiny`): the same three phases on the built-in corpus (one source: no
mixture) with configs/tiny.py's model, 128 -> 256 tokens, 30% -> 15% -> 5%
masking, the batch warmed up from 8 to 16 rows: 4.0M tokens (pretrain 2.0M at
T=128, ext 1.2M and decay 0.8M at T=256).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs.recipes import common

# The three yamls (JHU-CLSP/mmBERT) and the paper.
_PRETRAIN = 'configs/mmBERT-base.yaml'
_EXT = 'configs/mmBERT-base-ext.yaml'
_DECAY = 'configs/mmBERT-base-decay.yaml'
_PAPER = 'Marone et al. 2025, arXiv 2509.06888, section 3'

# The languages (ISO 639-3, and 'code') with tokens in each phase: JHU-CLSP/mmBERT
# statistics/language_counts.csv, columns 'pretrain' (61) and 'ext' (110; the same set as
# 'decay-eng' and 'decay-mid'; 'decay-all' adds the rest of its 1,833).
PRETRAIN_LANGUAGES = tuple("""
afr arb azj ben bul ces cmn code dan deu ekk ell eng fas fil fin fra gle glg guj heb hin
hrv hun ind ita jpn kat kaz khk khm kor lit lvs mal mar mkd mya nld nob npi pbt pol por
ron rus sin slk slv spa swe swh tam tel tha tur ukr urd vie xho zsm""".split())
EXT_LANGUAGES = PRETRAIN_LANGUAGES + tuple("""
als amh anp ars ary arz bel bew bod bos cat ceb ckb cym epo eus fry gla gmh gsw hat hif
hye isl jav kan kir kmr lao lat ltz mlt mri mww nap nno nrm ory pan pcm plt rmy snd som
srp tat tgk uzn yue""".split())
# Where the published variant looks for ROOT/PHASE/LANGUAGE unless given `:data=ROOT`.
DEFAULT_ROOT = 'mmbert-data'


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' or 'data=ROOT': the published recipe; 'tiny': its phases on a 2-core CPU;
  'smoke': tiny, cut."""
  if arg == '' or arg.startswith('data='):
    return _published(arg[len('data='):] or DEFAULT_ROOT)
  if arg == 'tiny':
    return _tiny()
  if arg == 'smoke':
    return common.smoke(_tiny())
  raise ValueError(f"configs/recipes/mmbert.py takes '', 'data=ROOT', 'tiny' or 'smoke', not "
                   f'{arg!r}: e.g. --config=configs/recipes/mmbert.py:data=/mnt/mmbert')


def language_sources(root: str, phase: str, languages: tuple[str, ...]) -> tuple[dict, ...]:
  """config.data.sources of one directory per language, ROOT/PHASE/LANGUAGE, drawn by size
  under config.data.temperature (no weights: a weight would multiply the size-based share)."""
  return tuple({'name': language, 'corpus': f'{root}/{phase}/{language}'}
               for language in languages)


def _published(root: str) -> ml_collections.ConfigDict:
  # ModernBERT-base's shape: model_config of _PRETRAIN, under FlexBERT's trainer
  # (common.flexbert). sequence_packing: true (_PRETRAIN): ModernBERT's packer masks 80%
  # [MASK], 10% a random id drawn uniformly, 10% kept (src/sequence_packer.py of
  # AnswerDotAI/ModernBERT).
  config = common.flexbert(
      # seed: 21 (_PRETRAIN).
      seed=21,
      # max_seq_len: 1024 (_PRETRAIN).
      seq_len=1024,
      # 30% masking (_PAPER; _PRETRAIN has mlm_probability: 0.25, the paper and the issue 30%).
      select_rate=0.3,
      # rotary_emb_base: 10000, local_attn_rotary_emb_base: 10000 (_PRETRAIN).
      rope_theta=10_000.0,
      # optimizer: decoupled_stableadamw, lr: 0.0008, eps: 1.0e-08, betas: [0.9, 0.95]
      # (_PRETRAIN).
      learning_rate=8e-4, betas=(0.9, 0.95), eps=1e-8,
      # weight_decay: 8.0e-05, fully decoupled (_PRETRAIN).
      decoupled_weight_decay=8e-5,
      # global_train_batch_size: 4608, device_train_microbatch_size: 48 (_PRETRAIN): 96
      # micro-batches of 48 rows.
      batch_size=4608, micro_batches=96,
      # batch_size_warmup_min_size: 48, batch_size_warmup_tokens: 60000000000tok (_PRETRAIN).
      # Ours grows linearly in tokens, a micro-batch at a time.
      batch_warmup_start=48, batch_warmup_tokens=60_000_000_000,
      # device_eval_batch_size: 36 (_PRETRAIN): rows per evaluation step (global here). The
      # yamls turn evaluation off (eval_interval: 100000000000ba): every 4,000 steps here, at
      # the phase's masking rate.
      eval_batch_size=36, eval_every=4000,
      # console_log_interval: 25ba; save_interval: 10000000000tok, about 2,100 steps of
      # 4,608 x 1,024 tokens (_PRETRAIN).
      log_every=25, checkpoint_every=2100)
  # tokenizer_name: google/gemma-2-9b, vocab_size: 256000 (_PRETRAIN): Gemma 2's sentencepiece
  # BPE with byte fallback. Set config.tokenizer.model_file to its tokenizer.json (or
  # tokenizer.model) to use it; left empty, a sentencepiece BPE of 256,000 pieces is trained.
  config.tokenizer.kind = 'sentencepiece'
  config.tokenizer.model_type = 'bpe'
  config.tokenizer.vocab_size = 256_000
  # The pretraining mixture: 61 languages and code, drawn with exponent 0.7 (_PAPER).
  config.data.sources = language_sources(root, 'pretrain', PRETRAIN_LANGUAGES)
  config.data.temperature = 1 / 0.7
  # save_num_checkpoints_to_keep: 10 (_PRETRAIN).
  config.train.keep_checkpoints = 10
  # scheduler warmup_stable_decay, t_warmup: 3000000000tok, t_decay: 0tok (_PRETRAIN): a
  # warm-up, then the peak ('constant'); the warm-up's steps are set below.
  # The ext and decay phases: max_seq_len: 8192, rotary_emb_base and local_attn_rotary_emb_base
  # 160000.0 (_EXT, _DECAY); device_train_microbatch_size: 6 there, here micro-batches of 8
  # rows (576 of them): 4,608 / 6 does not split over 4 chips.
  long_model = dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                    local_rope_theta=160_000.0)
  config.phases = (
      # 2.3T tokens (_PAPER; _PRETRAIN's max_duration: 400000000000tok is one stretch of it).
      dict(name='pretrain', tokens=2_300_000_000_000,
           overrides=dict(train=dict(schedule='constant'))),
      # max_duration: 600000000000tok (_EXT), reset_time_once: the schedule restarts, the
      # optimizer's state carries over: warmup_stable_decay with t_warmup 0tok and t_decay
      # 0tok, the peak throughout. 110 languages at exponent 0.5 (_PAPER).
      dict(name='ext', tokens=600_000_000_000, overrides=dict(
          data=dict(seq_len=8192, sources=language_sources(root, 'ext', EXT_LANGUAGES),
                    temperature=1 / 0.5),
          model=long_model,
          # mlm_probability: 0.15 (_EXT); P for 15% of 8,192 tokens.
          masking=dict(select_rate=0.15, max_predictions=common.max_predictions(0.15, 8192, 8)),
          train=dict(schedule='constant', warmup_steps=0, grad_accum_steps=576),
          # About the tokens of 36 rows of 1,024 per evaluation step: 4 rows of 8,192 (the
          # logits at P slots over 256,000 pieces grow with the rows).
          eval=dict(batch_size=4))),
      # max_duration: 100000000000tok, scheduler one_minus_sqrt over t_decay: 100000000000tok to
      # alpha_f: 0.02 (_DECAY). Decay-Eng's 110 languages at exponent 0.3 (_PAPER).
      dict(name='decay', tokens=100_000_000_000, overrides=dict(
          data=dict(sources=language_sources(root, 'decay', EXT_LANGUAGES),
                    temperature=1 / 0.3),
          # mlm_probability: 0.05 (_DECAY); P for 5% of 8,192 tokens.
          masking=dict(select_rate=0.05, max_predictions=common.max_predictions(0.05, 8192, 8)),
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.02))),
  )
  # t_warmup: 3000000000tok (_PRETRAIN): the steps that reach 3B tokens under the batch warm-up.
  config.train.warmup_steps = common.warmup_to(config, 3_000_000_000)
  return config


def _tiny() -> ml_collections.ConfigDict:
  # configs/tiny.py's model trained as the published recipe (common.flexbert_tiny): 30%
  # masking, StableAdamW with betas (0.9, 0.95) and eps 1e-8, no global-norm clipping, rotary
  # base 10,000 until the ext phase, random replacements drawn uniformly; the batch warmed up
  # from 8 rows to 16 over the first 0.3M tokens (mmBERT: 48 -> 4,608 over 60B tokens). The
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
