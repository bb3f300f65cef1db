"""The encoder a fine-tuning starts from: a pretraining run (--workdir) or a published
Hugging Face checkpoint (--hf_dir).

Either gives the same things: the encoder's config.model section (what
model.json records and ModelConfig is built from), its parameters as host
arrays, its tokenizer, and the row length it was trained with when known.

  --workdir  the run's latest checkpoint, config.json and tokenizer
             (training/workdir.py); rows as long as the run's data.seq_len
  --hf_dir   a BertForMaskedLM, RobertaForMaskedLM or ModernBertForMaskedLM
             directory (safetensors or pytorch_model.bin) with its tokenizer
             files (interop/hf.py reads both), or a hub id org/name[@revision]
             resolved through the Hugging Face cache (interop/hub.py), recorded
             as org/name@commit; its architecture and shape from its
             config.json, how we run it (attention kernel, remat, ...) from RUN_AS; no
             row length (the data picks one, loop.read_task_data)
  from_finetuned  a fine-tuned model's encoder (and its head's hidden layer), for
             a task that starts from another's model (GLUE's RTE from MNLI's)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.errors import ConfigError
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import model_dir
from mlm_jax.training import workdir as workdir_lib

# How a published checkpoint's encoder runs here: the config.model fields its config.json does
# not decide (interop/hf.py's checkpoint_fields give the rest). The ModernBERT-only fields are
# read by variant 'modern' alone, whose config.json gives them; for the BERT family, every
# layer attends globally, as BERT's do. Token types: the BERT family's config.json gives
# them; ModernBERT has none, and its encoder reads none (2, the default of configs/base.py).
RUN_AS = {'dtype': 'auto', 'attention': 'auto', 'document_mask': False,
          'restart_positions': False, 'scan_layers': False, 'remat': 'none',
          'drop_token_rate': 0.0, 'global_attn_every_n_layers': 1, 'local_attention': 128,
          'global_rope_theta': 10_000.0, 'local_rope_theta': 10_000.0, 'type_vocab_size': 2,
          # No config.json holds FlexBERT's attn_out_dropout_prob.
          'attention_output_dropout_rate': 0.0}


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """An encoder to fine-tune, whichever kind of directory it came from."""

  source: dict[str, Any]         # model.json's 'pretrained': {'workdir', 'step'} or {'hf_dir'}.
  description: str               # For logs: 'WORKDIR step N' or 'HF_DIR'.
  model_section: dict[str, Any]  # config.model's fields (variant, shape, dropout, ...).
  model_cfg: model_lib.ModelConfig   # float32, from model_section and the embedding rows.
  params: dict[str, Any]         # Host arrays: 'encoder' (and 'sentence_pair' where there is one).
  tokenizer: tok_lib.Tokenizer
  seq_len: int | None            # The pretraining rows' length; None: unknown (choose from data).


def load(workdir: str | None = None, hf_dir: str | None = None) -> Pretrained:
  """The encoder of exactly one of `workdir` and `hf_dir`; ConfigError if both or neither."""
  if bool(workdir) == bool(hf_dir):
    raise ConfigError('name exactly one model to fine-tune: --workdir (an mlm_jax pretraining '
                      'run) or --hf_dir (a Hugging Face masked-LM directory).')
  return from_workdir(workdir) if workdir else from_hf_dir(hf_dir)


def from_workdir(workdir: str) -> Pretrained:
  run = workdir_lib.load(workdir)
  return Pretrained(source={'workdir': run.workdir, 'step': run.step},
                    description=f'{run.workdir} step {run.step}',
                    model_section=run.config.model.to_dict(), model_cfg=run.model_cfg,
                    params=run.params, tokenizer=run.tokenizer, seq_len=run.config.data.seq_len)


def from_finetuned(out_dir: str) -> Pretrained:
  """The encoder of a fine-tuned model (OUT/best), to fine-tune on another task: RoBERTa's
  and ModernBERT's GLUE protocols start RTE, MRPC and STS-B from the MNLI model.

  The head's hidden layer comes with it, as Hugging Face's
  `from_pretrained(..., ignore_mismatched_sizes=True)` keeps it from the same
  file (BERT's pooler, RoBERTa's classifier.dense, ModernBERT's head dense and
  norm: shapes that do not depend on the labels); the classifier starts
  fresh. Rows: the length it was fine-tuned with.
  """
  model = model_dir.load(out_dir)
  with open(os.path.join(model.out_dir, model_dir.MODEL_FILE)) as f:
    record = json.load(f)
  head = model.params['head']
  params = {'encoder': model.params['encoder']}
  if 'pooler' in head:
    params['sentence_pair'] = {'pooler': head['pooler']}
  if 'transform' in head:
    params['mlm_head'] = {'transform': head['transform'], 'layer_norm': head['layer_norm']}
  return Pretrained(source={'finetuned': model.out_dir, 'step': model.step,
                            'task': model.task, 'from': record['pretrained']},
                    description=f'{model.out_dir} step {model.step} (fine-tuned: {model.task})',
                    model_section=record['model'], model_cfg=model.model_cfg, params=params,
                    tokenizer=model.tokenizer, seq_len=model.seq_len)


def from_hf_dir(hf_dir: str) -> Pretrained:
  """A published (or exported) masked LM: weights, config.json and tokenizer files.

  Raises ConfigError naming the directory for a missing or unsupported
  model, or a tokenizer whose ids the embedding table cannot hold.
  """
  from mlm_jax.interop import hf  # pylint: disable=import-outside-toplevel  # interop extra
  from mlm_jax.interop import hub  # pylint: disable=import-outside-toplevel
  try:
    resolved = hub.resolve(hf_dir, '--hf_dir')
  except ValueError as e:
    raise ConfigError(str(e)) from e
  source = {'hf_dir': resolved.pinned} if resolved.pinned else {}
  hf_dir = os.path.abspath(resolved.local_dir)
  if not os.path.isdir(hf_dir):
    raise ConfigError(f'--hf_dir={hf_dir}: no such directory, nor a hub id (org/name or '
                      'org/name@revision).')
  try:
    fields = hf.checkpoint_model_fields(hf_dir)
    tokenizer = tok_lib.load(hf_dir)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'--hf_dir={hf_dir}: {e}') from e
  section = ml_collections.ConfigDict({**RUN_AS, **fields})
  vocab_size = fields['vocab_size']
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f'--hf_dir={hf_dir}: its tokenizer has {tokenizer.vocab_size:,} ids but the '
                      f'model\'s embedding table only {vocab_size:,} rows: they do not belong '
                      'together. Use the tokenizer files the checkpoint was published with.')
  model_cfg = model_lib.ModelConfig.from_config(
      section, vocab_size, tok_lib.padded_vocab_size(vocab_size), jnp.float32,
      platform=model_lib.local_platform())
  try:
    params = _hf_params(hf, hf_dir, model_cfg)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'--hf_dir={hf_dir}: {e}') from e
  # A hub id is recorded as 'org/name@commit' (the files read), a directory as its path.
  source = source or {'hf_dir': hf_dir}
  description = f'{source["hf_dir"]} ({hf_dir})' if resolved.pinned else hf_dir
  return Pretrained(source=source, description=description,
                    model_section=section.to_dict(), model_cfg=model_cfg, params=params,
                    tokenizer=tokenizer, seq_len=None)


def _hf_params(hf: Any, hf_dir: str, cfg: model_lib.ModelConfig) -> dict[str, Any]:
  """The checkpoint's encoder, and what Hugging Face's ...ForSequenceClassification would take
  from the same file for its head: BERT's pooler (as 'sentence_pair' holds a pretraining run's),
  ModernBERT's MLM head dense + norm (its classifier head has the same tensors). A RoBERTa
  classifier's dense layer starts fresh there, so its pooler is not taken."""
  tensors = hf.read_weights(hf_dir)
  fmt = hf.FORMATS[cfg.variant]
  named = fmt.canonical_names(tensors)
  params = hf.from_hf_state_dict(tensors, cfg, fallback_params=_zero_head(cfg), source=hf_dir,
                                 pad_id=hf.read_hf_config(hf_dir).get('pad_token_id'))
  out = {'encoder': params['encoder']}
  if cfg.variant == 'modern' and fmt.head_tensor in named:
    out['mlm_head'] = params['mlm_head']
  pooler = 'bert.pooler.dense'
  if cfg.variant == 'bert' and f'{pooler}.weight' in named:
    out['sentence_pair'] = {'pooler': {
        'kernel': np.asarray(named[f'{pooler}.weight'], np.float32).T,
        'bias': np.asarray(named[f'{pooler}.bias'], np.float32)}}
  return out


def _zero_head(cfg: model_lib.ModelConfig) -> dict[str, Any]:
  """An MLM head of the model's shapes (zeros, never used): what a base-model file (BertModel,
  ModernBertModel: no head) is completed with, since fine-tuning keeps only the encoder."""
  model = model_lib.mlm_model(cfg)
  example = {'input_ids': np.zeros((1, 8), np.int32), 'segment_ids': np.zeros((1, 8), np.int32),
             'attention_mask': np.ones((1, 8), np.int32),
             'masked_positions': np.zeros((1, 1), np.int32)}
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), example, deterministic=True))
  return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), nn.unbox(shapes['params']))
