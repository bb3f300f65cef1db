"""The training loop: build, resume, step, log, evaluate, save.

`train_and_evaluate(config, workdir)` reads top to bottom like the data flow:
config -> mesh -> data -> model -> state -> checkpoint -> steps -> loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from mlm_jax import checkpoint as ckpt_lib
from mlm_jax import config_lib
from mlm_jax import flops as flops_lib
from mlm_jax import host_malloc
from mlm_jax import input_pipeline
from mlm_jax import masking
from mlm_jax import metrics as metrics_lib
from mlm_jax import model as model_lib
from mlm_jax import prepare as prepare_lib
from mlm_jax import profiling
from mlm_jax import run_summary
from mlm_jax import sharding
from mlm_jax import tokenizer as tok_lib
from mlm_jax import train_step as step_lib


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains until config.train.num_steps (resuming from workdir) and returns a summary."""
  # ---------------------------------------------------------------- config
  config_lib.validate(config, num_devices=jax.device_count())
  mesh = sharding.make_mesh(config.mesh.fsdp)
  config = _resolve_init_tokenizer(config)
  is_main = jax.process_index() == 0
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)

  # ------------------------------------------------------------------ data
  data = _prepare_data(config)
  tokenizer = data.tokenizer
  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  masker = masking.make_masker(config.masking, tokenizer.vocab_size, data.unigram_counts, pieces)
  resolved_config = _resolved_config(config, data)
  if is_main:
    shutil.copyfile(tokenizer.model_path, os.path.join(workdir, 'tokenizer.model'))
    _write_config(workdir, resolved_config)
  logging.info('Data: %s (%d train rows, %d validation rows)', data.data_dir,
               data.stats['train']['rows'], data.stats['validation']['rows'])

  # ----------------------------------------------------- model and state
  # Initialised under jit straight into its sharding (split on `fsdp`).
  built = build(config, tokenizer.vocab_size, mesh)
  model_cfg, state, dropout_rng = built.model_cfg, built.init_state(), built.dropout_rng
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  state_bytes = _state_bytes(state)
  logging.info('Model: %s parameters, compute dtype %s; train state %.1f MiB, %.1f MiB on each '
               'device (mesh data=%d x fsdp=%d); %d concurrent chain(s) per step',
               f'{num_params:,}', jnp.dtype(model_cfg.dtype).name,
               state_bytes['total'] / 2**20, state_bytes['per_device'] / 2**20,
               mesh.shape[sharding.DATA_AXIS], mesh.shape[sharding.FSDP_AXIS], built.chains)

  # ------------------------------------------------------------ checkpoint
  checkpointer = ckpt_lib.Checkpointer(
      os.path.join(workdir, 'checkpoints'), every=config.train.checkpoint_every,
      keep=config.train.keep_checkpoints)
  meta = model_cfg.shape_record()
  # Resume order: this workdir's latest checkpoint, else a Hugging Face BERT.
  start_step = checkpointer.latest_step() or 0
  if start_step:
    state = checkpointer.restore(start_step, state, meta)
    logging.info('Resumed from %s at step %d', checkpointer.directory, start_step)
  elif config.init.hf_dir:
    from mlm_jax import hf  # Needs the interop extra (safetensors).
    try:
      state = hf.init_from_hf(state, os.path.expanduser(config.init.hf_dir), model_cfg)
    except ValueError as e:
      raise config_lib.ConfigError(f'config.init.hf_dir={config.init.hf_dir!r}: {e}') from e
    logging.info('Initialised from the Hugging Face BERT in %s', config.init.hf_dir)

  # ----------------------------------------------------------------- steps
  train_step, eval_step = built.train_step, built.eval_step

  def evaluate(state) -> dict[str, float]:
    return _evaluate(eval_step, state, data, masker, config, mesh)

  # ------------------------------------------------------------------ loop
  num_steps = config.train.num_steps
  profile = config.profile
  writer = metrics_lib.MetricsWriter(
      workdir, enabled=is_main, tensorboard=config.train.tensorboard,
      hparams=metrics_lib.flatten(resolved_config), start_step=start_step)
  profiler = profiling.StepProfiler(
      workdir, profile.start_step, profile.num_steps, resumed_at=start_step,
      trace_python=profile.trace_python)
  # Tokens seen before this invocation: known if the run logged start_step.
  earlier_tokens = run_summary.tokens_before(metrics_lib.read_metrics(workdir), start_step)
  counters = run_summary.Counters()
  batches = input_pipeline.train_batches(
      data.source('train'), masker, global_batch=config.train.batch_size, seed=config.seed,
      start_step=start_step, process_index=jax.process_index(),
      process_count=jax.process_count(), prefetch=config.input.prefetch,
      worker_count=config.input.worker_count, sentence_pair=config.sentence_pair.task)
  feed = _DeviceFeed(batches, mesh)
  stop = _StopRequest(multi_process=jax.process_count() > 1)
  progress = _progress_bar(start_step, num_steps, enabled=is_main)
  pending: list[dict[str, jax.Array]] = []
  untimed = 0  # Steps at the head of `pending` whose time is not in the interval.
  last_eval: dict[str, float] = {}
  step = start_step
  interval_start = time.perf_counter()
  run_start = time.perf_counter()
  if start_step >= num_steps:
    logging.info('Already trained to step %d (config.train.num_steps=%d).', start_step, num_steps)
  # An exception (a NaN loss, a second Ctrl-C) still lets in-flight saves finish.
  try:
    with stop:
      while step < num_steps:
        batch = feed.pop()
        with profiler.step_context(step + 1):
          state, metrics = train_step(state, batch, dropout_rng)
        feed.fill()  # The next batch goes to the devices while this step runs.
        step += 1
        stop.poll(step)
        pending.append(metrics)
        if profiler.after_step(step, (state, metrics)):
          # Tracing slowed these steps and writing the trace took time: keep
          # them out of tokens/s, like the compile step.
          interval_start = time.perf_counter()
          feed.take_wait()
          untimed = len(pending)
        if step == start_step + 1:
          # The first step compiles: time it alone and keep it out of tokens/s.
          jax.block_until_ready(metrics)
          logging.info('First step (compile included) took %.1fs', time.perf_counter() - interval_start)
          interval_start = time.perf_counter()
          feed.take_wait()
          untimed = 1
        progress.update(1)

        # A stop logs too: a resumed run then knows the tokens seen so far.
        if step % config.train.log_every == 0 or step == num_steps or stop.requested:
          host_metrics = jax.device_get(pending)
          seconds = time.perf_counter() - interval_start
          record = _summarise(host_metrics)
          record.update(counters.add_interval(host_metrics, untimed, seconds))
          # Time the loop spent waiting for the host pipeline: near 0 when the
          # input keeps up with the devices.
          record['input_wait_fraction'] = min(feed.take_wait() / max(seconds, 1e-9), 1.0)
          if earlier_tokens is not None:
            record['tokens_seen'] = earlier_tokens + counters.tokens
          untimed = 0
          _check_finite(record['loss'], step, checkpointer.directory)
          writer.write(step, record)
          progress.set_postfix(loss=f'{record["loss"]:.3f}', acc=f'{record["mlm_accuracy"]:.3f}')
          pending.clear()
          interval_start = time.perf_counter()

        if step % config.train.eval_every == 0 or step == num_steps:
          last_eval = evaluate(state)
          writer.write(step, {f'eval_{k}': v for k, v in last_eval.items()})
          interval_start = time.perf_counter()
          feed.take_wait()

        final = step == num_steps or stop.requested
        if final or checkpointer.is_due(step):
          # Never save a diverged state: a NaN loss means NaN parameters.
          _check_finite(float(metrics['loss']), step, checkpointer.directory)
          checkpointer.save(step, state, meta, force=final)
        if stop.requested:
          logging.warning('Stopped by %s at step %d; checkpoint saved. Run the same command '
                          'to resume.', stop.signal_name, step)
          break
  finally:
    batches.close()  # Stops the input worker processes.
    profiler.stop()
    writer.close()
    checkpointer.wait()
    checkpointer.close()
    progress.close()

  summary = _run_summary(config, model_cfg, workdir, step=step, start_step=start_step,
                         wall_time_s=time.perf_counter() - run_start, counters=counters,
                         earlier_tokens=earlier_tokens, is_main=is_main)
  summary['mesh'] = dict(mesh.shape)
  summary['concurrent_chains'] = built.chains
  summary['host_malloc'] = host_malloc.description()
  summary['state_bytes'] = state_bytes['total']
  summary['state_bytes_per_device'] = state_bytes['per_device']
  if last_eval:
    summary['eval_baseline_accuracy'] = last_eval['baseline_accuracy']
    summary['eval_baseline_token'] = last_eval['baseline_token']
  if last_eval and is_main:
    ratio = last_eval['mlm_accuracy'] / max(last_eval['baseline_accuracy'], 1e-9)
    print(f'step {step}: eval MLM accuracy {last_eval["mlm_accuracy"]:.4f}, '
          f'eval loss {last_eval["loss"]:.4f}; always predicting the most frequent token '
          f'{last_eval["baseline_token"]!r} scores {last_eval["baseline_accuracy"]:.4f} '
          f'({ratio:.1f}x)', flush=True)
  if is_main:
    path = run_summary.write(workdir, summary)
    print(f'Summary ({path}):\n{json.dumps(summary, indent=2)}', flush=True)
  return summary


# ---------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class Built:
  """What a run trains: the model's shapes, its state's layout and the jitted steps.

  Nothing is allocated: `abstract_state` holds shapes, dtypes and shardings
  only (from jax.eval_shape), so the same object serves the trainer and the
  benchmark, which call `init_state()`, and the pre-flight, which compiles the
  steps for devices that exist only to compile for.
  """

  model_cfg: model_lib.ModelConfig
  abstract_state: step_lib.TrainState  # jax.ShapeDtypeStruct leaves with their shardings.
  train_step: Any     # (state, batch, dropout_rng) -> (state, metrics); donates the state.
  eval_step: Any      # (state, batch) -> loss/accuracy sums.
  dropout_rng: jax.Array
  chains: int         # config.train.concurrent_chains, resolved.
  init_state: Callable[[], step_lib.TrainState]  # A fresh state, made in its sharding.


def build(config: ml_collections.ConfigDict, vocab_size: int, mesh) -> Built:
  """The model, the state's shardings and the jitted steps of `config` on `mesh`.

  The trainer, the benchmark and the pre-flight all build through here, so
  they train, time and compile the same program. Choices left to 'auto'
  (compute dtype, attention kernel, concurrent chains) are made for the
  platform of the mesh's devices, not for the host's.
  """
  platform = mesh.devices.flat[0].platform
  pairs = config.sentence_pair.task != 'none'
  dtype = config_lib.compute_dtype(config.model.dtype, platform)
  model_cfg = model_lib.ModelConfig.from_config(
      config.model, vocab_size, tok_lib.padded_vocab_size(vocab_size), dtype,
      sentence_pair_head=pairs, batch_sharding=sharding.batch_sharding(mesh),
      attention=model_lib.resolve_attention(config.model.attention, platform, dtype,
                                            config.model.attention_dropout_rate))
  model = model_lib.BertForMLM(model_cfg)
  tx = step_lib.make_optimizer(config.train)
  repl, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  example = step_lib.example_batch(config.data.seq_len, config.masking.max_predictions, pairs)
  abstract_state, state_sh, init = step_lib.sharded_state_init(model, tx, init_rng, example, mesh)
  chains = config_lib.concurrent_chains(config.train, mesh.size, platform)
  train_step = jax.jit(
      step_lib.make_train_step(step_lib.learning_rate_schedule(config.train),
                               config.train.grad_accum_steps, config.sentence_pair.loss_weight,
                               chains),
      in_shardings=(state_sh, batch_sh, repl), out_shardings=(state_sh, repl), donate_argnums=0)
  eval_step = jax.jit(step_lib.eval_step, in_shardings=(state_sh, batch_sh), out_shardings=repl)
  return Built(model_cfg, abstract_state, train_step, eval_step, dropout_rng, chains, init)


def _resolve_init_tokenizer(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A run started from config.init.hf_dir tokenizes with that model's vocabulary."""
  if not config.init.hf_dir or config.tokenizer.model_file:
    return config
  config = config.copy_and_resolve_references()
  config.tokenizer.model_file = os.path.join(os.path.expanduser(config.init.hf_dir),
                                             'tokenizer.model')
  return config


def _prepare_data(config: ml_collections.ConfigDict) -> prepare_lib.PreparedData:
  """Process 0 prepares (if needed); the others wait, then load the same files."""
  if jax.process_count() == 1:
    return prepare_lib.prepare(config)
  if jax.process_index() == 0:
    prepare_lib.prepare(config)
  multihost_utils.sync_global_devices('mlm_jax:prepare')
  return prepare_lib.prepare(config)


def _state_bytes(state) -> dict[str, int]:
  """Bytes of the whole train state, and of the part the first local device holds."""
  leaves = jax.tree_util.tree_leaves(state)
  return {'total': sum(x.nbytes for x in leaves),
          'per_device': sum(x.addressable_shards[0].data.nbytes for x in leaves)}


def _check_finite(loss: float, step: int, checkpoint_dir: str) -> None:
  if not math.isfinite(loss):
    raise FloatingPointError(
        f'loss is {loss} at step {step}; stopping. The last good checkpoint is kept in '
        f'{checkpoint_dir}. Try a lower config.train.learning_rate.')


def _resolved_config(config: ml_collections.ConfigDict,
                     data: prepare_lib.PreparedData) -> dict[str, Any]:
  """The config as a dict, with what it resolved to on this machine under 'resolved'."""
  resolved = config.to_dict()
  resolved['resolved'] = {'data_dir': data.data_dir, 'vocab_size': data.tokenizer.vocab_size,
                          'padded_vocab_size': tok_lib.padded_vocab_size(data.tokenizer.vocab_size),
                          'num_devices': jax.device_count(), 'num_processes': jax.process_count(),
                          'backend': jax.default_backend()}
  return resolved


def _write_config(workdir: str, resolved: dict[str, Any]) -> None:
  tmp = os.path.join(workdir, 'config.json.tmp')
  with open(tmp, 'w') as f:
    json.dump(resolved, f, indent=2, default=str)
  os.replace(tmp, os.path.join(workdir, 'config.json'))


def _run_summary(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig,
                 workdir: str, *, step: int, start_step: int, wall_time_s: float,
                 counters: run_summary.Counters, earlier_tokens: int | None,
                 is_main: bool) -> dict[str, Any]:
  """summary.json's content; losses and accuracies from metrics.jsonl (process 0)."""
  flops_per_token = flops_lib.flops_per_token(
      num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
      intermediate_size=model_cfg.intermediate_size, seq_len=config.data.seq_len,
      vocab_size=model_cfg.padded_vocab_size, max_predictions=config.masking.max_predictions)
  device_kind = jax.devices()[0].device_kind
  peak = flops_lib.peak_flops_per_device(device_kind, config.profile.peak_tflops)
  return run_summary.build(
      step=step, start_step=start_step, wall_time_s=wall_time_s, counters=counters,
      earlier_tokens=earlier_tokens,
      series=metrics_lib.read_metrics(workdir) if is_main else {},
      flops_per_token=flops_per_token, peak_flops_per_device=peak,
      num_devices=jax.device_count(), device_kind=device_kind,
      mfu=flops_lib.mfu(counters.tokens_per_sec, flops_per_token, peak, jax.device_count()))


def _summarise(metrics: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """Means over a log interval; loss and accuracy weighted by masked tokens."""
  masked = np.array([m['num_masked'] for m in metrics], np.float64)
  weights = masked / max(masked.sum(), 1.0)
  record = {
      'loss': float(sum(w * m['loss'] for w, m in zip(weights, metrics))),
      'mlm_accuracy': float(sum(w * m['mlm_accuracy'] for w, m in zip(weights, metrics))),
      'learning_rate': float(metrics[-1]['learning_rate']),
      'grad_norm': float(np.mean([m['grad_norm'] for m in metrics])),
  }
  for name in ('sentence_pair_loss', 'sentence_pair_accuracy'):
    if name in metrics[0]:
      record[name] = float(np.mean([m[name] for m in metrics]))
  return record


def _evaluate(eval_step, state, data: prepare_lib.PreparedData, masker: masking.Masker,
              config: ml_collections.ConfigDict, mesh) -> dict[str, float]:
  """Loss and MLM accuracy on the validation split with fixed masks.

  Also scores the trivial baseline that always predicts the train split's most
  frequent normal token, on the same masked slots.
  """
  top_token = data.most_frequent_token()
  totals = {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 0.0}
  baseline_local = np.zeros(2)  # [hits, masked] on this process's rows
  source = data.source('validation')
  global_batch = input_pipeline.eval_batch_size(len(source), config.eval.batch_size, mesh.size)
  for host_batch in input_pipeline.eval_batches(
      source, masker, global_batch=global_batch,
      mask_seed=config.eval.mask_seed, max_batches=config.eval.max_batches,
      process_index=jax.process_index(), process_count=jax.process_count(),
      sentence_pair=config.sentence_pair.task):
    w = host_batch['masked_weights']
    baseline_local += [np.sum(w * (host_batch['masked_ids'] == top_token)), np.sum(w)]
    sums = jax.device_get(eval_step(state, sharding.to_global(host_batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  if jax.process_count() > 1:
    baseline_local = np.sum(multihost_utils.process_allgather(baseline_local), axis=0)
  denom = max(totals['weight_sum'], 1.0)
  result = {'loss': totals['loss_sum'] / denom, 'mlm_accuracy': totals['correct_sum'] / denom,
            'num_masked': totals['weight_sum'],
            'baseline_accuracy': float(baseline_local[0] / max(baseline_local[1], 1.0)),
            'baseline_token': data.tokenizer.id_to_piece(top_token)}
  if 'pair_weight_sum' in totals:
    rows = max(totals['pair_weight_sum'], 1.0)
    result['sentence_pair_loss'] = totals['pair_loss_sum'] / rows
    result['sentence_pair_accuracy'] = totals['pair_correct_sum'] / rows
  return result


class _DeviceFeed:
  """Keeps the next global batch on the devices ahead of the step that needs it.

  `fill()` right after dispatching a step builds the next batch (host
  pipeline, then transfer) while the devices compute; `take_wait()` returns
  the seconds spent blocked on the host pipeline since the last call.
  """

  def __init__(self, host_batches, mesh, ahead: int = 1):
    self._host_batches = host_batches
    self._mesh = mesh
    self._ahead = ahead
    self._queue: collections.deque = collections.deque()
    self._wait = 0.0

  def fill(self) -> None:
    while len(self._queue) < self._ahead:
      start = time.perf_counter()
      host = next(self._host_batches)
      self._wait += time.perf_counter() - start
      self._queue.append(sharding.to_global(host, self._mesh))

  def pop(self) -> dict[str, jax.Array]:
    self.fill()
    return self._queue.popleft()

  def take_wait(self) -> float:
    wait, self._wait = self._wait, 0.0
    return wait


class _StopRequest:
  """Turns the first SIGINT/SIGTERM into a request to checkpoint and stop.

  One process: the signal sets the request, honoured after the current step.
  Several processes must all save the same step, whichever of them got the
  signal and whenever: SIGTERM is left to JAX's preemption service (installed
  by jax.distributed.initialize), which propagates the notice to every
  process and names a step all of them reach; `poll(step)` asks it every
  step. SIGINT is turned into a SIGTERM to this process, so Ctrl-C takes the
  same path. A second signal interrupts at once (the last complete checkpoint
  remains).
  """

  def __init__(self, multi_process: bool = False):
    self.requested = False
    self.signal_name = ''
    self._multi_process = multi_process
    self._previous: dict[int, Any] = {}

  def poll(self, step: int) -> None:
    """Call once per step on every process, after the step."""
    if self._multi_process and multihost_utils.reached_preemption_sync_point(step):
      self.requested = True
      self.signal_name = self.signal_name or 'SIGTERM'

  def _handle(self, signum, frame):
    if self.requested or (self._multi_process and self.signal_name):
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    if self._multi_process:
      logging.warning('%s received: all processes will save a checkpoint at a step they agree '
                      'on (send again to abort).', self.signal_name)
      os.kill(os.getpid(), signal.SIGTERM)  # To JAX's preemption notifier.
      return
    self.requested = True
    logging.warning('%s received: saving a checkpoint after this step (send again to abort).',
                    self.signal_name)

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self  # Signals are delivered to the main thread only.
    signals = (signal.SIGINT,) if self._multi_process else (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False


class _NoProgress:
  def update(self, n):
    pass

  def set_postfix(self, **kw):
    pass

  def close(self):
    pass


def _progress_bar(start: int, total: int, enabled: bool):
  if not (enabled and sys.stderr.isatty()):
    return _NoProgress()
  from tqdm import tqdm
  return tqdm(total=total, initial=start, unit='step', dynamic_ncols=True)
