"""Config checks that run before anything expensive, and derived values."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections

from mlm_jax.data import corpus as corpus_lib


class ConfigError(ValueError):
  """A config value is invalid; the message names the field and the fix."""


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None,
             check_paths: bool = True) -> None:
  """Raises ConfigError for the first invalid field.

  `check_paths=False` leaves out the checks of files on this machine (corpus,
  tokenizer model, Hugging Face init): for a pre-flight of a run that will
  read them elsewhere.
  """
  d, tok, m, mdl, tr, ev = (config.data, config.tokenizer, config.masking, config.model,
                            config.train, config.eval)
  _check(d.seq_len >= 4, f'config.data.seq_len={d.seq_len} must be at least 4.')
  _check(d.seq_len <= mdl.max_position_embeddings,
         f'config.data.seq_len={d.seq_len} exceeds config.model.max_position_embeddings='
         f'{mdl.max_position_embeddings}; raise the latter or shorten the rows.')
  _check(d.document_split in ('blank_line', 'file'),
         f"config.data.document_split={d.document_split!r}: use 'blank_line' or 'file'.")
  _check(0.0 < d.val_fraction < 1.0,
         f'config.data.val_fraction={d.val_fraction} must be in (0, 1).')
  _check(tok.vocab_size >= 300,
         f'config.tokenizer.vocab_size={tok.vocab_size} is too small: it must hold the '
         '5 special tokens and 256 byte-fallback pieces; use at least 300.')
  _check(tok.model_type in ('unigram', 'bpe'),
         f"config.tokenizer.model_type={tok.model_type!r}: use 'unigram' or 'bpe'.")
  _check(tok.max_sentences > 0, 'config.tokenizer.max_sentences must be positive.')
  _check(not check_paths or not tok.model_file
         or os.path.isfile(os.path.expanduser(tok.model_file)),
         f'config.tokenizer.model_file={tok.model_file!r}: no such file. Give the path of a '
         "sentencepiece model written by mlm_jax (WORKDIR/tokenizer.model), or '' to train one.")
  _check(0 < m.max_predictions <= d.seq_len - 2,
         f'config.masking.max_predictions={m.max_predictions} (P) must be in '
         f'[1, config.data.seq_len - 2 = {d.seq_len - 2}].')
  _check(0.0 < m.select_rate <= 1.0,
         f'config.masking.select_rate={m.select_rate} must be in (0, 1].')
  for name in ('mask_prob', 'random_prob'):
    _check(0.0 <= m[name] <= 1.0, f'config.masking.{name}={m[name]} must be in [0, 1].')
  _check(m.mask_prob + m.random_prob <= 1.0 + 1e-9,
         f'config.masking.mask_prob + random_prob = {m.mask_prob + m.random_prob} '
         'exceeds 1; the rest is the fraction kept unchanged.')
  _check(m.random_source in ('unigram', 'uniform'),
         f"config.masking.random_source={m.random_source!r}: use 'unigram' or 'uniform'.")
  _check(m.mode in ('token', 'whole_word', 'span'),
         f"config.masking.mode={m.mode!r}: use 'token', 'whole_word' or 'span'.")
  _check(0.0 < m.span_p <= 1.0, f'config.masking.span_p={m.span_p} must be in (0, 1].')
  _check(m.span_max_length >= 1,
         f'config.masking.span_max_length={m.span_max_length} must be at least 1.')
  sp = config.sentence_pair
  _check(sp.task in ('none', 'nsp', 'sop'),
         f"config.sentence_pair.task={sp.task!r}: use 'none', 'nsp' or 'sop'.")
  _check(sp.loss_weight >= 0,
         f'config.sentence_pair.loss_weight={sp.loss_weight} must be >= 0.')
  _check(sp.task == 'none' or d.seq_len >= 5,
         f'config.sentence_pair.task={sp.task!r} needs config.data.seq_len >= 5 '
         '([CLS] A [SEP] B [SEP]); raise it.')
  _check(config.input.worker_count >= 0,
         f'config.input.worker_count={config.input.worker_count} must be >= 0 '
         '(0: no worker processes).')
  _check(config.input.prefetch >= 1,
         f'config.input.prefetch={config.input.prefetch} must be at least 1.')
  for name in ('num_layers', 'hidden_size', 'num_heads', 'intermediate_size'):
    _check(mdl[name] > 0, f'config.model.{name}={mdl[name]} must be positive.')
  _check(mdl.hidden_size % mdl.num_heads == 0,
         f'config.model.hidden_size={mdl.hidden_size} is not divisible by '
         f'config.model.num_heads={mdl.num_heads}.')
  _check(mdl.type_vocab_size >= 1, 'config.model.type_vocab_size must be at least 1.')
  for name in ('dropout_rate', 'attention_dropout_rate'):
    _check(0.0 <= mdl[name] < 1.0, f'config.model.{name}={mdl[name]} must be in [0, 1).')
  _check(mdl.dtype in ('auto', 'float32', 'bfloat16'),
         f"config.model.dtype={mdl.dtype!r}: use 'auto', 'float32' or 'bfloat16'.")
  _check(mdl.attention in ('auto', 'xla', 'cudnn'),
         f"config.model.attention={mdl.attention!r}: use 'auto', 'xla' or 'cudnn'.")
  _check(mdl.attention != 'cudnn' or mdl.attention_dropout_rate == 0.0,
         f"config.model.attention='cudnn' with config.model.attention_dropout_rate="
         f"{mdl.attention_dropout_rate}: cuDNN's fused attention has no dropout on the "
         "attention probabilities; set the rate to 0, or attention='auto' to use XLA's "
         'attention when the rate is above 0.')
  _check(mdl.remat in ('none', 'dots', 'full'),
         f"config.model.remat={mdl.remat!r}: use 'none', 'dots' or 'full'.")
  _check(0.0 <= mdl.drop_token_rate < 1.0,
         f'config.model.drop_token_rate={mdl.drop_token_rate} must be in [0, 1).')
  for name in ('batch_size', 'num_steps', 'log_every', 'eval_every', 'checkpoint_every',
               'keep_checkpoints'):
    _check(tr[name] > 0, f'config.train.{name}={tr[name]} must be positive.')
  _check(tr.learning_rate > 0, f'config.train.learning_rate={tr.learning_rate} must be positive.')
  # warmup_steps > num_steps is allowed: a short trial run of a long config.
  _check(tr.warmup_steps >= 0, f'config.train.warmup_steps={tr.warmup_steps} must be >= 0.')
  _check(tr.weight_decay >= 0, 'config.train.weight_decay must be >= 0.')
  _check(tr.grad_clip_norm >= 0, 'config.train.grad_clip_norm must be >= 0 (0 disables).')
  _check(ev.batch_size > 0, f'config.eval.batch_size={ev.batch_size} must be positive.')
  _check(ev.max_batches >= 0, 'config.eval.max_batches must be >= 0 (0: whole split).')
  if 'profile' in config:
    p = config.profile
    _check(p.num_steps >= 0, 'config.profile.num_steps must be >= 0 (0: no trace).')
    _check(p.num_steps == 0 or p.start_step >= 1,
           f'config.profile.start_step={p.start_step} must be >= 1 (the first step is 1).')
    _check(p.peak_tflops >= 0, 'config.profile.peak_tflops must be >= 0 (0: from the chip).')
  _check(tr.grad_accum_steps >= 1,
         f'config.train.grad_accum_steps={tr.grad_accum_steps} must be at least 1.')
  _check(tr.get('concurrent_chains', 0) >= 0,
         f'config.train.concurrent_chains={tr.get("concurrent_chains")} must be >= 0 (0: auto).')
  fsdp = config.mesh.fsdp
  _check(fsdp >= 1, f'config.mesh.fsdp={fsdp} must be at least 1 (1: no sharding of the state).')
  _check(mdl.hidden_size % fsdp == 0,
         f'config.mesh.fsdp={fsdp} does not divide config.model.hidden_size={mdl.hidden_size}; '
         'the state is split along the hidden axis, so use a divisor of it.')
  if num_devices is not None:
    _check(num_devices % fsdp == 0,
           f'config.mesh.fsdp={fsdp} does not divide the {num_devices} devices; use a divisor '
           f'of {num_devices}.')
    for field, value in (('train.batch_size', tr.batch_size), ('eval.batch_size', ev.batch_size)):
      _check(value % num_devices == 0,
             f'config.{field}={value} is not divisible by the {num_devices} devices; '
             f'use a multiple of {num_devices}.')
    unit = num_devices * tr.grad_accum_steps
    _check(tr.batch_size % unit == 0,
           f'config.train.batch_size={tr.batch_size} is not divisible by {num_devices} devices '
           f'x config.train.grad_accum_steps={tr.grad_accum_steps}; use a multiple of {unit}.')
    chains = tr.get('concurrent_chains', 0)
    _check(chains == 0 or tr.batch_size % (unit * chains) == 0,
           f'config.train.batch_size={tr.batch_size} is not divisible by {num_devices} devices '
           f'x grad_accum_steps={tr.grad_accum_steps} x concurrent_chains={chains}; use a '
           f'multiple of {unit * chains}, or concurrent_chains=0 (auto).')
  if config.init.hf_dir and check_paths:
    hf_dir = os.path.expanduser(config.init.hf_dir)
    _check(os.path.isdir(hf_dir), f'config.init.hf_dir={config.init.hf_dir!r}: no such directory.')
    _check(bool(tok.model_file) or os.path.isfile(os.path.join(hf_dir, 'tokenizer.model')),
           f'config.init.hf_dir={config.init.hf_dir!r} has no tokenizer.model (sentencepiece), '
           'so its token ids cannot be matched to a corpus: export it with '
           '`python -m mlm_jax.export`, or set config.tokenizer.model_file to the sentencepiece '
           'model its vocabulary was made with.')
  _check(d.num_workers >= 0,
         f'config.data.num_workers={d.num_workers} must be >= 0 (0: one per core).')
  _check(bool(d.text_key), "config.data.text_key is empty; name the text field, e.g. 'text'.")
  if not check_paths:
    return
  try:
    corpus_lib.check(config.data)
  except corpus_lib.CorpusError as e:
    raise ConfigError(str(e)) from None


def resolve(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """The config a run uses: checked (ConfigError), with implied settings filled in.

  A run started from config.init.hf_dir tokenizes with that model's vocabulary.
  """
  validate(config, num_devices=num_devices)
  if not config.init.hf_dir or config.tokenizer.model_file:
    return config
  config = config.copy_and_resolve_references()
  config.tokenizer.model_file = os.path.join(os.path.expanduser(config.init.hf_dir),
                                             'tokenizer.model')
  return config


def concurrent_chains(train: ml_collections.ConfigDict, num_devices: int,
                      platform: str | None = None) -> int:
  """config.train.concurrent_chains with 0 (auto) resolved for `platform` (default: JAX's backend).

  Auto is 2 when the step runs on a single CPU device with at least 2 cores
  and each micro-batch splits evenly (tiny config on 2 cores: 4-13% faster
  per step in A/B runs), else 1: accelerators run each kernel on the whole
  chip already, and smaller parts only shrink the kernels.
  """
  chains = train.get('concurrent_chains', 0)
  if chains:
    return chains
  rows = train.batch_size // (num_devices * train.grad_accum_steps)
  platform = platform or jax.default_backend()
  if (platform == 'cpu' and num_devices == 1 and (os.cpu_count() or 1) >= 2
      and rows % 2 == 0):
    return 2
  return 1


def compute_dtype(name: str, platform: str | None = None):
  """config.model.dtype as a dtype; 'auto' is float32 on a CPU and bfloat16 on GPUs and TPUs.

  `platform` is where the step runs (default: JAX's backend here).
  """
  if name == 'auto':
    return jnp.float32 if (platform or jax.default_backend()) == 'cpu' else jnp.bfloat16
  return jnp.dtype(name)
