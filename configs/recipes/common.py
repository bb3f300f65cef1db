"""What the recipes share: the masked-slot count P for a rate, the variants every recipe file
offers ('', tiny, smoke: a tiny recipe's phases cut to a few steps, for tests), and the
FlexBERT trainer's settings that ModernBERT's, Ettin's and mmBERT's recipes have in common
(flexbert, flexbert_tiny), each recipe giving its own sourced values.

Not a recipe itself: it has no get_config().
"""

import copy
from collections.abc import Callable

import ml_collections

from configs import modern_base
from configs import tiny
from mlm_jax.config import phases
from mlm_jax.data import masking


def max_predictions(rate: float, seq_len: int, multiple: int = 1) -> int:
  """The static P that holds every selected slot of a full row at `rate`, rounded up to a
  multiple of `multiple`.

  A full row gets masking.full_row_slots(rate, seq_len) slots. The
  published recipes round P up to a multiple of 8 (FIRST_P_MULTIPLE for the
  first phase's): XLA's GPU compiler found no tiling for the head's
  [rows x P, d] matmuls at P = 307 (a prime), and the extra slots are padding
  that costs nothing in the loss.
  """
  return -(-masking.full_row_slots(rate, seq_len) // multiple) * multiple


def smoke(config: ml_collections.ConfigDict, steps: int = 3) -> ml_collections.ConfigDict:
  """A tiny recipe with every phase cut to `steps` optimizer steps (the first to steps + 1,
  so that a batch warm-up of one step fits in it) and the log, evaluation and checkpoint
  cadence at a step or two: the same phases, shapes and settings, run in seconds.

  What must stay true: every phase keeps its overrides (row length, masking,
  schedule, batch), so a smoke run goes through every boundary the tiny run
  does; only lengths and cadences shrink.
  """
  config = copy.deepcopy(config)
  train = config.train
  # A batch warm-up of one step at the start batch: it still grows inside the first phase.
  if train.batch_warmup_tokens:
    train.batch_warmup_tokens = train.batch_warmup_start * config.data.seq_len
  train.warmup_steps = min(train.warmup_steps, 1)
  train.log_every, train.eval_every, train.checkpoint_every = 1, 2, 2
  config.eval.max_batches = 2
  if config.masking.rate_change_tokens:
    config.masking.rate_change_tokens = 0  # The first phase's end.
  shortened = []
  for index, phase in enumerate(config.phases):
    phase = copy.deepcopy(dict(phase))
    phase.pop('tokens', None)
    phase['steps'] = steps + (1 if index == 0 and train.batch_warmup_tokens else 0)
    overrides = phase.get('overrides', {})
    if 'warmup_steps' in overrides.get('train', {}):
      overrides['train']['warmup_steps'] = min(overrides['train']['warmup_steps'], 1)
    if overrides.get('masking', {}).get('rate_change_tokens'):
      overrides['masking']['rate_change_tokens'] = 0  # The phase's end.
    shortened.append(phase)
  config.phases = tuple(shortened)
  return config


def variant(recipe: str, arg: str, published: Callable[[], ml_collections.ConfigDict],
            tiny: Callable[[], ml_collections.ConfigDict],
            smoked: Callable[[], ml_collections.ConfigDict] | None = None
            ) -> ml_collections.ConfigDict:
  """A recipe file's get_config(arg): '' the published recipe, 'tiny' its phases on a 2-core
  CPU, 'smoke' tiny cut to a few steps (`smoked`, else smoke(tiny())); anything else a
  one-line error."""
  if arg == '':
    return published()
  if arg == 'tiny':
    return tiny()
  if arg == 'smoke':
    return smoked() if smoked else smoke(tiny())
  raise ValueError(f"configs/recipes/{recipe}.py takes '', 'tiny' or 'smoke', not {arg!r}: "
                   f'e.g. --config=configs/recipes/{recipe}.py:tiny')


# The first phase's P (30% of 1,024 tokens: 307) rounds up to a multiple of 64, 320: at 312
# XLA's GPU compiler found no tiling for the last block's GeGLU weight gradient over
# [micro-batch rows x P] slots for ModernBERT-large's and the wider Ettins' shapes (and for
# base's at 16 rows); 320 compiled for every shape and micro-batch of these recipes, and the
# later phases' multiples of 8 did too (deviceless H100 compiles of that gradient alone).
FIRST_P_MULTIPLE = 64


# The GPUs that ModernBERT and mmBERT trained on: 8 H100s (ModernBERT-base's
# global_eval_batch_size 1024 is 8 x device_eval_batch_size 128; mmBERT's README: "Using
# 8xH100s"). Their yamls' batch_size_warmup_min_size is per GPU: src/text_data.py hands the
# device batch to GreedyBestFitSequencePacker.from_composer, which counts the warm-up's
# sizes in that device's micro-batches (src/sequence_packer.py).
FLEXBERT_GPUS = 8


def flexbert(*, seed: int, seq_len: int, select_rate: float, rope_theta: float,
             learning_rate: float, betas: tuple[float, float], eps: float,
             decoupled_weight_decay: float, batch_size: int, micro_batches: int,
             batch_warmup_start: int, batch_warmup_tokens: int, eval_batch_size: int,
             eval_every: int, log_every: int, checkpoint_every: int,
             shape: dict | None = None) -> ml_collections.ConfigDict:
  """ModernBERT-base's shape (or `shape`'s config.model fields over it) trained as FlexBERT's
  trainer trains it (AnswerDotAI/ModernBERT's main.py and src/, which ModernBERT, Ettin and
  mmBERT all train with); the keywords are the values their yamls give, each sourced where
  the recipe calls this. batch_warmup_start is global: a yaml's per-GPU
  batch_size_warmup_min_size times its GPUs (FLEXBERT_GPUS).

  What the trainer fixes, whatever the yaml: of the selected tokens 80% [MASK], 10% a random
  id drawn uniformly, 10% kept (src/sequence_packer.py's mlm_mask_sequence; transformers'
  collator without packing); P rounded up to a multiple of 64 (FIRST_P_MULTIPLE); no dropout
  but attn_out_dropout_prob: 0.1 on the attention output (model.attention_output_dropout_rate;
  the published config.json files say attention_dropout 0.0, Hugging Face's name for the
  probabilities' and the output's dropout together, which training did not use); every layer
  at one rotary base until a phase raises it; decoupled_stableadamw (optimi's StableAdamW)
  whose weight decay is fully decoupled (the weights shrink by wd x lr/peak per step; ours
  is scaled by the learning rate, so wd / peak), not applied to biases and norms
  (filter_bias_norm_wd: true); no gradient clipping (StableAdamW's per-tensor update
  clipping instead); the learning-rate warm-up in tokens (warmup_steps is set by the recipe
  once its phases exist: warmup_to).

  Documents apart: padding: unpadded (every yaml's model_config) runs attention over each
  sequence of a batch's cu_seqlens on its own (flash attention's variable-length form, with
  rotary positions from 0 in each: src/bert_layers/attention.py), and a sequence is one
  document (packed: each of the documents GreedyBestFitSequencePacker put in a row; unpacked:
  the row itself, one document's chunk). Here model.document_mask keeps a packed row's
  documents apart and model.restart_positions counts each one's positions from 0.
  """
  # configs/modern_base.py: L=22, d=768, 12 heads, GeGLU 1152, a local window of 128 and a
  # global layer every 3, LayerNorm eps 1e-5.
  config = modern_base.get_config()
  for field, value in (shape or {}).items():
    config.model[field] = value
  config.seed = seed
  # Rows of seq_len (rotary positions: no table; a later phase raises both).
  config.data.seq_len = seq_len
  config.model.max_position_embeddings = seq_len
  config.masking.select_rate = select_rate
  config.masking.max_predictions = max_predictions(select_rate, seq_len, FIRST_P_MULTIPLE)
  config.masking.mask_prob = 0.8
  config.masking.random_prob = 0.1
  config.masking.random_source = 'uniform'
  config.model.dropout_rate = 0.0
  config.model.attention_dropout_rate = 0.0
  # attn_out_dropout_prob: 0.1 in every yaml of ModernBERT, Ettin and mmBERT.
  config.model.attention_output_dropout_rate = 0.1
  config.model.document_mask = True
  config.model.restart_positions = True
  config.model.global_rope_theta = rope_theta
  config.model.local_rope_theta = rope_theta
  config.train.optimizer = 'stable_adamw'
  config.train.learning_rate = learning_rate
  config.train.adam_b1, config.train.adam_b2 = betas
  config.train.adam_eps = eps
  config.train.weight_decay = decoupled_weight_decay / learning_rate
  config.train.grad_clip_norm = 0.0
  # The yamls' device_train_microbatch_size is per GPU; micro_batches is chosen per recipe.
  config.train.batch_size = batch_size
  config.train.grad_accum_steps = micro_batches
  config.train.batch_warmup_start = batch_warmup_start
  config.train.batch_warmup_tokens = batch_warmup_tokens
  config.eval.batch_size = eval_batch_size
  config.train.eval_every = eval_every
  config.train.log_every = log_every
  config.train.checkpoint_every = checkpoint_every
  config.train.warmup_steps = 0
  return config


def flexbert_tiny(*, betas: tuple[float, float] = (0.9, 0.98),
                  eps: float = 1e-6) -> ml_collections.ConfigDict:
  """configs/tiny.py's model, tokenizer (1,000 pieces, trained on the built-in corpus), peak
  rate 2e-3 and 100 warm-up steps, trained as flexbert() trains: 30% masking at the first
  length, StableAdamW (`betas`, `eps`), no global-norm clipping, rotary base 10,000 everywhere
  until a phase raises it, random replacements drawn uniformly; the batch warmed up from 8
  rows to 16 over the first 0.3M tokens, a micro-batch of 8 at a time; about 1,600 steps in
  all, an evaluation every 250. The tiny variants of the FlexBERT recipes add their phases.

  Unlike flexbert(), no attention-output dropout and documents not kept apart: the figures
  of docs/recipes.md's tiny runs were measured so. Both are one override away
  (--config.model.attention_output_dropout_rate=0.1, --config.model.document_mask=true
  --config.model.restart_positions=true)."""
  config = tiny.get_config()
  config.masking.select_rate = 0.3
  config.masking.max_predictions = max_predictions(0.3, 128)
  config.masking.random_source = 'uniform'
  config.model.global_rope_theta = 10_000.0
  config.model.local_rope_theta = 10_000.0
  config.train.optimizer = 'stable_adamw'
  config.train.adam_b1, config.train.adam_b2 = betas
  config.train.adam_eps = eps
  config.train.grad_clip_norm = 0.0
  config.train.batch_size = 16
  config.train.grad_accum_steps = 2
  config.train.batch_warmup_start = 8
  config.train.batch_warmup_tokens = 300_000
  config.train.log_every = 50
  config.train.eval_every = 250
  config.train.checkpoint_every = 250
  return config


def per_gpu_start(per_gpu_rows: int, gpus: int = FLEXBERT_GPUS) -> int:
  """The global first batch of a FlexBERT batch warm-up: batch_size_warmup_min_size rows on
  each of `gpus` GPUs."""
  return per_gpu_rows * gpus


def warmup_to(config: ml_collections.ConfigDict, tokens: int) -> int:
  """The steps from the run's start until `tokens` tokens, the batch warm-up included: a
  learning-rate warm-up given in tokens (t_warmup), as steps."""
  return phases.Plan(config).steps_for_tokens(0, tokens)
