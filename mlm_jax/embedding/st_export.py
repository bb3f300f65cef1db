"""An embedding model as a sentence-transformers directory (export --workdir of an embed run).

Writes, from an encoder's parameters, ModelConfig, tokenizer and how its
vectors are made (pooling, row length, prompts):

  OUT/config.json, model.safetensors   the encoder as a Hugging Face base model
                              (BertModel, RobertaModel, XLMRobertaModel, CamembertModel,
                              DistilBertModel or ModernBertModel): the masked LM's tensors
                              of the pretraining export (interop/), without the MLM head
                              and its prefix, which a contrastive model does not train
  OUT/tokenizer.json ...      the tokenizer, as the pretraining export writes it
  OUT/modules.json            [Transformer at the root, Pooling in 1_Pooling]
  OUT/sentence_bert_config.json   max_seq_length (our row length), do_lower_case false
  OUT/1_Pooling/config.json   the pooling mode and width
  OUT/config_sentence_transformers.json   the prompts ('query', 'document') where set,
                              similarity cosine

so that `SentenceTransformer(OUT).encode(texts)` gives our vectors (to 1e-5
in float32; `prompt_name='query'` or `encode_query` adds the query prompt).
The module names and Pooling's keys are the hub's long-standing ones
(`sentence_transformers.models.Transformer`, `pooling_mode_mean_tokens`, ...),
which every sentence-transformers release reads (6.x maps them onto its
own). AutoModel (and finetune/embed --hf_dir) load the directory as the
encoder; AutoModelForMaskedLM would find no head. A BERT export has no
pooler either, which BertModel reports as newly initialised: the vectors
never read it. Needs the interop extra (safetensors, tokenizers), not torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.embedding import model as embed_model
from mlm_jax.embedding import run_dir
from mlm_jax.interop import hf
from mlm_jax.interop import mlm_export
from mlm_jax.interop.layout import get_path

POOLING_DIR = '1_Pooling'
# Pooling's keys as the hub's models and every sentence-transformers release write them.
_POOLING_KEYS = {'cls': 'pooling_mode_cls_token', 'max': 'pooling_mode_max_tokens',
                 'mean': 'pooling_mode_mean_tokens',
                 'mean_sqrt_len_tokens': 'pooling_mode_mean_sqrt_len_tokens',
                 'weightedmean': 'pooling_mode_weightedmean_tokens',
                 'lasttoken': 'pooling_mode_lasttoken'}


def base_model_tensors(params: dict[str, Any], cfg: model_lib.ModelConfig,
                       pad_id: int) -> dict[str, np.ndarray]:
  """The encoder's tensors under the base model's names (the masked LM's, prefix dropped),
  float32, without vocabulary padding rows. `params` holds 'encoder'."""
  if cfg.scan_layers:
    params = model_lib.unstack_layers(params, cfg.num_layers)
  fmt = hf.model_format(cfg)
  prefix = fmt.embedding_tensor.split('.')[0] + '.'   # 'bert.', 'roberta.', 'model.', ...
  out = {}
  for t in fmt.layout(cfg, fmt.position_offset(pad_id)):
    if t.path[0] != 'encoder':
      continue
    x = np.asarray(get_path(params, t.path), np.float32)
    out[t.hf_name.removeprefix(prefix)] = t.to_hf(x[:t.shape[0]])  # Only the token table pads.
  return out


def write(out_dir: str, encoder: dict[str, Any], cfg: model_lib.ModelConfig,
          tokenizer: tok_lib.Tokenizer, *, pooling: str, seq_len: int, query_prompt: str = '',
          document_prompt: str = '') -> str:
  """Writes the sentence-transformers directory `out_dir`; returns the base model's class."""
  numpy_io = hf.require('safetensors.numpy')
  fmt = mlm_export.export_format(cfg, tokenizer)   # XLM-R's, CamemBERT's by the tokenizer.
  config = hf.to_hf_config(cfg, tokenizer.specials, fmt) | {'architectures': [fmt.base_model]}
  config.pop('tie_word_embeddings', None)     # A base model has no decoder to tie.
  os.makedirs(os.path.join(out_dir, POOLING_DIR), exist_ok=True)
  _write_json(os.path.join(out_dir, 'config.json'), config)
  # transformers refuses safetensors files without format metadata.
  numpy_io.save_file(base_model_tensors({'encoder': encoder}, cfg, tokenizer.specials.pad),
                     os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
  hf.save_tokenizer(out_dir, tokenizer, cfg.max_position_embeddings, fmt=fmt)
  _write_json(os.path.join(out_dir, 'modules.json'), [
      {'idx': 0, 'name': '0', 'path': '', 'type': 'sentence_transformers.models.Transformer'},
      {'idx': 1, 'name': '1', 'path': POOLING_DIR, 'type': 'sentence_transformers.models.Pooling'}])
  _write_json(os.path.join(out_dir, 'sentence_bert_config.json'),
              {'max_seq_length': seq_len, 'do_lower_case': False})
  mode = embed_model.ST_POOLING[pooling]
  _write_json(os.path.join(out_dir, POOLING_DIR, 'config.json'),
              {'word_embedding_dimension': cfg.hidden_size,
               **{key: name == mode for name, key in _POOLING_KEYS.items()},
               'include_prompt': True})
  prompts = {name: text for name, text in (('query', query_prompt),
                                           ('document', document_prompt)) if text}
  _write_json(os.path.join(out_dir, 'config_sentence_transformers.json'), {
      '__version__': {'mlm_jax': _version()}, 'model_type': 'SentenceTransformer',
      'prompts': prompts, 'default_prompt_name': None, 'similarity_fn_name': 'cosine'})
  return fmt.base_model


def export(run_path: str, out_dir: str, step: int | None = None) -> run_dir.EmbedRun:
  """Writes checkpoint `step` (None: the latest) of the embed run in `run_path` as a
  sentence-transformers directory in `out_dir`; returns the run."""
  mlm_export.require_extras()  # Fail before any work, naming the extra to install.
  run = run_dir.load(run_path, step)
  rec = run.record
  write(out_dir, run.params['encoder'], run.model_cfg, run.tokenizer, pooling=rec['pooling'],
        seq_len=rec['seq_len'], query_prompt=rec['query_prompt'],
        document_prompt=rec['document_prompt'])
  return run


def _write_json(path: str, value: Any) -> None:
  with open(path, 'w') as f:
    json.dump(value, f, indent=2)


def _version() -> str:
  try:
    return importlib.metadata.version('mlm_jax')
  except importlib.metadata.PackageNotFoundError:
    return 'unknown'
