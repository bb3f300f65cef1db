"""The embed driver: read and check the pairs -> build -> resume -> loop -> checkpoints.

`embed(...)` reads top to bottom like fine-tuning's loop (finetuning/loop.py)
and reuses its parts: the encoder to start from (finetuning/pretrained.py),
the mesh and the host-to-device boundary (runtime/, training/feed.py), the
optimizer and schedules, Orbax checkpoints, metrics.jsonl and TensorBoard,
the progress log, stopping on a signal. Every file is read and checked
before anything is compiled. What must stay true: a run stopped at any step
and started again with the same command continues with the same pairs,
dropout and schedule as one that was never stopped (the pair order is a
function of (seed, step), the state is the checkpoint's).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import ml_collections
from absl import logging

from mlm_jax import model as model_lib
from mlm_jax.embedding import config as config_lib
from mlm_jax.embedding import data as data_lib
from mlm_jax.embedding import run_dir
from mlm_jax.embedding import step as step_lib
from mlm_jax.errors import require
from mlm_jax.finetuning import config as finetune_config
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import pretrained as pretrained_lib
from mlm_jax.finetuning import report as report_lib
from mlm_jax.runtime import sharding
from mlm_jax.training import checkpoint
from mlm_jax.training import feed as feed_lib
from mlm_jax.training import lock
from mlm_jax.training import metrics
from mlm_jax.training import preemption


def embed(workdir: str | None, out_dir: str, train_path: str, config: ml_collections.ConfigDict,
          *, hf_dir: str | None = None) -> dict[str, Any]:
  """Trains the encoder of the pretraining run in `workdir`, or of the Hugging Face masked LM
  in `hf_dir` (exactly one), into an embedding model on the pairs of `train_path`, in
  `out_dir` (resuming there).

  Returns the step reached, the last log interval's loss and in-batch
  accuracy, and the wall time. One run at a time per `out_dir`.
  """
  out_dir = os.path.abspath(out_dir)
  with lock.hold(out_dir):
    return _embed(workdir, out_dir, train_path, config, hf_dir=hf_dir)


def _embed(workdir: str | None, out_dir: str, train_path: str,
           config: ml_collections.ConfigDict, *, hf_dir: str | None) -> dict[str, Any]:
  start_time, is_main = time.perf_counter(), jax.process_index() == 0
  config_lib.check_config(config, jax.device_count())
  require(not run_dir.is_embed_run(workdir),
          f'--workdir={workdir} is an embed run; to train it further, export it (python -m '
          f'mlm_jax.export --workdir={workdir} --out=DIR) and start from --hf_dir=DIR.')
  # ------------------------------------------------ pretrained model, data
  pretrained = pretrained_lib.load(workdir, hf_dir)
  model_cfg, model_section = _model_config(pretrained, config)
  pairs = read_pairs(train_path, config.data, pretrained, model_cfg)
  train_path = os.path.abspath(train_path)
  record = run_dir.record(
      pooling=config.model.pooling, seq_len=pairs.rows.input_ids.shape[1],
      query_prompt=config.data.query_prompt, document_prompt=config.data.document_prompt,
      num_negatives=pairs.num_negatives, loss=config.loss.to_dict(), model_cfg=model_cfg,
      model_section=model_section, pretrained=pretrained.source, train_data=train_path,
      tokenizer=pretrained.tokenizer)
  run_dir.check_resumable(out_dir, record)
  plan = config_lib.plan(config.train, len(pairs), model_cfg.hidden_size)
  train = plan.train_section(config.train)
  # ----------------------------------------------------------------- build
  mesh = sharding.make_mesh(config.mesh.fsdp)
  built = step_lib.build(model_cfg, config.model.pooling, config.loss, train, record['seq_len'],
                         config.seed, mesh)
  # ---------------------------------------------------------------- resume
  checkpointer = checkpoint.Checkpointer(run_dir.checkpoint_dir(out_dir), train)
  meta = run_dir.checkpoint_meta(model_cfg, record)
  state, start_step = checkpointer.restore_or_init(built.abstract_state, built.init_state, meta)
  if start_step:
    logging.info('Resumed from %s at step %d', checkpointer.directory, start_step)
  else:
    state = step_lib.with_encoder(state, pretrained.params['encoder'], pretrained.description)
  resolved = config.to_dict() | {'resolved': dataclasses.asdict(plan) | {
      'seq_len': record['seq_len'], 'train_pairs': len(pairs), 'texts': len(pairs.rows),
      'truncated': pairs.rows.truncated, 'num_negatives': pairs.num_negatives,
      'num_devices': jax.device_count(), 'backend': jax.default_backend()}}
  if is_main:
    run_dir.write(out_dir, record, resolved, pretrained.tokenizer)
  logging.info('Contrastive training of %s (%s, %s pooling): %d steps of %d pairs (%d hard '
               'negatives each, %d per step in all), peak learning rate %.3g',
               pretrained.description, model_cfg.variant, config.model.pooling, plan.num_steps,
               train.batch_size, pairs.num_negatives,
               train.batch_size * (1 + pairs.num_negatives) - 1, plan.learning_rate)
  # ------------------------------------------------------------------ loop
  host_batches = data_lib.PairBatches(pairs, train.batch_size, config.seed, start_step,
                                      jax.process_index(), jax.process_count())
  feed = feed_lib.DeviceFeed(host_batches, mesh)
  log = report_lib.FinetuneLog(
      metrics.MetricsWriter(out_dir, enabled=is_main, tensorboard=train.tensorboard,
                            hparams=resolved, start_step=start_step),
      start_step=start_step, num_steps=plan.num_steps, show=is_main,
      checkpoint_dir=checkpointer.directory)
  stop = preemption.StopRequest(multi_process=jax.process_count() > 1)
  step, stopping, last = start_step, False, {}
  try:
    with stop:
      while step < plan.num_steps and not stopping:
        state, step_metrics = built.train_step(state, feed.pop(), built.dropout_rng)
        feed.fill()  # The next batch goes to the devices while this step runs.
        step += 1
        stop.poll(step)
        stopping = stop.requested
        log.add(step_metrics)
        if step == start_step + 1:
          log.restart()   # The first step compiles: keep it out of the speed.
        final = step == plan.num_steps or stopping
        if final or step % train.log_every == 0:
          last = log.write(step)
        if final or checkpointer.should_save(step):
          checkpointer.save(step, state, meta, force=final)
  finally:
    log.close()
    checkpointer.wait()
    checkpointer.close()
  if stopping:
    logging.warning('Stopped by %s at step %d; checkpoint saved. Run the same command to '
                    'resume.', stop.signal_name, step)
  elif is_main:
    already = f'(already at step {step}) ' if step == start_step else ''
    figures = (f': loss {last["loss"]:.4f}, in-batch accuracy {last["accuracy"]:.4f}'
               if last else '')
    print(f'{already}step {step}{figures}; the model is in {out_dir} (export it with '
          f'python -m mlm_jax.export --workdir={out_dir} --out=DIR)', flush=True)
  return {'step': step, 'wall_time_s': time.perf_counter() - start_time,
          **{k: last[k] for k in ('loss', 'accuracy') if k in last}}


# ---------------------------------------------------------------- helpers


def read_pairs(path: str, data: ml_collections.ConfigDict, pretrained: pretrained_lib.Pretrained,
               model_cfg: model_lib.ModelConfig) -> data_lib.EncodedPairs:
  """The training pairs read, checked and encoded; truncation logged.

  The row length: data.seq_len, else the pretraining run's, else (a model of
  unknown row length) the longest text rounded up to a multiple of 8, at
  most 512 and the position table.
  """
  limit = model_cfg.max_position_embeddings
  seq_len = data.seq_len or pretrained.seq_len
  require(seq_len is None or seq_len <= limit,
          f'config.data.seq_len={seq_len} exceeds the position table of the pretrained model '
          f'({limit} positions).')
  pairs = data_lib.read_pairs(path, data_lib.PairFields.from_config(data), data.beir_split)
  texts, query, documents = data_lib.index_pairs(pairs, data.num_negatives, data.query_prompt,
                                                 data.document_prompt)
  row_format = model_dir.row_format(pretrained.tokenizer, model_cfg)
  rows = data_lib.encode_texts(texts, pretrained.tokenizer,
                               seq_len or min(limit, finetune_config.AUTO_SEQ_LEN_LIMIT),
                               row_format)
  if seq_len is None:
    multiple = finetune_config.SEQ_LEN_MULTIPLE
    seq_len = min(rows.input_ids.shape[1], -(-rows.longest() // multiple) * multiple)
    rows = rows.trimmed(seq_len)
    logging.info('Rows of %d pieces: the longest text (%d), rounded up to a multiple of %d '
                 '(set --config.data.seq_len to choose).', seq_len, rows.longest(), multiple)
  if rows.truncated:
    logging.warning('%s: %d of %d texts are longer than seq_len=%d pieces and were truncated '
                    '(raise --config.data.seq_len to keep more).', path, rows.truncated,
                    len(rows), seq_len)
  return data_lib.EncodedPairs(rows, query, documents)


def _model_config(pretrained: pretrained_lib.Pretrained, config: ml_collections.ConfigDict
                  ) -> tuple[model_lib.ModelConfig, dict[str, Any]]:
  """The encoder's ModelConfig for training here, and the config.model section it records."""
  section = dict(pretrained.model_section)
  if config.model.dropout_rate is not None:
    section['dropout_rate'] = config.model.dropout_rate
  platform = jax.devices()[0].platform
  dtype = model_lib.compute_dtype(section['dtype'], platform)
  cfg = model_dir.model_config({'model': section, 'vocab_size': pretrained.model_cfg.vocab_size,
                                'padded_vocab_size': pretrained.model_cfg.padded_vocab_size},
                               dtype, platform=platform, sentence_pair_head=False)
  model_lib.check_attention_platform(cfg)
  return cfg, section
