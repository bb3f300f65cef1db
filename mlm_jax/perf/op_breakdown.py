"""Where a train step's time goes, by kind of operation, ours (jax.profiler) and HF's (torch.profiler).

`python -m mlm_jax.bench --config=... --compare=hf --breakdown` traces a few
steps of each after the timed windows and sums the time of every operation
into the same categories (CATEGORIES), so the two steps can be compared line
by line.

- Ours: the XLA program's operations (thunks of XLA:CPU, kernels of a GPU)
  from a jax.profiler trace, each matched by name to the compiled HLO, whose
  opcode and `op_name` metadata say what it is. XLA:CPU runs independent
  operations at the same time on its threads; each stretch of wall time is
  shared equally among the operations running in it, so the categories add
  up to the time the device was busy (wall-clock), as torch's do.
- HF: torch.profiler's self time of each aten operation on the calling
  thread (an operation's own intra-op threads are inside it).

Times are per step, averaged over the traced steps. Tracing adds a little
overhead to both, so the totals can exceed the timed step; each breakdown
also gives the wall time per step of its traced steps (`traced_step_s`),
measured under the tracer and the same load, which its total stays within.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from mlm_jax.perf import hlo_cost

CATEGORIES = (
    'matmul: attention', 'matmul: MLP', 'matmul: MLM head', 'matmul: other',
    'attention (fused kernel)', 'softmax', 'layer norm', 'GELU / GeGLU', 'dropout',
    'embeddings, gathers, scatters', 'loss', 'optimizer update', 'copies and transposes',
    'other elementwise', 'collectives (several devices)',
)


# ----------------------------------------------------------------- ours (XLA)


def categorize_hlo(ins: hlo_cost.Instruction, inner: list[hlo_cost.Instruction]) -> str:
  """The category of one executed HLO instruction (a fusion with the instructions it calls)."""
  opcodes = {ins.opcode} | {x.opcode for x in inner}
  op_names = [n for n in [ins.op_name] + [x.op_name for x in inner] if n]
  names = ' '.join(op_names).lower()
  phase, part = hlo_cost.phase_and_part(op_names[0] if op_names else '')
  exp_reduce = 'exponential' in opcodes and opcodes & {'reduce', 'reduce-window'}
  if {op.removesuffix('-start') for op in opcodes} & set(hlo_cost.COLLECTIVES):
    return 'collectives (several devices)'
  if opcodes & {'dot', 'convolution'}:
    if exp_reduce and part == 'attention':
      return 'attention (fused kernel)'  # Scores, softmax (and more) in one kernel.
    if part in ('attention', 'MLP', 'MLM head'):
      return f'matmul: {part}'
    return 'matmul: other'
  if phase == 'optimizer and metrics':
    return 'optimizer update'
  if 'softmax' in names and 'log_softmax' not in names or (exp_reduce and part == 'attention'):
    return 'softmax'
  if 'layer_norm' in names or 'layernorm' in names or 'rms_norm' in names:
    return 'layer norm'
  if 'gelu' in names or opcodes & {'erf', 'tanh'} or ('exponential' in opcodes
                                                      and not exp_reduce):
    return 'GELU / GeGLU'  # Exact GELU's derivative holds exp(-x^2 / 2).
  if 'dropout' in names or 'rng-bit-generator' in opcodes or 'threefry' in names:
    return 'dropout'
  if opcodes & {'gather', 'scatter', 'dynamic-slice', 'dynamic-update-slice'}:
    return 'embeddings, gathers, scatters'
  if 'log_softmax' in names or 'cross_entropy' in names or exp_reduce:
    return 'loss'
  if opcodes <= {'copy', 'transpose', 'bitcast', 'reshape', 'parameter', 'tuple',
                 'get-tuple-element', 'broadcast', 'constant'} or ins.name.startswith(
                     ('copy', 'transpose')):
    return 'copies and transposes'
  return 'other elementwise'


def _wall_shares(events: list[tuple[float, float, str]]) -> dict[str, float]:
  """{name: wall time}: each stretch of time shared equally among the events running in it."""
  edges = sorted({t for start, end, _ in events for t in (start, end)})
  starts = collections.defaultdict(list)
  for start, end, name in events:
    starts[start].append((end, name))
  out: collections.Counter = collections.Counter()
  active: list[tuple[float, str]] = []
  for left, right in zip(edges, edges[1:]):
    active = [(end, name) for end, name in active if end > left] + starts.pop(left, [])
    if active:
      for _, name in active:
        out[name] += (right - left) / len(active)
  return dict(out)


def _op_intervals(trace_events: list[dict], names) -> list[tuple[float, float, str]]:
  """(start, end, name) of every executed XLA operation in a trace.

  An operation XLA:CPU runs asynchronously (Eigen's matmuls) has a trace
  event that ends when it is dispatched, and an `end: NAME` event when it
  completes, up to milliseconds later; its interval runs to the latter.
  """
  ops = [(e['ts'], e['ts'] + e['dur'], e['name']) for e in trace_events
         if e.get('ph') == 'X' and e.get('name') in names]
  completions = collections.defaultdict(list)
  for e in trace_events:
    name = e.get('name', '')
    if e.get('ph') == 'X' and name.startswith('end: ') and name[5:] in names:
      completions[name[5:]].append(e['ts'] + e.get('dur', 0))
  starts = collections.defaultdict(list)
  for start, _, name in ops:
    starts[name].append(start)
  for times in (*completions.values(), *starts.values()):
    times.sort()
  out = []
  for start, end, name in ops:
    # The first completion after this start and before the next start of the same operation.
    done, own = completions.get(name, []), starts[name]
    i, j = bisect.bisect_left(done, start), bisect.bisect_right(own, start)
    if i < len(done) and (j == len(own) or done[i] <= own[j]):
      end = max(end, done[i])
    out.append((start, end, name))
  return out


def jax_breakdown(compiled_text: str, run_steps: Callable[[int], float],
                  steps: int) -> dict[str, Any]:
  """Traces `run_steps(steps)` with jax.profiler; per-step seconds by category, and the top ops.

  `run_steps` returns the wall time of its steps, the last one finished on the device;
  every traced operation runs inside it, so the categories' total per step is at most
  `traced_step_s`, that wall time per step.
  """
  import jax  # pylint: disable=import-outside-toplevel
  module = hlo_cost.Module.parse(compiled_text)
  by_name = {ins.name: ins for body in module.computations.values() for ins in body}
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
      wall_s = run_steps(steps)
    finally:
      jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz'))
    with gzip.open(sorted(paths)[-1]) as f:
      trace = json.load(f)
  shares = _wall_shares(_op_intervals(trace['traceEvents'], by_name))
  seconds: collections.Counter = collections.Counter()
  for name, us in shares.items():
    ins = by_name[name]
    seconds[categorize_hlo(ins, module.inner(ins))] += us * 1e-6 / steps
  top = sorted(shares.items(), key=lambda kv: -kv[1])[:10]
  return {'seconds': _ordered(seconds), 'traced_step_s': wall_s / steps,
          'top': [{'name': n, 'seconds': us * 1e-6 / steps,
                   'category': categorize_hlo(by_name[n], module.inner(by_name[n])),
                   'op_name': by_name[n].op_name[-120:]} for n, us in top]}


# ------------------------------------------------------------------- HF (torch)

_TORCH_RULES = (
    (r'^aten::(_?scaled_dot_product|_flash_attention|_efficient_attention)', 'attention (fused kernel)'),
    (r'^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addbmm)$', 'matmul: other'),
    (r'^aten::(_softmax|softmax|_softmax_backward_data)$', 'softmax'),
    (r'^aten::(native_layer_norm|native_layer_norm_backward|layer_norm|_fused_rms_norm.*)$',
     'layer norm'),
    (r'^aten::(gelu|gelu_backward)$', 'GELU / GeGLU'),
    (r'^aten::(native_dropout|native_dropout_backward|dropout|bernoulli_?)$', 'dropout'),
    (r'^aten::(_log_softmax|_log_softmax_backward_data|nll_loss.*|cross_entropy_loss)$', 'loss'),
    (r'^aten::(embedding.*|index_select|index|index_put_|_index_put_impl_|gather|scatter.*|'
     r'masked_select|masked_scatter.*|index_add_)$', 'embeddings, gathers, scatters'),
    (r'^(aten::_foreach_.*|aten::_fused_adamw_?|Optimizer\..*|aten::lerp_?|aten::addcdiv_?|'
     r'aten::addcmul_?|aten::sqrt_?)', 'optimizer update'),
    (r'^aten::(copy_|clone|contiguous|t|transpose|permute|_to_copy|to|view|reshape|expand|'
     r'_unsafe_view|as_strided|empty.*|zero_|zeros|fill_|resize_|detach|select|slice|unsqueeze|'
     r'squeeze|split|chunk|cat|stack)$', 'copies and transposes'),
)


def categorize_torch(name: str) -> str | None:
  """The category of an aten operation; None for wrappers that only call others."""
  if not name.startswith('aten::') and not name.startswith('Optimizer.'):
    return None  # Autograd nodes, profiler scopes, Python frames: their ops count instead.
  for pattern, category in _TORCH_RULES:
    if re.match(pattern, name):
      return category
  return 'other elementwise'


def _matmul_part(shapes: list, mlp_widths: set[int], vocab_sizes: set[int],
                 token_counts: set[int] = frozenset()) -> str:
  """Which matmul an aten mm/addmm/bmm is, from its input shapes (token counts aside)."""
  dims = {d for shape in shapes if isinstance(shape, (list, tuple)) for d in shape}
  dims -= token_counts
  if dims & vocab_sizes:
    return 'matmul: MLM head'
  if dims & mlp_widths:
    return 'matmul: MLP'
  return 'matmul: attention'  # Q, K, V, output projections and the score products.


def torch_breakdown(run_steps: Callable[[int], float], steps: int, *, mlp_widths: set[int],
                    vocab_sizes: set[int], token_counts: set[int]) -> dict[str, Any]:
  """Profiles `run_steps(steps)` with torch.profiler; per-step seconds by category, top ops.

  Matmuls are told apart by their shapes, leaving out dimensions that count
  tokens (`token_counts`: B, T, B T, ...): one with a dimension in
  `mlp_widths` (d_ff, and 2 d_ff for a gated MLP) is the MLP's, one in
  `vocab_sizes` the head's, the others attention's. `run_steps` returns the wall time of its
  steps; the self times on its thread add up to at most that, per step `traced_step_s`.
  """
  from torch import profiler  # pylint: disable=import-outside-toplevel
  with profiler.profile(activities=[profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    wall_s = run_steps(steps)
  seconds: collections.Counter = collections.Counter()
  rows = []
  for avg in prof.key_averages(group_by_input_shape=True):
    category = categorize_torch(avg.key)
    if category is None:
      continue
    if category == 'matmul: other':
      category = _matmul_part(avg.input_shapes, mlp_widths, vocab_sizes, token_counts)
    s = avg.self_cpu_time_total * 1e-6 / steps
    seconds[category] += s
    rows.append((s, avg.key, category))
  rows.sort(reverse=True)
  return {'seconds': _ordered(seconds), 'traced_step_s': wall_s / steps,
          'top': [{'name': k, 'seconds': s, 'category': c} for s, k, c in rows[:10]]}


def _ordered(seconds: dict[str, float]) -> dict[str, float]:
  return {c: seconds[c] for c in CATEGORIES if seconds.get(c)}


def format_table(breakdowns: dict[str, dict[str, Any]]) -> str:
  """Categories down, systems across, ms per step and share of each system's total."""
  names = list(breakdowns)
  totals = {n: sum(b['seconds'].values()) for n, b in breakdowns.items()}
  width = max(len(c) for c in CATEGORIES + ('total',))
  header = ' ' * width + ''.join(f'  {n[:24]:>24}' for n in names)
  lines = ['Time per step by kind of operation (ms, share of the total):', header]
  for category in CATEGORIES + ('total',):
    cells = []
    for n in names:
      s = totals[n] if category == 'total' else breakdowns[n]['seconds'].get(category, 0.0)
      cells.append(f'{s * 1e3:9.2f} ms ({s / totals[n]:4.0%})' if totals[n] else '')
    if category == 'total' or any(breakdowns[n]['seconds'].get(category) for n in names):
      lines.append(category.ljust(width) + ''.join(f'  {c:>24}' for c in cells))
  for n in names:
    lines.append(f'largest operations, {n}:')
    lines += [f'  {t["seconds"] * 1e3:8.2f} ms  {t["category"]:<30} {t["name"][:60]}'
              for t in breakdowns[n]['top'][:6]]
  return '\n'.join(lines)
