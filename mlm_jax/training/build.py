"""What a config trains: the model, the optimizer, the state's layout and the jitted steps.

`build(config, vocab_size, mesh)` is the one place these are made: the
trainer, the benchmark and the pre-flight all call it, so they train, time
and compile the same program. Nothing is allocated here: the state exists as
shapes and shardings (jax.eval_shape) until `init_state()` creates it, under
jit, straight into its sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from mlm_jax import model as model_lib
from mlm_jax.config import phases
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding
from mlm_jax.training import objective
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib
from mlm_jax.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class Built:
  """What a run trains: the model's shapes, its state's layout and the jitted steps.

  Nothing is allocated: `abstract_state` holds shapes, dtypes and shardings
  only (from jax.eval_shape), so the same object serves the trainer and the
  benchmark, which call `init_state()`, and the pre-flight, which compiles the
  steps for devices that exist only to compile for.
  """

  model_cfg: model_lib.ModelConfig
  abstract_state: state_lib.TrainState  # jax.ShapeDtypeStruct leaves with their shardings.
  train_step: Any     # (state, batch, dropout_rng) -> (state, metrics); donates the state.
  eval_step: Any      # (state, batch) -> sums of objective.loss_terms.
  dropout_rng: jax.Array
  chains: int         # config.train.concurrent_chains, resolved.
  attention: str      # The attention kernel of each kind of call in the train step, and why.
  init_state: Callable[[], state_lib.TrainState]  # A fresh state, made in its sharding.
  # params -> a fresh optimizer state for them, in its sharding (a phase's fresh_optimizer).
  fresh_opt_state: Callable[[Any], Any]
  # A batch warm-up: the train step accumulates only the micro-batches its rows fill, a loop
  # whose count is the data's (step.make_train_step's growing_batch).
  growing_batch: bool


def build(config: ml_collections.ConfigDict, vocab_size: int, mesh,
          baseline_token: int = objective.NO_BASELINE, plan: phases.Plan | None = None,
          phase: phases.Phase | None = None) -> Built:
  """The model, the state's shardings and the jitted steps of `config` on `mesh`.

  The trainer, the benchmark and the pre-flight all build through here, so
  they train, time and compile the same program. Choices left to 'auto'
  (compute dtype, attention kernel, concurrent chains) are made for the
  platform of the mesh's devices, not for the host's, and so are the forms
  of the operations that differ between platforms (platform_ops, given to
  the model as its `ops`): the pre-flight compiles on a CPU host what a TPU
  or GPU will run. The steps are traced on the mesh (sharding.traced_on),
  where the logical rule for 'batch' keeps the activations split like the batch.
  `baseline_token`: the training data's most frequent token
  (PreparedData.most_frequent_token()), whose hit rate the steps report;
  objective.NO_BASELINE where there is none (a benchmark's synthetic
  batches). `plan` and `phase`: the run in phases `config` is the phase of
  (mlm_jax/phases.py); the learning rate is then the run's, joined over its
  phases, at each global step. Without them, config.train's schedule.
  """
  platform = mesh.devices.flat[0].platform
  pairs = config.sentence_pair.task != 'none'
  dtype = model_lib.compute_dtype(config.model.dtype, platform)
  model_cfg = model_lib.ModelConfig.from_config(
      config.model, vocab_size, tok_lib.padded_vocab_size(vocab_size), dtype,
      platform=platform, sentence_pair_head=pairs)
  model_lib.check_attention_platform(model_cfg)
  model = model_lib.mlm_model(model_cfg, platform_ops.for_platform(platform))
  if plan is not None and plan.phased:
    schedule = optimizer.run_schedule(plan.phases)   # By global step, for the metrics.
    tx = optimizer.make_optimizer(config.train, platform, optimizer.run_schedule(
        plan.phases, phases.learning_rate_offset(plan, phase)))
  else:
    schedule = optimizer.learning_rate_schedule(config.train)
    tx = optimizer.make_optimizer(config.train, platform, schedule)
  repl, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  example = state_lib.example_batch(config.data.seq_len, config.masking.max_predictions, pairs)
  ema_decay = config.train.ema_decay
  abstract_state, state_sh, init = state_lib.sharded_state_init(model, tx, init_rng, example,
                                                                mesh, ema=ema_decay > 0)
  chains = platform_ops.concurrent_chains(config.train, mesh.size, platform)
  growing_batch = config.train.get('batch_warmup_tokens', 0) > 0
  train_step = jax.jit(
      sharding.traced_on(step_lib.make_train_step(
          schedule, config.train.grad_accum_steps, config.sentence_pair.loss_weight, chains,
          baseline_token, platform, ema_decay,
          growing_batch=growing_batch), mesh),
      in_shardings=(state_sh, batch_sh, repl), out_shardings=(state_sh, repl), donate_argnums=0,
      compiler_options=platform_ops.train_compiler_options(platform, chains))
  eval_step = jax.jit(sharding.traced_on(step_lib.make_eval_step(baseline_token, platform), mesh),
                      in_shardings=(state_sh, batch_sh), out_shardings=repl)
  attention = model_lib.describe_attention(model_cfg, config.data.seq_len,
                                           config.masking.max_predictions + int(pairs))
  fresh_opt_state = jax.jit(tx.init, out_shardings=state_sh.opt_state)
  return Built(model_cfg, abstract_state, train_step, eval_step, dropout_rng, chains, attention,
               init, fresh_opt_state, growing_batch)
