"""Ettin's encoders (Weller et al., 2025) as one run in three phases, at every released size.

Published (`--config=configs/recipes/ettin.py:SIZE`, SIZE one of 17m, 32m, 68m, 150m, 400m,
1b; '' is 150m; `SIZE,fill=F` counts real tokens, below), from the encoder yamls of JHU-CLSP/ettin-encoder-vs-decoder
pretraining/configs/standard/ (the recipe of ModernBERT, with open data, at six sizes):

  phase     tokens  T      masking  learning rate                   batch (rows)
  pretrain  1.7T    1,024  30%      warm-up, then the peak held     4,608
  context   250B    7,999  30%      1-sqrt from the peak to 0.5 x   4,608
  decay     50B     7,999  15%      1-sqrt from half the peak to    4,608
                                    0.04 x

per size (SIZES): the shape, the peak (3e-3 up to 68m, 8e-4 at 150m, 5e-4
above), its decoupled weight decay, the warm-up (4B tokens up to 32m, 3B at
68m and 150m, 2B above); the 1b's later phases are a third as long (83.3B and
16.7B). StableAdamW (betas 0.9, 0.98, eps 1e-6) throughout, its moments
carried over both boundaries; the rotary base goes from 10,000 to 160,000 at
the context phase (the 17m's local layers stay at 10,000 until the decay).
No batch warm-up: the yamls set batch_size_warmup_* but also
sequence_packing: false, and orionw/bert24's src/text_data.py hands the
warm-up to the sequence packer only, so the full batch trains from step 0.
Each phase reads its own data in the original (the pretraining mixture, a
250B-token sample of it, ProLong's long documents): point config.data.corpus
(and each phase's data.corpus override) at yours.

Ettin's rows (no packing; src/text_data.py's NoStreamingDataset and the
chunks of pretraining/data_processing's split_dataset_into_chunks, run with
-m 512 -a 128 --backfill --backfill_no_duplicates): one row per chunk of one
document, [CLS] + up to T - 2 of its tokens + [SEP], padded to T; a
document's last chunk under 128 tokens is dropped and one under 512 takes a
random share of the chunk before it. Here config.data.row_layout=
'document_chunks' with chunk_min_tokens 512 and chunk_drop_tokens 128
(data/packing.py), in every phase. Ettin's released shards hold such chunks
already: read as MDS with ids, each is one row. The phases' lengths and the
warm-up count rows x T (padding included); Ettin's trainer counts real
tokens (count_padding_tokens: false), so its phases hold more rows than
these. `SIZE,fill=F`, F the real share of your prepared rows (1 - the
padding_fraction of the data dir's report.json), divides every phase's
length and the warm-up by F, so that they count real tokens as Ettin's did.

Tiny (`:tiny`): the same three phases on the built-in corpus with
configs/tiny.py's model, 128 -> 256 tokens, 30% -> 15% masking, the batch
warmed up from 8 to 16 rows: 4.0M tokens (pretrain 2.0M at T=128, context
1.2M and decay 0.8M at T=256).
Smoke (`:smoke`): the tiny phases at 3 steps each, for tests.
What differs from the original and why: docs/recipes.md.
"""

import ml_collections

from configs.recipes import common

# The encoder yamls of each size (JHU-CLSP/ettin-encoder-vs-decoder, pretraining/configs/
# standard/DIR/): de_decay/ is the context extension (max_seq_len 7999, data_local: sample_250B;
# pretraining/README.md's "Phase 2: Mid-training/Extension (250B tokens)"), prolong_decay/ the
# final decay (data_local: ProLong; "Phase 3: Decay Phase"). That README's table of sizes names
# each (17M ... 1B).
_PRETRAIN = 'pretraining/configs/standard/{dir}/encoder_{dir}.yaml'
_CONTEXT = 'pretraining/configs/standard/{dir}/de_decay/encoder_{dir}.yaml'
_DECAY = 'pretraining/configs/standard/{dir}/prolong_decay/encoder_{dir}.yaml'


# What differs between the sizes, each value from that size's three yamls: model_config's
# num_hidden_layers, hidden_size, num_attention_heads, intermediate_size (_PRETRAIN); the
# optimizer's lr and weight_decay (_PRETRAIN; _CONTEXT repeats them, _DECAY halves lr);
# scheduler.t_warmup (_PRETRAIN); max_duration of the later phases (_CONTEXT, _DECAY);
# device_train_microbatch_size of each phase (`yaml_micro`); local_attn_rotary_emb_base of
# _CONTEXT (unset: -1, the global base, src/bert_layers/configuration_bert.py).
# `micro`: our micro-batch rows per phase (4,608 / micro-batches): a multiple of 4, a v5p-8's
# chips (so 4 where the yaml has 2), no more than the yaml's per-GPU rows nor, where 4 rows
# allow it, than an H100 holds: every phase fits one in the pre-flight but the 1b's later
# ones (docs/recipes.md, which gives each phase's memory).
# `eval`: device_eval_batch_size per phase, to a multiple of 4, as rows per evaluation step.
SIZES = {
    '17m': dict(dir='very_tiny', layers=7, width=256, heads=4, mlp=384, lr=3e-3, wd=3e-4,
                warmup=4_000_000_000, context=250_000_000_000, decay=50_000_000_000,
                context_local_theta=10_000.0, yaml_micro=(144, 24, 12), micro=(144, 24, 12),
                eval=(144, 24, 12)),
    '32m': dict(dir='tiny', layers=10, width=384, heads=6, mlp=576, lr=3e-3, wd=3e-4,
                warmup=4_000_000_000, context=250_000_000_000, decay=50_000_000_000,
                context_local_theta=160_000.0, yaml_micro=(128, 24, 12), micro=(128, 24, 12),
                eval=(128, 24, 12)),
    '68m': dict(dir='mini', layers=19, width=512, heads=8, mlp=768, lr=3e-3, wd=3e-4,
                warmup=3_000_000_000, context=250_000_000_000, decay=50_000_000_000,
                context_local_theta=160_000.0, yaml_micro=(96, 18, 8), micro=(96, 16, 8),
                eval=(96, 16, 8)),
    '150m': dict(dir='base', layers=22, width=768, heads=12, mlp=1152, lr=8e-4, wd=1e-5,
                 warmup=3_000_000_000, context=250_000_000_000, decay=50_000_000_000,
                 context_local_theta=160_000.0, yaml_micro=(72, 16, 12), micro=(48, 8, 8),
                 eval=(48, 16, 12)),
    '400m': dict(dir='large', layers=28, width=1024, heads=16, mlp=2624, lr=5e-4, wd=1e-5,
                 warmup=2_000_000_000, context=250_000_000_000, decay=50_000_000_000,
                 context_local_theta=160_000.0, yaml_micro=(48, 6, 2), micro=(24, 4, 4),
                 eval=(48, 4, 4)),
    # max_duration: 83_333_000_000tok (_CONTEXT) and 16_666_666_667tok (_DECAY): a third of the
    # others'. pretraining/README.md: "1B: 2170 hours to do 2T (~90 days, we did only ~40)";
    # how far its pretraining went is not published: max_duration 1.7T (_PRETRAIN) here.
    '1b': dict(dir='huge', layers=28, width=1792, heads=28, mlp=3840, lr=5e-4, wd=5e-5,
               warmup=2_000_000_000, context=83_333_000_000, decay=16_666_666_667,
               context_local_theta=160_000.0, yaml_micro=(24, 2, 2), micro=(16, 4, 4),
               eval=(24, 4, 4)),
}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """arg '' (150m) or a size of SIZES, optionally with ',fill=F': the published recipe;
  'tiny': its phases on a 2-core CPU; 'smoke': tiny, cut.

  fill: the share of a row's T ids that are a document's, in your prepared data (1 - the
  train split's padding_fraction in the data dir's report.json). The phases' lengths and the
  warm-up, in Ettin's real tokens, are divided by it: rows x T then count what Ettin's trainer
  counted. 1 (the default): every row taken as full."""
  size, _, fill = arg.partition(',')
  if fill.startswith('fill=') and size in ('', *SIZES):
    try:
      value = float(fill[len('fill='):])
    except ValueError:
      value = 0.0
    if 0.0 < value <= 1.0:
      return _published(size or '150m', value)
    raise ValueError(f'configs/recipes/ettin.py: {fill!r} must be fill=F with 0 < F <= 1, the '
                     "share of a row's ids that are real (1 - padding_fraction of the prepared "
                     "data's report.json): e.g. --config=configs/recipes/ettin.py:400m,fill=0.62")
  if arg in SIZES:
    return _published(arg)
  if arg in ('', 'tiny', 'smoke'):
    return common.variant('ettin', arg, lambda: _published('150m'), _tiny)
  raise ValueError(f"configs/recipes/ettin.py takes '', {', '.join(map(repr, SIZES))}, 'tiny' or "
                   f"'smoke', a size with ',fill=F', not {arg!r}: e.g. "
                   '--config=configs/recipes/ettin.py:400m')


def _published(size: str, fill: float = 1.0) -> ml_collections.ConfigDict:
  s = SIZES[size]

  def real(tokens: int) -> int:  # Ettin's real tokens as rows x T of rows `fill` full.
    return round(tokens / fill)

  micro_batches = [4608 // rows for rows in s['micro']]
  # model_config of _PRETRAIN (vocab 50,368, a window of 128, a global layer every 3, LayerNorm
  # eps 1e-5 at every size), under FlexBERT's trainer (common.flexbert). sequence_packing:
  # false, so the bert24 text loader masks (transformers' DataCollatorForLanguageModeling):
  # 80% [MASK], 10% a random id drawn uniformly, 10% kept.
  config = common.flexbert(
      shape=dict(num_layers=s['layers'], hidden_size=s['width'], num_heads=s['heads'],
                 intermediate_size=s['mlp']),
      # seed: 21 (_PRETRAIN).
      seed=21,
      # max_seq_len: 1024 (_PRETRAIN).
      seq_len=1024,
      # mlm_probability: 0.3 (_PRETRAIN).
      select_rate=0.3,
      # rotary_emb_base: 10000.0 for every layer (_PRETRAIN; local_attn_rotary_emb_base unset).
      rope_theta=10_000.0,
      # optimizer: decoupled_stableadamw, betas [0.9, 0.98], eps 1.0e-06, lr and weight_decay
      # per size (_PRETRAIN), the decay fully decoupled (decouple_lr=True).
      learning_rate=s['lr'], betas=(0.9, 0.98), eps=1e-6, decoupled_weight_decay=s['wd'],
      # global_train_batch_size: 4608 (_PRETRAIN), in micro-batches of s['micro'][0] rows.
      batch_size=4608, micro_batches=micro_batches[0],
      # No batch warm-up: batch_size_warmup_min_size and _tokens are set (_PRETRAIN) but only
      # the sequence packer reads them (bert24 src/text_data.py), and sequence_packing: false.
      batch_warmup_start=0, batch_warmup_tokens=0,
      # device_eval_batch_size (_PRETRAIN): rows per evaluation step (global here; the yamls'
      # global_eval_batch_size 1024 is many devices' worth). The yamls evaluate at 15%
      # masking, ours at the phase's select_rate; eval_interval is "don't do this" (off): every
      # 4,000 steps here, as ModernBERT's.
      eval_batch_size=s['eval'][0], eval_every=4000,
      # console_log_interval: 100ba (_PRETRAIN); save_interval: 8_500_000_000tok, about 1,800
      # steps of 4,608 x 1,024 tokens.
      log_every=100, checkpoint_every=1800)
  # Your corpus: Ettin's 1.7T-token open mixture (DCLM, Dolma, code, papers, books) is on the
  # Hugging Face hub as MosaicML streaming shards (data_local: ettin_tokenized_data; the later
  # phases sample_250B and ProLong); set --config.data.corpus=... to text, jsonl, parquet or
  # MDS files.
  config.data.corpus = ''
  # Ettin's rows: a chunk of one document a row, padded; short last chunks dropped under 128
  # ids and backfilled under 512 (split_dataset_into_chunks' -a 128 -m 512 --backfill
  # --backfill_no_duplicates, the chunked-...-1024-512-128-backfill-nodups and 8000-512-128
  # data of pretraining/data_processing/README.md and bin/sample_too_large_down.py).
  config.data.row_layout = 'document_chunks'
  config.data.chunk_min_tokens = 512
  config.data.chunk_drop_tokens = 128
  # tokenizer_name: bclavie/olmo_bert_template (_PRETRAIN): ModernBERT's byte-level BPE. Set
  # config.tokenizer.model_file to its tokenizer.json to use it; left empty, a byte-level BPE
  # of 50,368 pieces is trained on your corpus.
  config.tokenizer.kind = 'bpe'
  # scheduler warmup_stable_decay, t_warmup per size, t_decay: 0tok (_PRETRAIN): a warm-up,
  # then the peak to the phase's end ('constant'). The warm-up's steps are set below.
  # The later phases: max_seq_len 7999 (_CONTEXT, _DECAY), rotary_emb_base 160000.0; the local
  # base of _CONTEXT per size, 160000.0 in _DECAY. 7,999 is a prime: on GPUs XLA's Triton
  # matmuls find no tiling for the 400m's and 1b's GeGLU weight gradient over such rows, so
  # those two compile there with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS for
  # every matmul; docs/recipes.md's pre-flight).
  long_rows = dict(seq_len=7999)
  long_model = dict(max_position_embeddings=8192, global_rope_theta=160_000.0,
                    local_rope_theta=s['context_local_theta'])
  config.phases = (
      # max_duration: 1_700_000_000_000tok (_PRETRAIN).
      dict(name='pretrain', tokens=real(1_700_000_000_000),
           overrides=dict(train=dict(schedule='constant'))),
      # max_duration per size (_CONTEXT), load_path + reset_time: the optimizer's state carries
      # over, the schedule restarts: one_minus_sqrt over the whole phase with alpha_f: 0.5 from
      # the same lr (_CONTEXT; the 1b's yaml sets no reset_time, read as the others').
      dict(name='context', tokens=real(s['context']), overrides=dict(
          data=long_rows, model=long_model,
          # mlm_probability: 0.3 (_CONTEXT); P for 30% of 7,999 tokens.
          masking=dict(max_predictions=common.max_predictions(0.3, 7999, 8)),
          # global_train_batch_size: 4608 (_CONTEXT), in micro-batches of s['micro'][1] rows.
          train=dict(schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.5,
                     warmup_steps=0, grad_accum_steps=micro_batches[1]),
          eval=dict(batch_size=s['eval'][1]))),
      # max_duration per size (_DECAY), with restart_override: lr half the first peak (where the
      # context phase ended), one_minus_sqrt with alpha_f: 0.04 ("another decay to 0.02 of the
      # LR" of the pretraining, pretraining/README.md), the decoupled weight decay against the
      # new peak (the 400m's yaml sets neither reset_time nor restart_override; read as the
      # others').
      dict(name='decay', tokens=real(s['decay']), overrides=dict(
          # mlm_probability: 0.15 (_DECAY); P for 15% of 7,999 tokens; every layer at 160,000.
          masking=dict(select_rate=0.15, max_predictions=common.max_predictions(0.15, 7999, 8)),
          model=dict(local_rope_theta=160_000.0),
          train=dict(learning_rate=s['lr'] / 2, final_lr_ratio=0.04,
                     weight_decay=s['wd'] / (s['lr'] / 2), grad_accum_steps=micro_batches[2]),
          eval=dict(batch_size=s['eval'][2]))),
  )
  # t_warmup per size (_PRETRAIN): the steps that reach it (no batch warm-up: whole steps of
  # 4,608 x 1,024 tokens).
  config.train.warmup_steps = common.warmup_to(config, real(s['warmup']))
  return config


def _tiny() -> ml_collections.ConfigDict:
  # Packed rows, as the quick start's (docs/recipes.md's tiny figures were measured so):
  # --config.data.row_layout=document_chunks gives Ettin's.
  # configs/tiny.py's model trained as the published recipe (common.flexbert_tiny): 30%
  # masking, StableAdamW, no global-norm clipping, rotary base 10,000 everywhere until the
  # context phase, random replacements drawn uniformly; the batch warmed up from 8 rows to 16
  # over the first 0.3M tokens (Ettin itself has no batch warm-up: the tiny variant keeps one
  # so that a short run goes through a growing batch).
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
