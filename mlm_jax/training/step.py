"""Optimizer, loss and the pure train/eval steps.

The loss is `sum(w * CE) / sum(w)` where both sums run over the whole global
batch: under `jax.jit` with the batch sharded over the mesh, `jnp.sum` is
already global, so the denominator is the global number of masked tokens |M|,
never a mean of per-device means.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training import train_state

from mlm_jax.config_check import one_of
from mlm_jax.config_check import require
from mlm_jax.data import masking
from mlm_jax.runtime import cores
from mlm_jax.runtime import sharding

Array = jax.Array
Batch = dict[str, Array]
# baseline_token when no most frequent token is known (a benchmark, synthetic
# data): no id equals it, so the baseline sums stay 0.
NO_BASELINE = -1


def batch_spec(batch_size: int, seq_len: int, max_predictions: int,
               sentence_pair: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes and dtypes of a batch as the host pipeline (masking.Masker) makes it.

  input_ids, segment_ids, attention_mask [B, T] int32; masked_positions,
  masked_ids, masked_kinds [B, P] int32, masked_weights [B, P] float32; with a
  sentence-pair task also sentence_pair_labels [B] int32 and
  sentence_pair_weights [B] float32.
  """
  b, t, p = batch_size, seq_len, max_predictions
  spec = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in (
      ('input_ids', (b, t), jnp.int32), ('segment_ids', (b, t), jnp.int32),
      ('attention_mask', (b, t), jnp.int32), ('masked_positions', (b, p), jnp.int32),
      ('masked_ids', (b, p), jnp.int32), ('masked_weights', (b, p), jnp.float32),
      ('masked_kinds', (b, p), jnp.int32))}
  if sentence_pair:
    spec['sentence_pair_labels'] = jax.ShapeDtypeStruct((b,), jnp.int32)
    spec['sentence_pair_weights'] = jax.ShapeDtypeStruct((b,), jnp.float32)
  return spec


def example_batch(seq_len: int, max_predictions: int, sentence_pair: bool = False) -> Batch:
  """A one-row batch of batch_spec's shapes (all tokens real) to initialise a model with."""
  spec = batch_spec(1, seq_len, max_predictions, sentence_pair)
  batch = {k: jnp.zeros(x.shape, x.dtype) for k, x in spec.items()}
  batch['attention_mask'] += 1
  if sentence_pair:
    batch['sentence_pair_weights'] += 1
  return batch


class TrainState(train_state.TrainState):
  """step, params, opt_state (+ static apply_fn and tx)."""


def _linear(train: ml_collections.ConfigDict) -> optax.Schedule:
  """BERT's schedule: linear warm-up to the peak, then linear decay to 0."""
  warmup = optax.linear_schedule(0.0, train.learning_rate, max(train.warmup_steps, 1))
  decay = optax.linear_schedule(train.learning_rate, 0.0,
                                max(train.num_steps - train.warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [train.warmup_steps])


def _wsd(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Warmup-stable-decay (a trapezoid): linear warm-up, the peak, then a decay to 0.

  The decay is linear by default, as in Cramming's trapezoid (Geiping &
  Goldstein, 2022); decay_shape='1-sqrt' is ModernBERT's (Warner et al.,
  2024, after Hägele et al., 2024). It takes the last `decay_fraction` of the
  steps, but never starts before the warm-up ends (a short trial run of a long
  config only warms up).
  """
  peak = train.learning_rate
  decay_start = max(train.num_steps - max(round(train.decay_fraction * train.num_steps), 1),
                    train.warmup_steps)
  decay_steps = max(train.num_steps - decay_start, 1)
  if train.decay_shape == 'linear':
    decay = optax.linear_schedule(peak, 0.0, decay_steps)
  else:
    # '1-sqrt': peak * (1 - sqrt(t / decay_steps)); optax has no such schedule,
    # so it is the square root of optax's clipped linear ramp.
    ramp = optax.linear_schedule(0.0, 1.0, decay_steps)

    def decay(step):
      return peak * (1.0 - jnp.sqrt(ramp(step)))
  warmup = optax.linear_schedule(0.0, peak, max(train.warmup_steps, 1))
  return optax.join_schedules([warmup, optax.constant_schedule(peak), decay],
                              [train.warmup_steps, decay_start])


def _one_cycle(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Smith's one-cycle: a cosine up to the peak at the end of warm-up, then down.

  It starts at peak/25 and ends at peak/2.5e5 at num_steps (optax's default
  div_factor and final_div_factor).
  """
  # optax places the peak at int(pct_start * num_steps); half a step more than
  # warmup_steps keeps float rounding from moving it a step early.
  pct_start = (train.warmup_steps + 0.5) / train.num_steps
  return optax.cosine_onecycle_schedule(train.num_steps, train.learning_rate, pct_start)


# config.train.schedule -> the function that builds it.
_SCHEDULES = {'linear': _linear, 'wsd': _wsd, 'one_cycle': _one_cycle}
SCHEDULES = tuple(_SCHEDULES)
# config.train.decay_shape: how 'wsd' falls from the peak to 0.
DECAY_SHAPES = ('linear', '1-sqrt')


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """The learning rate of each step, as config.train.schedule names it (see SCHEDULES)."""
  return _SCHEDULES[train.schedule](train)


def weight_decay_mask(params: Any) -> Any:
  """True for matrices (dense kernels, embeddings); False for biases and LayerNorm."""
  def decays(path, _):
    # The last dict key names the tensor (a boxed leaf adds an attribute key).
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return name in ('kernel', 'embedding')
  return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm's update, as one scalar factor on every gradient.

  optax writes each clipped tensor as `select(norm < max_norm, g, g / norm *
  max_norm)`, which XLA:CPU computes as a pass of its own over every
  gradient (a division it will not repeat in both Adam moments' loops), read
  again by each moment. Here each gradient is multiplied by `max_norm /
  max(norm, max_norm)`: exactly 1 when the norm is below the threshold, the
  same clip to the last bit or two above it, and the multiplication fuses
  into the moments' loops. Its state is optax's EmptyState, as
  clip_by_global_norm's, so checkpoints are the same. `max_norm=inf` never
  clips.
  """
  def update_fn(updates, state, params=None):
    del params
    if math.isinf(max_norm):
      return updates, state
    g_norm = optax.tree.norm(updates)
    scale = max_norm / jnp.maximum(g_norm, max_norm)
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  # The chain keeps one shape whatever the settings, so a run can be resumed
  # with clipping switched off (an infinite threshold never clips).
  clip = train.grad_clip_norm if train.grad_clip_norm > 0 else float('inf')
  return optax.chain(
      clip_by_global_norm(clip),
      optax.adamw(learning_rate_schedule(train), b1=train.adam_b1, b2=train.adam_b2,
                  eps=train.adam_eps, weight_decay=train.weight_decay, mask=weight_decay_mask))


def argmax(x: Array) -> Array:
  """jnp.argmax(x, axis=-1) (the first index of the largest value), as two plain reductions.

  XLA:CPU runs argmax as one reduction over (value, index) pairs, which it
  does not vectorise: over the tiny config's [8, 20, 1024] logits 0.44 ms,
  against 0.11 ms for a max and then a min over the indices where it is
  reached (a micro-benchmark on 2 Zen 5 cores, AVX-512).
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  n = x.shape[-1]
  return jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def mlm_loss_terms(logits: Array, masked_ids: Array, weights: Array, kinds: Array | None = None,
                   baseline_token: int = NO_BASELINE) -> dict[str, Array]:
  """logits [B, P, V], masked_ids, weights, kinds [B, P] -> sums (caller divides).

  Besides the loss, accuracy and weight of all masked slots, the same sums per
  kind of slot (what the input showed there: masking.SLOT_KINDS), and how
  often always answering `baseline_token` (the most frequent token) would be
  right, overall and per kind. Accuracy at [MASK] slots against that rate is
  what the model learned from context (see `slot_metrics`). Without `kinds`,
  the first three sums only. NO_BASELINE (no id): the baseline sums are 0.
  """
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), masked_ids)
  correct = (argmax(logits) == masked_ids).astype(jnp.float32)
  terms = {
      'loss_sum': jnp.sum(ce * weights),
      'correct_sum': jnp.sum(correct * weights),
      'weight_sum': jnp.sum(weights),
  }
  if kinds is None:
    return terms
  hit = (masked_ids == baseline_token).astype(jnp.float32)
  terms['baseline_sum'] = jnp.sum(hit * weights)
  for i, kind in enumerate(masking.SLOT_KINDS, start=1):
    w = weights * (kinds == i)
    terms |= {f'{kind}_loss_sum': jnp.sum(ce * w), f'{kind}_correct_sum': jnp.sum(correct * w),
              f'{kind}_weight_sum': jnp.sum(w), f'{kind}_baseline_sum': jnp.sum(hit * w)}
  return terms


def slot_metrics(sums: dict[str, float]) -> dict[str, float]:
  """Sums of mlm_loss_terms (over a log interval or an evaluation) -> ratios by kind of slot.

  baseline_accuracy: how often always answering the most frequent token is
  right, over all masked slots; per kind (mask, random, kept) its loss,
  accuracy and baseline_accuracy; and context_ratio = accuracy at [MASK]
  slots / the most frequent token's rate there, what the model learned from
  context. A kind with no slot gets no entries.
  """
  def ratio(a: float, b: float) -> float:
    return float(a) / max(float(b), 1.0)

  out = {'baseline_accuracy': ratio(sums['baseline_sum'], sums['weight_sum'])}
  for kind in masking.SLOT_KINDS:
    w = sums[f'{kind}_weight_sum']
    if w > 0:
      out |= {f'{kind}_loss': ratio(sums[f'{kind}_loss_sum'], w),
              f'{kind}_accuracy': ratio(sums[f'{kind}_correct_sum'], w),
              f'{kind}_baseline_accuracy': ratio(sums[f'{kind}_baseline_sum'], w)}
  if out.get('mask_baseline_accuracy'):
    out['context_ratio'] = out['mask_accuracy'] / out['mask_baseline_accuracy']
  return out


def pair_loss_terms(logits: Array, labels: Array, weights: Array) -> dict[str, Array]:
  """Sentence-pair logits [B, 2], labels [B], weights [B] (0: no pair) -> sums (caller divides)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return {'pair_loss_sum': jnp.sum(ce * weights), 'pair_correct_sum': jnp.sum(correct * weights),
          'pair_weight_sum': jnp.sum(weights)}


def _loss_terms(outputs: dict[str, Array], batch: Batch, baseline_token: int) -> dict[str, Array]:
  terms = mlm_loss_terms(outputs['mlm_logits'], batch['masked_ids'], batch['masked_weights'],
                         batch['masked_kinds'], baseline_token)
  if 'sentence_pair_logits' in outputs:
    terms |= pair_loss_terms(outputs['sentence_pair_logits'], batch['sentence_pair_labels'],
                             batch['sentence_pair_weights'])
  return terms


def split_rows(batch: Batch, k: int) -> Batch:
  """[B, ...] leaves -> [k, B/k, ...]; part i holds rows i, i+k, i+2k, ...

  Each device's rows stay on that device in every part (no data movement),
  as long as each device holds a multiple of k rows.
  """
  return jax.tree_util.tree_map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)


def make_train_step(schedule: optax.Schedule, grad_accum_steps: int = 1,
                    sentence_pair_weight: float = 1.0, chains: int = 1,
                    baseline_token: int = NO_BASELINE) -> Callable:
  """Returns train_step(state, batch, rng) -> (state, metrics); jit it with donation.

  The objective is sum(w * CE) / |M| with |M| = sum(masked_weights) over the
  whole global batch (plus, with a sentence-pair head, sentence_pair_weight x
  its mean cross-entropy over the rows that hold a pair). Both denominators are known from
  the batch before the forward pass, so with grad_accum_steps = k > 1 the
  global batch is processed as k micro-batches of B/k rows whose gradients
  simply add up to the gradient of one batch of B rows (dropout aside) —
  not a mean of micro-batch means. Micro-batch i takes rows i, i+k, i+2k, ...:
  every device keeps contributing its own rows, with no data movement.

  `chains` > 1 splits each (micro-)batch the same way into that many parts
  whose forward and backward passes are written out side by side in one
  program and summed: the same update, but independent chains of operations
  that XLA's CPU runtime executes concurrently, one per core (its elementwise
  kernels are single-threaded). Chain j draws its dropout with
  fold_in(key, j); chains = 1 leaves the key as it is.

  Besides loss, accuracy, learning rate and gradient norm, the metrics hold
  the sums of mlm_loss_terms per kind of slot (`slot_metrics` turns those of
  a log interval into ratios); `baseline_token` is the most frequent token
  (PreparedData.most_frequent_token(); NO_BASELINE where none is known).
  """

  def train_step(state: TrainState, batch: Batch, rng: Array):
    dropout_rng = jax.random.fold_in(rng, state.step)
    denom = jnp.maximum(jnp.sum(batch['masked_weights']), 1.0)   # Global |M| of the batch.
    num_pairs = jnp.maximum(jnp.sum(batch.get('sentence_pair_weights', jnp.ones(1))), 1.0)

    def loss_fn(params, micro: Batch, key: Array):
      outputs = state.apply_fn({'params': params}, micro, deterministic=False,
                               rngs={'dropout': key}, method='pretrain')
      terms = _loss_terms(outputs, micro, baseline_token)
      loss = terms['loss_sum'] / denom
      if 'pair_loss_sum' in terms:
        loss += sentence_pair_weight * terms['pair_loss_sum'] / num_pairs
      return loss, terms

    single = jax.grad(loss_fn, has_aux=True)

    def grad_fn(params, micro: Batch, key: Array):
      if chains == 1:
        return single(params, micro, key)
      parts = split_rows(micro, chains)
      results = [single(params, jax.tree_util.tree_map(lambda x: x[j], parts),
                        jax.random.fold_in(key, j)) for j in range(chains)]
      return jax.tree_util.tree_map(lambda *xs: sum(xs[1:], xs[0]), *results)

    if grad_accum_steps == 1:
      grads, terms = grad_fn(state.params, batch, dropout_rng)
    else:
      k = grad_accum_steps
      micro_batches = split_rows(batch, k)                         # [k, B/k, ...]

      def accumulate(carry, xs):
        micro, i = xs
        grads, terms = grad_fn(state.params, micro, jax.random.fold_in(dropout_rng, i))
        return jax.tree_util.tree_map(jnp.add, carry, (grads, terms)), None

      zero_terms = jax.tree_util.tree_map(
          jnp.zeros_like, jax.eval_shape(lambda: grad_fn(state.params, jax.tree_util.tree_map(
              lambda x: x[0], micro_batches), dropout_rng)[1]))
      zeros = (jax.tree_util.tree_map(jnp.zeros_like, state.params), zero_terms)
      (grads, terms), _ = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(k)))
    new_state = state.apply_gradients(grads=grads)
    metrics = {
        'loss': terms['loss_sum'] / denom,
        'mlm_accuracy': terms['correct_sum'] / denom,
        'learning_rate': schedule(state.step),
        'grad_norm': optax.tree.norm(grads),
        'num_masked': terms['weight_sum'],
        'num_tokens': jnp.sum(batch['attention_mask']),
        **{k: v for k, v in terms.items() if k.startswith(masking.SLOT_KINDS)},
        'baseline_sum': terms['baseline_sum'],
    }
    if 'pair_loss_sum' in terms:
      metrics['sentence_pair_loss'] = terms['pair_loss_sum'] / num_pairs
      metrics['sentence_pair_accuracy'] = terms['pair_correct_sum'] / num_pairs
    return new_state, metrics

  return train_step


def make_eval_step(baseline_token: int = NO_BASELINE) -> Callable:
  """Returns eval_step(state, batch) -> sums of mlm_loss_terms over the global batch."""

  def eval_step(state: TrainState, batch: Batch) -> dict[str, Array]:
    outputs = state.apply_fn({'params': state.params}, batch, deterministic=True,
                             method='pretrain')
    return _loss_terms(outputs, batch, baseline_token)

  return eval_step


def _boxed_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                 rng: Array, example_batch: Batch) -> TrainState:
  """A fresh state whose parameters and Adam moments still carry their logical axis names."""
  params = model.init(rng, example_batch, deterministic=True)['params']
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def create_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                 rng: Array, example_batch: Batch) -> TrainState:
  """A fresh state of plain arrays, on the default device (tests, small tools)."""
  return flax.linen.unbox(_boxed_state(model, tx, rng, example_batch))


def sharded_state_init(model: flax.linen.Module, tx: optax.GradientTransformation,
                       rng: Array, example_batch: Batch,
                       mesh) -> tuple[TrainState, Any, Callable[[], TrainState]]:
  """(abstract state, its shardings, init): the state's layout, and how to make it.

  The abstract state has jax.ShapeDtypeStruct leaves that carry their
  shardings (from jax.eval_shape: nothing is allocated). `init()` creates the
  state under jit straight into those shardings: parameters and optimizer
  moments split on the mesh by their logical axis names (see
  sharding.LOGICAL_RULES), so no device ever holds the whole state when
  fsdp > 1. The state has plain arrays (no logical boxes).
  """
  boxed = lambda r: _boxed_state(model, tx, r, example_batch)
  shardings = sharding.state_shardings(jax.eval_shape(boxed, rng), mesh)
  shapes = jax.eval_shape(lambda r: flax.linen.unbox(boxed(r)), rng)
  abstract = jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)
  init = jax.jit(lambda r: flax.linen.unbox(boxed(r)), out_shardings=shardings)
  return abstract, shardings, lambda: init(rng)


def create_sharded_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                         rng: Array, example_batch: Batch, mesh) -> tuple[TrainState, Any]:
  """(state, its shardings): initialised under jit straight into its sharding."""
  _, shardings, init = sharded_state_init(model, tx, rng, example_batch, mesh)
  return init(), shardings


def check_config(train: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.train (optimizer, schedule, cadence, step layout)."""
  for name in ('batch_size', 'num_steps', 'log_every', 'eval_every', 'checkpoint_every',
               'keep_checkpoints'):
    require(train[name] > 0, f'config.train.{name}={train[name]} must be positive.')
  require(train.learning_rate > 0,
          f'config.train.learning_rate={train.learning_rate} must be positive.')
  # warmup_steps > num_steps is allowed: a short trial run of a long config.
  require(train.warmup_steps >= 0, f'config.train.warmup_steps={train.warmup_steps} must be >= 0.')
  check_optimizer(train)
  # The one-cycle peak must fall inside the run for the cycle to exist.
  require(train.schedule != 'one_cycle' or train.warmup_steps < train.num_steps,
          f"config.train.schedule='one_cycle' needs warmup_steps={train.warmup_steps} < "
          f"num_steps={train.num_steps}: lower warmup_steps or use 'linear' or 'wsd'.")
  require(train.grad_accum_steps >= 1,
          f'config.train.grad_accum_steps={train.grad_accum_steps} must be at least 1.')
  require(train.concurrent_chains >= 0,
          f'config.train.concurrent_chains={train.concurrent_chains} must be >= 0 (0: auto).')


def check_optimizer(train: ml_collections.ConfigDict) -> None:
  """ConfigError for the fields make_optimizer and learning_rate_schedule read beyond the
  steps and the peak: schedule, its decay, weight decay, clipping (fine-tuning checks them so
  too)."""
  one_of('train', 'schedule', train.schedule, SCHEDULES)
  one_of('train', 'decay_shape', train.decay_shape, DECAY_SHAPES)
  require(0 < train.decay_fraction <= 1,
          f'config.train.decay_fraction={train.decay_fraction} must be in (0, 1].')
  require(train.weight_decay >= 0, 'config.train.weight_decay must be >= 0.')
  require(train.grad_clip_norm >= 0, 'config.train.grad_clip_norm must be >= 0 (0 disables).')


def concurrent_chains(train: ml_collections.ConfigDict, num_devices: int,
                      platform: str | None = None) -> int:
  """config.train.concurrent_chains with 0 (auto) resolved for `platform` (default: JAX's backend).

  Auto is 2 when the step runs on a single CPU device with at least 2 cores
  and each micro-batch splits evenly (tiny config on 2 cores: 4-13% faster
  per step in A/B runs), else 1: accelerators run each kernel on the whole
  chip already, and smaller parts only shrink the kernels.
  """
  chains = train.concurrent_chains
  if chains:
    return chains
  rows = train.batch_size // (num_devices * train.grad_accum_steps)
  platform = platform or jax.default_backend()
  if (platform == 'cpu' and num_devices == 1 and cores.usable_cores() >= 2
      and rows % 2 == 0):
    return 2
  return 1


def train_compiler_options(platform: str, chains: int) -> dict[str, Any]:
  """XLA options for the train step: with concurrent chains on a CPU, single-threaded Eigen.

  The chains already keep every core busy. Eigen's matmuls (XLA:CPU gives
  it the weight gradients its own matmul library does not take) then split
  each product over threads that the other chain's operations also need;
  run on one thread each, the bert_tiny step on 2 cores took 58.4 instead
  of 62.6 ms and the tiny one 56.1 instead of 58.0 ms (alternating windows
  in one process), BERT-base at B=8 within noise (1,624 vs 1,615 ms).
  """
  if platform == 'cpu' and chains > 1 and _cpu_compiler_accepts('xla_cpu_multi_thread_eigen',
                                                                 False):
    return {'xla_cpu_multi_thread_eigen': False}
  return {}


@functools.cache
def _cpu_compiler_accepts(option: str, value: Any) -> bool:
  """Whether this jaxlib's CPU compiler knows the option (names come and go between versions)."""
  try:
    x = jax.device_put(jnp.zeros(()), jax.local_devices(backend='cpu')[0])
    jax.jit(lambda v: v + 1).lower(x).compile(compiler_options={option: value})
  except jax.errors.JaxRuntimeError:
    return False
  return True
