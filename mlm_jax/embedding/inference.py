"""Texts to vectors on the mesh, with an embed run's model or any encoder's mean-pooled vectors.

A TextEncoder is an encoder's parameters with the way its vectors are made
(pooling, row length, prompts). `embed` encodes texts in padded global
batches sharded over every device (each process feeding its rows) and
returns float32 vectors [N, d] on the host, in order, padding dropped. The
encoder computes in float32 whatever the platform, so that the vectors are
the ones a float32 export gives in sentence-transformers.

Sources: an embed run (its pooling, row length and prompts), or the encoder
of a pretraining run or a Hugging Face checkpoint as it was before any
contrastive training: mean pooling, no prompts (the baseline an embed run
is measured against).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.embedding import data as data_lib
from mlm_jax.embedding import model as embed_model
from mlm_jax.embedding import run_dir
from mlm_jax.finetuning import config as finetune_config
from mlm_jax.finetuning import data as finetune_data
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import pretrained as pretrained_lib
from mlm_jax.finetuning import task_eval
from mlm_jax.runtime import sharding

# Texts tokenized and encoded at a time by `embed` (their rows are all the host holds).
TEXT_BLOCK = 65_536


@dataclasses.dataclass(frozen=True)
class TextEncoder:
  """An encoder and how its vectors are made; `embed` runs it."""

  description: str
  model_cfg: model_lib.ModelConfig   # float32, this host's platform.
  encoder: dict[str, Any]            # Host arrays: the encoder's parameters.
  tokenizer: tok_lib.Tokenizer
  pooling: str
  seq_len: int | None                # None: fitted to each call's texts (at most the table's).
  query_prompt: str = ''
  document_prompt: str = ''

  @property
  def row_format(self) -> finetune_data.RowFormat:
    return model_dir.row_format(self.tokenizer, self.model_cfg)

  def rows(self, texts: Sequence[str]) -> data_lib.Rows:
    """[CLS] text [SEP] rows of the encoder's length (or the texts' longest, rounded up to 8)."""
    limit = self.model_cfg.max_position_embeddings
    length = self.seq_len or min(limit, finetune_config.AUTO_SEQ_LEN_LIMIT)
    rows = data_lib.encode_texts(texts, self.tokenizer, length, self.row_format)
    if self.seq_len is None:
      multiple = finetune_config.SEQ_LEN_MULTIPLE
      rows = rows.trimmed(min(length, -(-rows.longest() // multiple) * multiple))
    return rows

  def embed(self, texts: Sequence[str], batch_size: int = 64, mesh=None,
            prompt: str = '') -> np.ndarray:
    """[N, d] float32: the vectors of `prompt` + each text, computed on `mesh` (default: every
    device); `batch_size` texts per batch over all devices (a multiple of the devices). With
    no row length of its own, each block of texts gets its longest text's (padding changes
    no vector)."""
    mesh = mesh or sharding.make_mesh()
    apply = _embed_fn(self.model_cfg, self.pooling, mesh)
    params = jax.device_put({'encoder': self.encoder}, sharding.replicated(mesh))
    out = [np.zeros((0, self.model_cfg.hidden_size), np.float32)]
    # A block of texts at a time: the host holds one block's rows, not a whole corpus's.
    for start in range(0, len(texts), TEXT_BLOCK):
      rows = self.rows([prompt + t for t in texts[start:start + TEXT_BLOCK]])
      out.append(task_eval.all_logits(lambda batch: apply(params, batch), rows.encoded(),
                                      batch_size, mesh))
    return np.concatenate(out)

  def embed_queries(self, texts: Sequence[str], batch_size: int = 64, mesh=None) -> np.ndarray:
    return self.embed(texts, batch_size, mesh, self.query_prompt)

  def embed_documents(self, texts: Sequence[str], batch_size: int = 64, mesh=None) -> np.ndarray:
    return self.embed(texts, batch_size, mesh, self.document_prompt)


@functools.lru_cache(maxsize=8)
def _embed_fn(cfg: model_lib.ModelConfig, pooling: str, mesh) -> Any:
  """jit(params, batch) -> vectors [B, d], replicated; one compilation per model and row length."""
  model = embed_model.Embedder(cfg, pooling)

  def apply(params, batch):
    rows = {k: batch[k] for k in ('input_ids', 'segment_ids', 'attention_mask')}
    return model.apply({'params': params}, rows, deterministic=True)

  return jax.jit(sharding.traced_on(apply, mesh),
                 in_shardings=(sharding.replicated(mesh), sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def from_run(out_dir: str, step: int | None = None) -> TextEncoder:
  """An embed run's model at checkpoint `step` (None: the latest)."""
  run = run_dir.load(out_dir, step)
  rec = run.record
  return TextEncoder(f'{run.out_dir} step {run.step}', run.model_cfg, run.params['encoder'],
                     run.tokenizer, rec['pooling'], rec['seq_len'], rec['query_prompt'],
                     rec['document_prompt'])


def from_pretrained(pretrained: pretrained_lib.Pretrained, pooling: str = 'mean',
                    seq_len: int | None = None, query_prompt: str = '',
                    document_prompt: str = '') -> TextEncoder:
  """A pretraining run's or Hugging Face checkpoint's encoder, untrained for embeddings.

  seq_len None: the pretraining run's row length, else fitted to the texts.
  """
  cfg = dataclasses.replace(pretrained.model_cfg, platform=model_lib.local_platform())
  return TextEncoder(f'{pretrained.description} (before contrastive training, {pooling} '
                     'pooling)', cfg, pretrained.params['encoder'], pretrained.tokenizer,
                     pooling, seq_len or pretrained.seq_len, query_prompt, document_prompt)


def load(workdir: str | None = None, hf_dir: str | None = None,
         step: int | None = None) -> TextEncoder:
  """An embed run's model (`workdir` holding embedding.json), else the mean-pooled encoder of
  a pretraining run (`workdir`) or a Hugging Face checkpoint (`hf_dir`); exactly one."""
  if workdir and run_dir.is_embed_run(workdir):
    return from_run(workdir, step)
  return from_pretrained(pretrained_lib.load(workdir, hf_dir))
