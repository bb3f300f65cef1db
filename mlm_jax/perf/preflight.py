"""The pre-flight (python -m mlm_jax.preflight): will a run fit its accelerators?

Compiles the run's train and eval steps for an accelerator target on this
machine, without the accelerator, and says whether they fit:

  python -m mlm_jax.preflight --config=configs/base.py --target=h100x8 \\
      [--config.train.batch_size=512 ...] [--json_out=preflight.json]

Targets are Cloud TPU slices (`v4-32`, `v5litepod-16`, `v5p-128`, `v6e-8`) and
NVIDIA GPUs (`h100`, `h100x8`, `h100x8x4` for 4 nodes of 8, `a100x8`); see
mlm_jax/perf/targets.py. The steps are the trainer's own (`training.build`: model,
optimizer, mesh, sharding rules, donated train step, eval step), built for
the target's devices with `auto` choices (dtype, attention kernel) made for
the target; the state comes from jax.eval_shape and every argument is a
jax.ShapeDtypeStruct with its sharding, so nothing is allocated here.

It reports, per device: parameters + optimizer state, batch, temporaries,
program and total memory against the device's memory, which must keep at
least 10% free; FLOPs per step from the compiler next to flops.py's count;
on TPU the compiler's own per-operation cycle estimates as a step time,
tokens/s and MFU (always labelled an estimate); on GPU whether attention
compiled to cuDNN's fused kernel. When the step does not fit it compiles the
changes that would make it fit (the largest per-device batch, predicted from
two small compiles and confirmed by one more; fsdp; gradient accumulation)
and prints those that do, within a budget of compile time
(--search_budget_s) after which it prints the best bounds found so far.
Exit status: 0 fits, 1 does not fit (or asked for cuDNN attention and did
not get it), 2 bad input.

Needs `pip install -e '.[aot]'` (libtpu and XLA's CUDA compiler).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import time
from typing import Any
from typing import Callable

from mlm_jax.config import checks
from mlm_jax.errors import ConfigError
from mlm_jax.errors import PreflightError
from mlm_jax.perf import targets

HEADROOM = 0.10     # A step fits when it leaves at least this share of device memory free.
# Seconds of compiles the searches for what would fit may spend past their
# first three (two small ones and the prediction): about a minute, the time
# the TPU compiler takes to refuse an oversized BERT-large.
SEARCH_BUDGET_S = 60.0
_REFERENCE_MATMUL = 4096  # Side of the bf16 matmul that calibrates the TPU cycle estimates.



@dataclasses.dataclass
class StepFigures:
  """One compiled step on the target: its shapes, memory and costs (per device)."""

  step: str                   # 'train' | 'eval'
  global_batch: int
  per_device_batch: int
  grad_accum_steps: int
  fsdp: int
  memory: dict[str, int]      # state, batch, arguments, outputs, aliased, temporaries, program, total
  usable_memory: int
  compile_s: float
  flops: float | None         # Compiled FLOPs per device per step.
  flops_source: str
  hlo: dict[str, Any]         # hlo_cost.summary() of the compiled program.
  xla_cost: dict[str, float]  # XLA's cost analysis (TPU): flops, bytes accessed, optimal_seconds.
  # The compiler's refusal when the program cannot fit (the TPU compiler checks).
  compile_error: str = ''
  # The step lowered to a program compiled earlier by this command (a phase's eval step that
  # another phase shares): its figures are that compile's, and compile_s is the lowering's.
  reused: bool = False

  @property
  def total(self) -> int:
    return self.memory['total']

  @property
  def fits(self) -> bool:
    return self.total <= (1.0 - HEADROOM) * self.usable_memory

  def overrides(self) -> dict[str, Any]:
    """The config fields that give this step."""
    if self.step == 'eval':
      return {'eval.batch_size': self.global_batch}
    return {'train.batch_size': self.global_batch,
            'train.grad_accum_steps': self.grad_accum_steps, 'mesh.fsdp': self.fsdp}

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {'fits': self.fits,
                                       'used_fraction': self.total / self.usable_memory}


@dataclasses.dataclass
class Search:
  """What a search for the largest batch found: the bounds, compiled, and why it stopped."""

  step: str                          # 'train' | 'eval'
  limit: float                       # Bytes per device a step may use (HEADROOM kept free).
  budget_s: float
  best: StepFigures | None = None    # The largest batch compiled that fits.
  too_big: int | None = None         # The fewest rows per device compiled that do not fit.
  predicted: int | None = None       # The line's next guess, when the budget stopped it.
  compiles: int = 0
  seconds: float = 0.0
  stopped: str = ''                  # Why it stopped before converging; '' when it converged.

  def as_dict(self) -> dict[str, Any]:
    return {'step': self.step, 'limit': self.limit, 'budget_s': self.budget_s,
            'largest_fitting': self.best.per_device_batch if self.best else None,
            'smallest_not_fitting': self.too_big, 'predicted': self.predicted,
            'compiles': self.compiles, 'seconds': self.seconds, 'stopped': self.stopped}


class Preflight:
  """Compiles a config's steps for one target; everything it learns is in `report()`."""

  def __init__(self, config, target: targets.Target,
               log: Callable[[str], None] = lambda s: None,
               search_budget_s: float = SEARCH_BUDGET_S,
               compiled: dict[str, tuple] | None = None):
    """compiled: the figures of the programs compiled so far, by their lowered text's hash;
    pre-flights of one target may share it (the phases of a run), so that a program lowered
    to the same text is compiled once."""
    self.target = target
    self._compiled = {} if compiled is None else compiled
    self.log = log
    try:
      checks.validate(config, num_devices=target.num_devices, check_paths=False)
    except ConfigError as e:
      raise PreflightError(f'{e} (target {target.name}: {target.num_devices} devices)') from None
    self.config = config
    self.devices = targets.compile_devices(target)
    self.usable_memory, self.memory_note = target.usable_memory()
    self._seconds_per_cycle: float | None = None
    if not search_budget_s >= 0:
      raise PreflightError(f'--search_budget_s={search_budget_s}: seconds of compiles, 0 or more')
    self.search_budget_s = search_budget_s
    self._search_spent = 0.0     # Seconds of compiles the searches have taken so far.

  # ------------------------------------------------------------ compiling

  def compile(self, overrides: dict[str, Any] | None = None, step: str = 'train') -> StepFigures:
    """Lowers and compiles one step of the config (with `overrides`) for the target."""
    import jax  # pylint: disable=import-outside-toplevel

    from mlm_jax.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
    from mlm_jax.perf import hlo_cost  # pylint: disable=import-outside-toplevel
    from mlm_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
    from mlm_jax.training import build as build_lib  # pylint: disable=import-outside-toplevel
    from mlm_jax.training import state as state_lib  # pylint: disable=import-outside-toplevel
    config = _with_overrides(self.config, overrides or {})
    mesh = sharding.make_mesh(config.mesh.fsdp, self.devices)
    # The embedding rows the trainer builds: a checkpoint's table (config.model.vocab_size),
    # else the tokenizer's size.
    vocab_size = tok_lib.model_vocab_size(config.model.vocab_size, config.tokenizer.vocab_size)
    with targets.tracing_for(self.target):
      built = build_lib.build(config, vocab_size, mesh)
    self.built = built
    batch_size = config.train.batch_size if step == 'train' else config.eval.batch_size
    batch_sh = sharding.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sh)
             for k, x in state_lib.batch_spec(
                 batch_size, config.data.seq_len, config.masking.max_predictions,
                 config.sentence_pair.task != 'none').items()}
    rng = jax.ShapeDtypeStruct(built.dropout_rng.shape, built.dropout_rng.dtype,
                               sharding=sharding.replicated(mesh))
    start = time.perf_counter()
    with targets.tracing_for(self.target):
      if step == 'train':
        lowered = built.train_step.lower(built.abstract_state, batch, rng)
      else:
        lowered = built.eval_step.lower(built.abstract_state, batch)
    n = self.target.num_devices
    figures = StepFigures(
        step=step, global_batch=batch_size, per_device_batch=batch_size // n,
        grad_accum_steps=config.train.grad_accum_steps if step == 'train' else 1,
        fsdp=config.mesh.fsdp, memory={},
        usable_memory=self.usable_memory, compile_s=0.0, flops=None, flops_source='', hlo={},
        xla_cost={})
    key = f'{step}:{hashlib.sha256(lowered.as_text().encode()).hexdigest()}'
    if key in self._compiled:
      (figures.memory, figures.compile_error, figures.hlo, figures.xla_cost, figures.flops,
       figures.flops_source) = self._compiled[key]
      figures.reused = True
      figures.compile_s = time.perf_counter() - start
      self._log_compile(figures)
      return figures
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # The TPU compiler refuses a program that cannot fit, saying how much it needs.
      temporaries = _refused_temporaries(str(e))
      if temporaries is None:
        raise PreflightError(_compiler_failure(str(e), step, self.target.name,
                                               config.masking.max_predictions)) from None
      figures.memory = _memory(None, built.abstract_state, batch, temporaries)
      figures.compile_error = str(e).splitlines()[0][:300]
    else:
      text = compiled.as_text()
      # A batch warm-up's accumulation loop runs to a count the rows set: counted at the full
      # batch's micro-batches.
      figures.hlo = hlo_cost.summary(
          text, figures.grad_accum_steps if built.growing_batch else 1)
      figures.xla_cost = _xla_cost(compiled)
      if 'flops' in figures.xla_cost:
        figures.flops, figures.flops_source = figures.xla_cost['flops'], "XLA's cost analysis"
      else:
        figures.flops = figures.hlo['matmul_flops']
        figures.flops_source = 'matrix multiplies counted in the compiled HLO'
      figures.memory = _memory(compiled, built.abstract_state, batch)
    figures.compile_s = time.perf_counter() - start
    self._compiled[key] = (figures.memory, figures.compile_error, figures.hlo, figures.xla_cost,
                           figures.flops, figures.flops_source)
    self._log_compile(figures)
    return figures

  def _log_compile(self, figures: StepFigures) -> None:
    self.log(f'  {figures.step} step, global batch {figures.global_batch} '
             f'({figures.per_device_batch} per device'
             + (f', {figures.grad_accum_steps} micro-batches' if figures.grad_accum_steps > 1 else '')
             + (f', fsdp={figures.fsdp}' if figures.fsdp > 1 else '')
             + f'): {_gib(figures.total)} per device, '
             + ('fits' if figures.fits else 'does not fit')
             + (' (refused by the compiler)' if figures.compile_error else '')
             + (' (the program of an earlier compile: not compiled again)' if figures.reused
                else f' ({figures.compile_s:.0f} s)'))

  # ---------------------------------------------------------- suggestions

  def largest_batch(self, overrides: dict[str, Any] | None = None, step: str = 'train',
                    refused: StepFigures | None = None) -> Search:
    """The largest per-device batch whose `step` fits (same accumulation and fsdp), compiled.

    Memory per device is close to linear in the rows: a + b * rows (the state, gradients and
    program do not grow; activations do, a little slower than linearly as the compiler reuses
    buffers, and at a few rows not at all). Two compiles at small batches (`_calibration_rows`
    per device and twice it) give the line; its prediction of the batch at the limit is compiled
    to confirm it. Once a batch is known not to fit (the config's own, `refused`: the TPU
    compiler refuses it in seconds, with the memory it needs), a guess comes from the line
    through the largest batch that fits and the smallest that does not (regula falsi); a guess
    that did not fit steps down by the smaller of that slope and the small compiles' own.
    Guesses stay inside the bracket and are whole micro-batches (multiples of 8 of them once
    large). The search ends when the next guess is within 5% of a batch that fits (or no whole
    guess is left inside the bracket), or when the search budget (`search_budget_s` of compiles,
    shared by every search of this pre-flight) is spent: the two small compiles and the first
    prediction always run, later ones only while budget is left. `best` is None when not even
    one row per micro-batch fits.
    """
    overrides = dict(overrides or {})
    config = _with_overrides(self.config, overrides)
    n, limit = self.target.num_devices, (1.0 - HEADROOM) * self.usable_memory
    unit = config.train.grad_accum_steps if step == 'train' else 1
    field = 'train.batch_size' if step == 'train' else 'eval.batch_size'
    search = Search(step=step, limit=limit, budget_s=self.search_budget_s)
    if refused is not None and not refused.fits:
      search.too_big = refused.per_device_batch
    points: list[tuple[int, int]] = []      # (rows per device, bytes per device)
    too_big_total = refused.total if search.too_big is not None else 0

    def compile_rows(rows: int) -> None:
      nonlocal too_big_total
      start = time.perf_counter()
      figures = self.compile(overrides | {field: rows * n}, step)
      elapsed = time.perf_counter() - start
      search.compiles += 1
      search.seconds += elapsed
      self._search_spent += elapsed
      points.append((rows, figures.total))
      if figures.fits:
        if search.best is None or rows > search.best.per_device_batch:
          search.best = figures
      elif search.too_big is None or rows < search.too_big:
        search.too_big, too_big_total = rows, figures.total

    first_rows = _calibration_rows(config.data.seq_len, unit)
    for rows in (first_rows, 2 * first_rows):
      if search.too_big is not None and rows >= search.too_big:
        break
      compile_rows(rows)
    if search.best is None and search.too_big is not None and search.too_big > unit:
      compile_rows(unit)                             # The smallest batch: does anything fit?
    small_slope = (max((points[1][1] - points[0][1]) / (points[1][0] - points[0][0]), 1.0)
                   if len(points) >= 2 and points[0][0] == first_rows else None)
    while search.best is not None and (search.too_big is not None or len(points) >= 2):
      if search.best is not None and search.too_big is not None:
        # Between the bounds (regula falsi): the line through the largest batch that fits
        # and the smallest that does not, whose memory is on the line at large batches.
        (b0, t0), (b1, t1) = ((search.best.per_device_batch, search.best.total),
                              (search.too_big, too_big_total))
      else:
        (b0, t0), (b1, t1) = points[-2:]
      per_row = max((t1 - t0) / (b1 - b0), 1.0)
      if points[-1][1] > limit and small_slope is not None:
        # The last guess did not fit: step down by the smaller of this slope and the small
        # compiles' own, so that memory that jumps between them (a buffer the compiler no
        # longer reuses) is stepped over in one compile.
        per_row = min(per_row, small_slope)
      guess = (limit - t1) / per_row + b1
      low = search.best.per_device_batch if search.best else 0
      if search.too_big is not None and not low < guess < search.too_big:
        guess = (low + search.too_big) / 2          # Outside the bracket: bisect it.
      guess = _round_batch(int(guess), unit)
      if guess <= 1.05 * low or (search.too_big is not None and guess >= search.too_big):
        break          # Within 5% of a batch that fits, or no whole multiple left between.
      if search.compiles > 2 and self._search_spent >= self.search_budget_s:
        search.predicted = guess
        search.stopped = (f'the search budget of {self.search_budget_s:.0f} s of compiles was '
                          'spent (--search_budget_s)')
        break
      compile_rows(guess)
    return search

  def suggestions(self, first: StepFigures
                  ) -> tuple[Search, list[tuple[str, StepFigures | None]]]:
    """Changes to a train step that does not fit; compiled ones that fit come first.

    A change left uncompiled because the search budget was spent is listed
    with None figures.
    """
    out: list[tuple[str, StepFigures | None]] = []
    n = self.target.num_devices
    search = self.largest_batch(first.overrides(), refused=first)
    largest = search.best
    if largest is not None:
      out.append((f'the largest batch that fits: {largest.per_device_batch} rows per device '
                  f'(global {largest.global_batch})', largest))
      micro = largest.per_device_batch // max(largest.grad_accum_steps, 1)
      k = _accumulation_for(first.global_batch, n, micro)
      if k is not None and k != first.grad_accum_steps:
        what = (f'the same global batch {first.global_batch} in {k} micro-batches of '
                f'{first.global_batch // n // k} rows per device')
        out.append((what, self._compile_within_budget(
            first.overrides() | {'train.grad_accum_steps': k})))
    fsdp = self._fsdp_choice(first)
    if fsdp is not None:
      out.append((f'the parameters and optimizer state split over {fsdp} devices '
                  f'(mesh.fsdp={fsdp})',
                  self._compile_within_budget(first.overrides() | {'mesh.fsdp': fsdp})))
    out.sort(key=lambda s: not (s[1] is not None and s[1].fits))
    return search, out

  def _compile_within_budget(self, overrides: dict[str, Any]) -> StepFigures | None:
    """The train step with `overrides`, compiled while search budget is left; else None."""
    if self._search_spent >= self.search_budget_s:
      return None
    start = time.perf_counter()
    figures = self.compile(overrides)
    self._search_spent += time.perf_counter() - start
    return figures

  def _fsdp_choice(self, first: StepFigures) -> int | None:
    """The fsdp size to try: the most devices that divide the width and the device count."""
    d, n = self.config.model.hidden_size, self.target.num_devices
    if first.fsdp > 1:
      return None
    # On GPUs keep the weight gathers inside a node (NVLink); TPU slices are one ICI domain.
    group = self.target.devices_per_host if self.target.platform == 'gpu' else n
    choices = [f for f in range(group, 1, -1) if n % f == 0 and d % f == 0 and group % f == 0]
    return choices[0] if choices else None

  # ------------------------------------------------------------- estimates

  def seconds_per_cycle(self) -> float:
    """Seconds per estimated cycle of the TPU compiler, on XLA's optimal_seconds scale.

    The whole-step optimal_seconds is not usable (it comes out negative for
    these programs: some fusions have no cost model and count -1), so the
    per-fusion cycle estimates are summed instead and converted at the rate
    XLA gives for a reference bf16 matmul on the same target.
    """
    if self._seconds_per_cycle is None:
      import jax  # pylint: disable=import-outside-toplevel
      import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

      from mlm_jax.perf import hlo_cost  # pylint: disable=import-outside-toplevel
      mesh = jax.sharding.Mesh(self.devices[:1], ('x',))
      x = jax.ShapeDtypeStruct((_REFERENCE_MATMUL,) * 2, jnp.bfloat16,
                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
      compiled = jax.jit(jnp.matmul).lower(x, x).compile()
      cycles = hlo_cost.summary(compiled.as_text())['estimated_cycles']
      self._seconds_per_cycle = _xla_cost(compiled)['optimal_seconds'] / cycles
    return self._seconds_per_cycle

  def collective_seconds(self, figures: StepFigures) -> float:
    """Time of the step's collectives if nothing overlapped them: bytes over link bandwidth.

    A ring all-reduce sends and receives about twice its data, the other
    collectives about once; GPUs of several nodes are limited by the network.
    """
    from mlm_jax.runtime import hardware  # pylint: disable=import-outside-toplevel
    t = self.target
    bandwidth = (hardware.NODE_NETWORK_BANDWIDTH if t.platform == 'gpu' and t.num_hosts > 1
                 else t.chip.link_bandwidth)
    data = sum(v['bytes'] * (2 if kind == 'all-reduce' else 1)
               for kind, v in figures.hlo.get('collectives', {}).items())
    return data / bandwidth

  def estimate(self, figures: StepFigures) -> dict[str, Any] | None:
    """Compiler estimate of a TPU train step: seconds, tokens/s, MFU; None elsewhere.

    Compute: the TPU compiler's per-operation cycle estimates, summed. Plus
    the collectives at the link bandwidth, not overlapped with compute (an
    upper bound for them).
    """
    cycles = figures.hlo.get('estimated_cycles')
    if self.target.platform != 'tpu' or not cycles:
      return None
    compute = cycles * self.seconds_per_cycle()
    collectives = self.collective_seconds(figures)
    splash = self.splash_seconds(figures)
    seconds = compute + collectives + splash
    tokens = figures.global_batch * self.config.data.seq_len
    model_flops = self.model_flops_per_device(figures)
    return {
        'label': 'compiler estimate, not measured: the TPU compiler\'s per-operation cycle '
                 'estimates summed, plus collectives at the data-sheet link bandwidth with no '
                 'overlap' + (', plus splash attention (which the compiler does not estimate) '
                              "as its computed tiles' FLOPs at the chip's peak" if splash else ''),
        'step_time_s': seconds, 'compute_s': compute, 'collectives_s': collectives,
        'splash_s': splash,
        'tokens_per_sec': tokens / seconds,
        'mfu': model_flops / (seconds * self.target.chip.peak_flops),
        'seconds_per_cycle': self.seconds_per_cycle(),
        'compute_share_by_part': {k: v / cycles for k, v in figures.hlo['cycles_by_part'].items()},
    }

  def splash_seconds(self, figures: StepFigures) -> float:
    """A floor on the splash kernels' time: the FLOPs of the tiles they compute at peak.

    Splash attention is a custom call, which carries no cycle estimate. Per
    token and splash layer it computes 2 matmuls of 2·keys·d FLOPs forward
    and 7 backward (the dq kernel 3, the dkv kernel 4), over whole tiles
    (attention.splash_keys).
    """
    from mlm_jax.model import attention  # pylint: disable=import-outside-toplevel
    if not figures.hlo.get('splash_attention_calls'):
      return 0.0
    cfg = self.built.model_cfg
    tokens = figures.global_batch * self.config.data.seq_len / self.target.num_devices
    passes = 9 if figures.step == 'train' else 2
    flops = sum(passes * 2 * cfg.hidden_size * attention.splash_keys(c.q_len, c.kv_len, c.window)
                * tokens * len(c.layers)
                for c in self._attention_plan() if c.kernel == 'splash')
    return flops / self.target.chip.peak_flops

  def _attention_plan(self, training: bool = True) -> list:
    from mlm_jax.model import attention  # pylint: disable=import-outside-toplevel
    pairs = self.config.sentence_pair.task != 'none'
    return attention.plan(self.built.model_cfg, self.config.data.seq_len,
                          self.config.masking.max_predictions + int(pairs), training)

  def attention_report(self, train: StepFigures) -> dict[str, Any]:
    """The kernel of each kind of attention call and why; fused calls planned and compiled.

    A fused kernel is a custom call in the compiled step: cuDNN's runs twice
    per layer in a train step (forward, backward), splash attention and our
    flash kernel three times (forward, dq, dkv); each once per micro-batch.
    """
    plan = self._attention_plan()
    per_layer = {'cudnn': 2, 'flash': 3, 'splash': 3}
    fused = {}
    for kernel, times in per_layer.items():
      expected = train.grad_accum_steps * sum(times * len(c.layers) for c in plan
                                              if c.kernel == kernel)
      compiled = train.hlo.get(f'{kernel}_attention_calls', 0)
      if expected or compiled:
        fused[kernel] = {'expected': expected, 'compiled': compiled}
    return {'plan': [{'what': c.what, 'kernel': c.kernel, 'why': c.why} for c in plan],
            'fused_calls': fused}

  def model_flops_per_device(self, figures: StepFigures) -> float:
    """flops.py's training FLOPs of one step, per device."""
    from mlm_jax.model import flops as flops_lib  # pylint: disable=import-outside-toplevel
    per_token = flops_lib.model_flops_per_token(
        self.built.model_cfg, self.config.data.seq_len, self.config.masking.max_predictions)
    tokens = figures.global_batch * self.config.data.seq_len / self.target.num_devices
    forward_only = 1 / 3 if figures.step == 'eval' else 1.0
    return per_token * tokens * forward_only

  def explain_flops(self, figures: StepFigures) -> str:
    """Why the compiled FLOPs differ from flops.py's count, when they differ by over 10%."""
    model = self.model_flops_per_device(figures)
    if not figures.flops or abs(figures.flops / model - 1) <= 0.10:
      return ''
    mdl = self.config.model
    reasons = []
    if mdl.remat != 'none':
      reasons.append(f"model.remat='{mdl.remat}' recomputes block activations in the backward "
                     'pass; flops.py counts each model FLOP once')
    if mdl.drop_token_rate > 0:
      reasons.append(f'DropToken removes {mdl.drop_token_rate:.0%} of the unmasked tokens from '
                     "the encoder's input")
    if figures.flops_source.startswith('XLA'):
      if figures.grad_accum_steps > 1:
        k = figures.grad_accum_steps
        reasons.append(f"XLA's cost analysis counts the loop over the {k} micro-batches once: "
                       f"its figure is about one micro-batch's ({k}x is "
                       f'{k * figures.flops / 1e12:,.1f} T)')
      reasons.append("XLA's count includes elementwise and reduction FLOPs (softmax, GELU, "
                     'LayerNorm, the optimizer update) that flops.py leaves out')
      if figures.hlo.get('splash_attention_calls'):
        reasons.append("it leaves out the splash attention kernels (custom calls, which XLA's "
                       'cost analysis does not see)')
    else:
      reasons.append('the HLO count covers matrix multiplies only')
    if figures.hlo.get('flash_attention_calls'):
      reasons.append('the flash attention kernels count as whole tiles of their band or row, '
                     'with the products the backward pass recomputes (9 per query-key pair '
                     "against flops.py's 6), though documents and padding let them skip tiles "
                     'as they run')
    return '; '.join(reasons)

  # ---------------------------------------------------------------- report

  def _changed(self, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that differ from the config's own values."""
    return {k: v for k, v in overrides.items()
            if self.config[k.split('.')[0]][k.split('.')[1]] != v}

  def run(self) -> dict[str, Any]:
    """Compiles the train and eval steps (and, if needed, what would fit); all figures."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    t = self.target
    self.log(f'Compiling for {t.name}: {t.num_devices} x {self.devices[0].device_kind} '
             f'({t.num_hosts} host{"s" if t.num_hosts > 1 else ""} x {t.devices_per_host})')
    train = self.compile(step='train')
    evaluation = self.compile(step='eval')
    report: dict[str, Any] = {
        'target': dataclasses.asdict(t) | {'num_hosts': t.num_hosts,
                                           'device_kind': self.devices[0].device_kind},
        'usable_memory': self.usable_memory, 'usable_memory_note': self.memory_note,
        'headroom_required': HEADROOM,
        'model': {'dtype': jnp.dtype(self.built.model_cfg.dtype).name,
                  'attention': self.built.model_cfg.attention,
                  'document_mask': self.built.model_cfg.document_mask,
                  'num_layers': self.config.model.num_layers,
                  'hidden_size': self.config.model.hidden_size,
                  'seq_len': self.config.data.seq_len,
                  'padded_vocab_size': self.built.model_cfg.padded_vocab_size},
        'train': train.as_dict(), 'eval': evaluation.as_dict(),
        'model_flops_per_device': self.model_flops_per_device(train),
        'flops_difference_explained': self.explain_flops(train),
        'estimate': self.estimate(train),
    }
    problems = []
    report['attention'] = self.attention_report(train)
    for kernel, calls in report['attention']['fused_calls'].items():
      if calls['compiled'] < calls['expected']:
        problems.append(f"the plan gives {calls['expected']} {kernel} attention calls, but the "
                        f"train step compiled {calls['compiled']}")
    searches = []
    if not train.fits:
      problems.append('the train step does not fit')
      search, changes = self.suggestions(train)
      searches.append(search)
      report['suggestions'] = [_suggestion(what, s, self._changed) for what, s in changes]
    if not evaluation.fits:
      problems.append('the eval step does not fit')
      search = self.largest_batch(evaluation.overrides(), step='eval', refused=evaluation)
      searches.append(search)
      if search.best:
        report.setdefault('suggestions', []).append(_suggestion(
            f'an eval batch that fits: {search.best.per_device_batch} rows per device',
            search.best, self._changed))
    if searches:
      report['searches'] = [s.as_dict() for s in searches]
    report['problems'] = problems
    report['ok'] = not problems
    return report


# ------------------------------------------------------------------ helpers


def _suggestion(what: str, figures: StepFigures | None, changed) -> dict[str, Any]:
  """A suggestion as the report keeps it; None figures: not compiled (budget spent)."""
  if figures is None:
    return {'change': what, 'overrides': {}, 'fits': None, 'figures': None}
  return {'change': what, 'overrides': changed(figures.overrides()), 'fits': figures.fits,
          'figures': figures.as_dict()}


def _with_overrides(config, overrides: dict[str, Any]):
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for dotted, value in overrides.items():
      section, field = dotted.split('.')
      config[section][field] = value
  return config


def _calibration_rows(seq_len: int, unit: int) -> int:
  """Rows per device of a search's first compile: about 2,048 tokens per micro-batch.

  The smallest batches are not on the line: at one or two rows the compiler
  may keep every activation in place and report no temporaries, which makes
  the slope from them wrong. A couple of thousand tokens per device is on
  the line and still fits every target (BERT-large at T=512 on a v5e).
  """
  return max(1, 2048 // seq_len) * unit


def _round_batch(rows: int, unit: int) -> int:
  """`rows` down to a multiple of `unit`, and of 8 units once it is that large."""
  step = unit * 8 if rows >= unit * 16 else unit
  return rows // step * step


def _accumulation_for(global_batch: int, num_devices: int, micro_rows: int) -> int | None:
  """Fewest micro-batches k with at most `micro_rows` rows per device each (k must divide)."""
  rows = global_batch // num_devices
  for k in range(1, rows + 1):
    if rows % k == 0 and rows // k <= micro_rows:
      return k
  return None


def _shard_bytes(x) -> int:
  shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
  return math.prod(shape) * x.dtype.itemsize


def _compiler_failure(message: str, step: str, target: str, max_predictions: int) -> str:
  """One line for a compiler that failed on a step for another reason than memory."""
  first = message.strip().splitlines()[0][:300]
  hint = ''
  if 'tile sizes' in message and max_predictions % 8:
    # XLA's GPU compiler tiles the last block's matmuls over batch x P rows in tiles that
    # must divide P (seen with P=307: 30% of a 1,024-token row).
    hint = (f'; config.masking.max_predictions={max_predictions} has no tiling there: round '
            f'it up to a multiple of 8 ({-(-max_predictions // 8) * 8}; padded slots weigh 0)')
  return f'the compiler for {target} failed on the {step} step: {first}{hint}'


def _refused_temporaries(message: str) -> int | None:
  """Bytes of temporaries in the TPU compiler's out-of-memory refusal, if it is one."""
  m = re.search(r'RESOURCE_EXHAUSTED.*?temporaries \(([\d.]+)([KMGT])\)', message, re.S)
  if not m:
    return None
  return int(float(m.group(1)) * 1024 ** ('KMGT'.index(m.group(2)) + 1))


def _memory(compiled, abstract_state, batch, refused_temporaries: int = 0) -> dict[str, int]:
  """Per-device memory of a compiled step (or of one the compiler refused)."""
  import jax  # pylint: disable=import-outside-toplevel
  state = sum(_shard_bytes(x) for x in jax.tree_util.tree_leaves(abstract_state))
  batch_bytes = sum(_shard_bytes(x) for x in batch.values())
  if compiled is None:
    memory = {'state': state, 'batch': batch_bytes, 'arguments': state + batch_bytes,
              'outputs': state, 'aliased': state, 'temporaries': refused_temporaries,
              'program': 0}
  else:
    m = compiled.memory_analysis()
    memory = {
        'state': state, 'batch': batch_bytes,
        'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
        'aliased': m.alias_size_in_bytes, 'temporaries': m.temp_size_in_bytes,
        'program': m.generated_code_size_in_bytes,
    }
  # The whole state stays on the device (the eval step reads the parameters
  # only); donated arguments that become outputs are counted once.
  memory['total'] = (max(memory['arguments'], memory['state'] + memory['batch'])
                     + memory['outputs'] - memory['aliased'] + memory['temporaries']
                     + memory['program'])
  return memory


def _xla_cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0] if cost else None
  if not cost:
    return {}
  return {k: float(cost[k]) for k in ('flops', 'bytes accessed', 'optimal_seconds') if k in cost}


def _gib(x: float) -> str:
  return f'{x / 2**30:.2f} GiB'


def format_report(report: dict[str, Any]) -> str:
  """The short table the command prints."""
  t, m, train, ev = report['target'], report['model'], report['train'], report['eval']
  lines = [
      f"{t['name']}: {t['num_devices']} x {t['device_kind']} ({t['num_hosts']} host(s) x "
      f"{t['devices_per_host']}); usable memory per device {_gib(report['usable_memory'])} "
      f"({report['usable_memory_note']})",
      f"model: L={m['num_layers']} d={m['hidden_size']} T={m['seq_len']} "
      f"V={m['padded_vocab_size']}, {m['dtype']}, attention {m['attention']}",
      '',
      f"{'per device':<26}{'train':>12}{'eval':>12}",
      f"{'batch rows':<26}{train['per_device_batch']:>12}{ev['per_device_batch']:>12}",
  ]
  for key, label in (('state', 'params + optimizer state'), ('batch', 'batch'),
                     ('temporaries', 'temporaries'), ('program', 'program'), ('total', 'total')):
    lines.append(f"{label:<26}{_gib(train['memory'][key]):>12}{_gib(ev['memory'][key]):>12}")
  lines.append(f"{'share of usable memory':<26}{train['used_fraction']:>12.1%}"
               f"{ev['used_fraction']:>12.1%}")
  lines.append(f"{'fits (>= 10% free)':<26}{'yes' if train['fits'] else 'NO':>12}"
               f"{'yes' if ev['fits'] else 'NO':>12}")
  lines.append('')
  model_flops = report['model_flops_per_device']
  if train['flops']:
    lines.append(f"FLOPs per device per train step: {train['flops'] / 1e12:.3f} T "
                 f"({train['flops_source']}) vs {model_flops / 1e12:.3f} T from flops.py "
                 f"({train['flops'] / model_flops - 1:+.1%})")
  if report['flops_difference_explained']:
    lines.append(f"  difference: {report['flops_difference_explained']}")
  est = report['estimate']
  if est:
    parts = ', '.join(f'{k} {v:.0%}' for k, v in list(est['compute_share_by_part'].items())[:4])
    splash = (f" + {est['splash_s'] * 1e3:.1f} splash attention at peak"
              if est.get('splash_s') else '')
    lines.append(f"compiler estimate, not measured: step {est['step_time_s'] * 1e3:.1f} ms "
                 f"({est['compute_s'] * 1e3:.1f} compute + {est['collectives_s'] * 1e3:.1f} "
                 f"collectives{splash}), {est['tokens_per_sec']:,.0f} tokens/s, "
                 f"MFU {est['mfu']:.1%}")
    lines.append(f'  largest shares of compute: {parts}')
  coll = train['hlo'].get('collectives')
  if coll:
    lines.append('collectives per train step: ' + ', '.join(
        f"{v['count']} {k} ({_gib(v['bytes'])})" for k, v in coll.items()))
  attention = report.get('attention')
  if attention:
    lines.append(f"attention (config.model.attention={m['attention']!r}, documents "
                 f"{'apart' if m.get('document_mask') else 'not kept apart'}):")
    for c in attention['plan']:
      lines.append(f"  {c['what']}: {c['kernel']}" + (f" ({c['why']})" if c['why'] else ''))
    for kernel, calls in attention['fused_calls'].items():
      lines.append(f"  {kernel} calls in the train step: {calls['compiled']} "
                   f"(planned {calls['expected']})")
  usable = report['usable_memory']
  for s in report.get('suggestions', []):
    if s['figures'] is None:
      lines.append(f"not compiled (search budget spent): {s['change']}")
      continue
    flags_ = ' '.join(f'--config.{k}={v}' for k, v in s['overrides'].items())
    lines.append(f"{'fits' if s['fits'] else 'does not fit'}: {s['change']} "
                 f"({_gib(s['figures']['memory']['total'])} of {_gib(usable)} per device): "
                 f'{flags_}')
  for search in report.get('searches', []):
    lines.append(_search_line(search))
  lines.append('')
  lines.append('OK: fits' if report['ok'] else 'FAILED: ' + '; '.join(report['problems']))
  return '\n'.join(lines)


def _search_line(search: dict[str, Any]) -> str:
  """How a search for the largest batch went; its bounds when it stopped early."""
  line = (f"search for the largest {search['step']} batch: {search['compiles']} compiles in "
          f"{search['seconds']:.0f} s")
  if not search['stopped']:
    return line
  bounds = []
  if search['largest_fitting']:
    bounds.append(f"{search['largest_fitting']} rows per device fit (compiled)")
  if search['predicted']:
    bounds.append(f"the line through the compiles predicts {search['predicted']} (not compiled)")
  if search['smallest_not_fitting']:
    bounds.append(f"{search['smallest_not_fitting']} do not fit")
  return f"{line}; stopped: {search['stopped']}; best bounds: " + ', '.join(bounds)


# --------------------------------------------------------------- command
