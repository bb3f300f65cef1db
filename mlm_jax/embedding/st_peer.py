"""The sentence-transformers peer of an embed run (--compare=st): the same training, in PyTorch.

From what an embed run recorded, it trains the model the run started from
with sentence-transformers' own trainer and loss:

  model      the run's starting encoder exported as a sentence-transformers
             directory (st_export.py), with the run's pooling and row length
  data       the run's pairs, prompts already in the texts, as columns
             anchor, positive, negative_1..K, in the run's exact batches: the
             dataset is the run's stream of steps laid end to end and read in
             order (a sequential batch sampler), batch_size pairs per step
  loss       MultipleNegativesRankingLoss (CachedMultipleNegativesRankingLoss
             with the run's mini_batch_size) with scale 1 / temperature and,
             for a symmetric run, directions query_to_doc and doc_to_query,
             partition_mode 'per_direction' (the same sums as loss.py)
  optimizer  SentenceTransformerTrainer's AdamW (torch) with the run's peak
             learning rate, warm-up steps, linear decay, betas, epsilon,
             weight decay (not on biases and LayerNorms) and clipping norm

What differs, and why the two columns agree only within seed noise: the
dropout masks (torch's generator, not JAX's), float rounding in different
kernels, and a learned temperature, which the library's loss does not have
(the peer keeps the starting one; the results say so). Needs
sentence-transformers 6 or later (its module paths and the loss's `directions`), `datasets`
and `accelerate` (the interop extra).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from absl import logging

from mlm_jax.embedding import data as data_lib
from mlm_jax.embedding import run_dir
from mlm_jax.embedding import st_export
from mlm_jax.errors import ConfigError
from mlm_jax.finetuning import pretrained as pretrained_lib

# What a finished peer leaves beside its model: the protocol it trained with.
_DONE_FILE = 'peer.json'


def _require(module: str) -> Any:
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f'--compare=st needs {module.split(".")[0]}: '
                      "pip install -e '.[interop]'") from e


def protocol(run_path: str) -> dict[str, Any]:
  """What the peer trains with, read from the embed run (its record and resolved config)."""
  rec, config = run_dir.read_record(run_path), run_dir.read_config(run_path)
  train, resolved = config['train'], config['resolved']
  return {'train_data': rec['train_data'], 'pooling': rec['pooling'], 'seq_len': rec['seq_len'],
          'batch_size': train['batch_size'], 'mini_batch_size': train['mini_batch_size'],
          'num_steps': resolved['num_steps'], 'warmup_steps': resolved['warmup_steps'],
          'learning_rate': resolved['learning_rate'], 'schedule': train['schedule'],
          'weight_decay': train['weight_decay'], 'adam_b1': train['adam_b1'],
          'adam_b2': train['adam_b2'], 'adam_eps': train['adam_eps'],
          'grad_clip_norm': train['grad_clip_norm'], 'temperature': rec['temperature'],
          'learned_temperature_here': rec['learn_temperature'], 'symmetric': rec['symmetric'],
          'seed': config['seed'], 'query_prompt': rec['query_prompt'],
          'document_prompt': rec['document_prompt'], 'num_negatives': rec['num_negatives'],
          'data': config['data'], 'start': rec['pretrained']}


def _start_model(rec: dict[str, Any]) -> pretrained_lib.Pretrained:
  """The encoder the run started from, as it was then."""
  source = rec['pretrained']
  if 'workdir' in source:
    start = pretrained_lib.from_workdir(source['workdir'])
    if source.get('step') is not None and start.source['step'] != source['step']:
      raise ConfigError(f"--compare=st: the run started from step {source['step']} of "
                        f"{source['workdir']}, whose latest checkpoint is now step "
                        f"{start.source['step']}: the peer would start elsewhere.")
    return start
  if 'hf_dir' in source:
    return pretrained_lib.from_hf_dir(source['hf_dir'])
  raise ConfigError(f'--compare=st: the run started from {source}, which the peer cannot read.')


def train(run_path: str, peer_dir: str) -> str:
  """Trains the peer of the embed run in `run_path` into `peer_dir` (once: a finished peer
  with the same protocol is reused); returns its sentence-transformers directory."""
  plan = protocol(run_path)
  model_path = os.path.join(peer_dir, 'model')
  done = os.path.join(peer_dir, _DONE_FILE)
  if os.path.exists(done):
    with open(done) as f:
      if json.load(f) == json.loads(json.dumps(plan)):
        return model_path
  if plan['schedule'] != 'linear':
    raise ConfigError(f"--compare=st: the run's schedule {plan['schedule']!r} has no "
                      "counterpart in the peer's trainer here; compare runs with 'linear'.")
  st = _require('sentence_transformers')
  losses = _require('sentence_transformers.sentence_transformer.losses')
  sampler = _require('sentence_transformers.base.sampler')
  datasets = _require('datasets')
  torch = _require('torch')
  _require('accelerate')
  rec = run_dir.read_record(run_path)
  start = _start_model(rec)
  start_dir = os.path.join(peer_dir, 'start')
  st_export.write(start_dir, start.params['encoder'], start.model_cfg, start.tokenizer,
                  pooling=plan['pooling'], seq_len=plan['seq_len'],
                  query_prompt=plan['query_prompt'], document_prompt=plan['document_prompt'])
  columns = _columns(plan)
  model = st.SentenceTransformer(start_dir, device='cpu')
  scale = 1.0 / plan['temperature']
  directions = ('query_to_doc', 'doc_to_query') if plan['symmetric'] else ('query_to_doc',)
  if plan['mini_batch_size']:
    loss = losses.CachedMultipleNegativesRankingLoss(
        model, scale=scale, mini_batch_size=plan['mini_batch_size'], directions=directions,
        partition_mode='per_direction')
  else:
    loss = losses.MultipleNegativesRankingLoss(model, scale=scale, directions=directions,
                                                  partition_mode='per_direction')

  def in_order(dataset, batch_size, drop_last, **_):
    # The run's batches: the dataset is its stream of steps, read front to back.
    return sampler.DefaultBatchSampler(torch.utils.data.SequentialSampler(dataset),
                                               batch_size=batch_size, drop_last=drop_last)

  args = st.SentenceTransformerTrainingArguments(
      output_dir=os.path.join(peer_dir, 'trainer'), per_device_train_batch_size=plan['batch_size'],
      max_steps=plan['num_steps'], learning_rate=plan['learning_rate'],
      warmup_steps=plan['warmup_steps'], lr_scheduler_type='linear', optim='adamw_torch',
      weight_decay=plan['weight_decay'], adam_beta1=plan['adam_b1'], adam_beta2=plan['adam_b2'],
      adam_epsilon=plan['adam_eps'], max_grad_norm=plan['grad_clip_norm'], seed=plan['seed'],
      batch_sampler=in_order, dataloader_drop_last=False, save_strategy='no', report_to='none',
      logging_steps=max(plan['num_steps'] // 10, 1), use_cpu=True, disable_tqdm=True)
  trainer = st.SentenceTransformerTrainer(model=model, args=args,
                                          train_dataset=datasets.Dataset.from_dict(columns),
                                          loss=loss)
  logging.info('Training the sentence-transformers peer of %s: %d steps of %d pairs',
               run_path, plan['num_steps'], plan['batch_size'])
  trainer.train()
  model.save(model_path)
  with open(done, 'w') as f:
    json.dump(plan, f, indent=2)
  return model_path


def _columns(plan: dict[str, Any]) -> dict[str, list[str]]:
  """anchor, positive, negative_1..K of every step's pairs, step after step."""
  data = plan['data']
  pairs = data_lib.read_pairs(plan['train_data'], data_lib.PairFields.from_config(data),
                              data['beir_split'])
  texts, query, documents = data_lib.index_pairs(pairs, plan['num_negatives'],
                                                 plan['query_prompt'], plan['document_prompt'])
  if (documents < 0).any():
    raise ConfigError('--compare=st: some pairs have fewer hard negatives than '
                      f"{plan['num_negatives']}, which sentence-transformers' loss cannot mask; "
                      'compare with config.data.num_negatives set to the fewest any pair has.')
  order = data_lib.PairBatches(data_lib.EncodedPairs(None, query, documents), plan['batch_size'],
                               plan['seed'])
  index = [i for step in range(plan['num_steps']) for i in order.pair_indices(step)]
  columns = {'anchor': [texts[query[i]] for i in index],
             'positive': [texts[documents[i, 0]] for i in index]}
  for j in range(1, documents.shape[1]):
    columns[f'negative_{j}'] = [texts[documents[i, j]] for i in index]
  return columns


def encoder(model_path: str) -> Any:
  """The peer's trained model, for encoding (sentence-transformers' SentenceTransformer)."""
  st = _require('sentence_transformers')
  return st.SentenceTransformer(model_path, device='cpu')
