"""The driver: build -> resume -> loop (step, log, evaluate, save) -> summary.

`train_and_evaluate(config, workdir)` reads top to bottom like the data flow
of docs/design.md; each arrow is one call into the module that owns it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from jax.experimental import multihost_utils

from mlm_jax import configuration
from mlm_jax import model as model_lib
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.runtime import host_malloc
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from mlm_jax.training import checkpoint
from mlm_jax.training import evaluate as evaluate_lib
from mlm_jax.training import feed as feed_lib
from mlm_jax.training import metrics
from mlm_jax.training import preemption
from mlm_jax.training import profiling
from mlm_jax.training import report as report_lib
from mlm_jax.training import summary
from mlm_jax.training import workdir as workdir_lib


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains until config.train.num_steps (resuming from `workdir`); returns the run's summary."""
  run_start, is_main = time.perf_counter(), jax.process_index() == 0
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  # ----------------------------------------------------------------- build
  config = configuration.resolve(config, num_devices=jax.device_count())
  data = _prepared_data(config)
  masker = masking.make_masker(config.masking, data.tokenizer.vocab_size, data.unigram_counts,
                               data.tokenizer.pieces())
  workdir_lib.check_tokenizer(workdir, data.tokenizer)
  mesh = sharding.make_mesh(config.mesh.fsdp)
  built = build_lib.build(config, data.tokenizer.vocab_size, mesh,
                          baseline_token=data.most_frequent_token())
  # ---------------------------------------------------------------- resume
  checkpointer = checkpoint.Checkpointer(workdir_lib.checkpoint_dir(workdir), config.train)
  state, start_step = _resume(built, checkpointer, config.init)
  resolved = workdir_lib.resolved_config(config, data)
  if is_main:   # Only once the checkpoints are known to fit: a refused resume keeps the record.
    workdir_lib.record(workdir, resolved, data.tokenizer)
  _log_start(data, built, state, mesh)
  # ------------------------------------------------------------------ loop
  train = config.train
  batches = pipeline.train_batches(
      data.source('train'), masker, global_batch=train.batch_size, seed=config.seed,
      start_step=start_step, process_index=jax.process_index(),
      process_count=jax.process_count(), prefetch=config.input.prefetch,
      worker_count=config.input.worker_count, sentence_pair=config.sentence_pair.task)
  feed = feed_lib.DeviceFeed(batches, mesh)
  log = report_lib.TrainingLog(
      metrics.MetricsWriter(workdir, enabled=is_main, tensorboard=train.tensorboard,
                            hparams=resolved, start_step=start_step),
      feed, start_step=start_step, num_steps=train.num_steps, show=is_main,
      earlier_tokens=summary.tokens_before(metrics.read_metrics(workdir), start_step),
      checkpoint_dir=checkpointer.directory)
  profiler = profiling.StepProfiler(workdir, config.profile, resumed_at=start_step)
  stop = preemption.StopRequest(multi_process=jax.process_count() > 1)
  step, last_eval, stopping = start_step, {}, False
  with stop, _closing(batches, profiler, log, checkpointer):
    while step < train.num_steps and not stopping:
      with profiler.step_context(step + 1):
        state, step_metrics = built.train_step(state, feed.pop(), built.dropout_rng)
      feed.fill()  # The next batch goes to the devices while this step runs.
      step += 1
      stop.poll(step)
      stopping = stop.requested  # Read once: a signal may land at any moment.
      log.add(step_metrics)
      if profiler.after_step(step, (state, step_metrics)):
        log.restart()  # Tracing slowed these steps: keep them out of tokens/s.
      if step == start_step + 1:
        logging.info('First step (compile included) took %.1fs', log.first_step_done())
      final = step == train.num_steps or stopping
      if final or step % train.log_every == 0:  # A stop logs too: a resume knows the tokens.
        log.write(step)
      if step == train.num_steps or step % train.eval_every == 0:
        last_eval = evaluate_lib.evaluate(built.eval_step, state, data, masker, config.eval,
                                          config.sentence_pair.task, mesh)
        log.write_eval(step, last_eval)
      if final or checkpointer.should_save(step):
        # Never save a diverged state: a NaN loss means NaN parameters.
        report_lib.check_finite(float(step_metrics['loss']), step, checkpointer.directory)
        checkpointer.save(step, state, built.model_cfg.shape_record(), force=final)
  if stopping:
    logging.warning('Stopped by %s at step %d; checkpoint saved. Run the same command to '
                    'resume.', stop.signal_name, step)
  # --------------------------------------------------------------- summary
  return _finish(config, built, state, mesh, workdir, log, last_eval, step=step,
                 start_step=start_step, wall_time_s=time.perf_counter() - run_start)


# ---------------------------------------------------------------- helpers


def _prepared_data(config: ml_collections.ConfigDict) -> prepare.PreparedData:
  """Process 0 prepares (if needed); the others wait, then load the same files."""
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      prepare.prepare(config)
    multihost_utils.sync_global_devices('mlm_jax:prepare')
  return prepare.prepare(config)


def _resume(built: build_lib.Built, checkpointer: checkpoint.Checkpointer,
            init: ml_collections.ConfigDict) -> tuple[Any, int]:
  """(state, step): this workdir's latest checkpoint, else a Hugging Face BERT, else fresh."""
  start = time.perf_counter()
  state = built.init_state()  # Initialised under jit straight into its sharding.
  logging.info('Train state initialised in %.1fs', time.perf_counter() - start)
  start_step = checkpointer.latest_step() or 0
  if start_step:
    state = checkpointer.restore(start_step, state, built.model_cfg.shape_record())
    logging.info('Resumed from %s at step %d', checkpointer.directory, start_step)
  elif init.hf_dir:
    from mlm_jax.interop import hf  # pylint: disable=import-outside-toplevel  # interop extra
    try:
      state = hf.init_from_hf(state, os.path.expanduser(init.hf_dir), built.model_cfg)
    except ValueError as e:
      raise configuration.ConfigError(f'config.init.hf_dir={init.hf_dir!r}: {e}') from e
    logging.info('Initialised from the Hugging Face BERT in %s', init.hf_dir)
  return state, start_step


def _log_start(data: prepare.PreparedData, built: build_lib.Built, state: Any, mesh) -> None:
  logging.info('Data: %s (%d train rows, %d validation rows)', data.data_dir,
               data.stats['train']['rows'], data.stats['validation']['rows'])
  size = sharding.state_bytes(state)
  logging.info('Model: %s parameters, compute dtype %s; train state %.1f MiB, %.1f MiB on each '
               'device (mesh data=%d x fsdp=%d); %d concurrent chain(s) per step',
               f'{sum(x.size for x in jax.tree_util.tree_leaves(state.params)):,}',
               jnp.dtype(built.model_cfg.dtype).name, size['total'] / 2**20,
               size['per_device'] / 2**20, mesh.shape[sharding.DATA_AXIS],
               mesh.shape[sharding.FSDP_AXIS], built.chains)
  logging.info('Attention: %s', model_lib.describe_attention(built.model_cfg))


@contextlib.contextmanager
def _closing(batches, profiler: profiling.StepProfiler, log: report_lib.TrainingLog,
             checkpointer: checkpoint.Checkpointer):
  """Shuts the loop's parts down however it ends; in-flight saves still finish."""
  try:
    yield
  finally:
    batches.close()  # Stops the input worker processes.
    profiler.stop()
    log.close()
    checkpointer.wait()
    checkpointer.close()


def _finish(config: ml_collections.ConfigDict, built: build_lib.Built, state: Any, mesh,
            workdir: str, log: report_lib.TrainingLog, last_eval: dict[str, Any], *, step: int,
            start_step: int, wall_time_s: float) -> dict[str, Any]:
  """Writes summary.json and prints the run's last evaluation (process 0); returns the summary."""
  is_main = jax.process_index() == 0
  result = summary.for_run(
      config, built.model_cfg, workdir, step=step, start_step=start_step, wall_time_s=wall_time_s,
      counters=log.counters, earlier_tokens=log.earlier_tokens, is_main=is_main)
  size = sharding.state_bytes(state)
  result |= {'mesh': dict(mesh.shape), 'concurrent_chains': built.chains,
             'host_malloc': host_malloc.description(), 'state_bytes': size['total'],
             'state_bytes_per_device': size['per_device']}
  if last_eval:
    result |= {f'eval_{k}': last_eval[k] for k in summary.EVAL_FIGURES if k in last_eval}
  if is_main:
    if last_eval:
      print(summary.eval_line(step, last_eval), flush=True)
    path = summary.write(workdir, result)
    print(f'Summary ({path}):\n{summary.dumps(result)}', flush=True)
  return result
