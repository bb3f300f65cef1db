"""Reading a compiled XLA program (its optimized HLO text): where the time goes.

What the pre-flight needs from a compiled train step, without running it:

- TPU: the compiler's own cycle estimate for every fusion it emits
  (`"estimated_cycles"` in each instruction's backend config), summed over the
  program in execution order (while-loop bodies times their trip count), and
  attributed to the part of the model the instruction came from (its
  `op_name` metadata): forward / backward / optimizer, attention / MLP /
  LayerNorm / head. This is how the docs find what bounds a step.
- Every platform: the collectives (all-reduce, all-gather, reduce-scatter,
  ...) with their payload bytes, and the fused-attention calls (cuDNN's,
  and the Pallas kernels: splash attention, our flash kernel).
- GPU: matrix FLOPs counted from the `dot` instructions and the fused
  attention calls (a deviceless GPU compile has no cost analysis).

The text format is XLA's `HloModule::ToString`; only its stable parts are
read (instruction names, shapes, opcodes, operands, `calls=`/`body=`
references, `op_name` metadata and backend-config keys), and anything not
understood counts as zero rather than failing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
                's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4,
                's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b(' + '|'.join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                    + r')\[([0-9,]*)\]')
_CALLED = re.compile(r'\b(?:calls|to_apply|body|condition)=%([\w.\-]+)')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_CUDNN_ATTENTION = '__cudnn$fmha'
# Pallas's splash kernels keep their kernel's name: splash_mha_fwd..., _dq..., _dkv...
_SPLASH_KERNEL = re.compile(r'splash_m[hq]a_(fwd|dq|dkv)')
# Our flash kernels' Triton calls carry their name in the backend config, a
# banded one's with its window (model/attention/flash.py's kernel_name).
_FLASH_KERNEL = re.compile(r'\bname = "mlm_flash_(fwd|dkv|dq)(?:_w(\d+))?"')
# Matmuls of each flash kernel per query-key pair: the forward's q·kᵀ and p·v;
# dK/dV recomputes q·kᵀ, then dV, dP and dK; dQ recomputes q·kᵀ, then dP and dQ.
_FLASH_MATMULS = {'fwd': 2, 'dkv': 4, 'dq': 3}


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str           # Result type text, e.g. 'bf16[16,128]{1,0}' or a tuple '(…)'.
  opcode: str
  operands: tuple[str, ...]
  attributes: str      # Everything after the operand list.
  literal: str = ''    # A constant's value: the text inside 'constant(...)'.

  def attribute(self, key: str) -> str | None:
    m = re.search(rf'\b{key}=\{{([^}}]*)\}}', self.attributes)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attributes)
    return m.group(1) if m else ''

  @property
  def estimated_cycles(self) -> int:
    m = re.search(r'"estimated_cycles":"(\d+)"', self.attributes)
    return int(m.group(1)) if m else 0

  @property
  def called(self) -> list[str]:
    return _CALLED.findall(self.attributes)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in a type text; layouts ({...}) are ignored."""
  shape = re.sub(r'\{[^{}]*\}', '', shape)
  return [(d, tuple(int(x) for x in dims.split(',') if x)) for d, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
  return int(sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in arrays(shape)))


def _split_instruction(line: str) -> Instruction | None:
  line = line.strip()
  if line.startswith('ROOT '):
    line = line[5:]
  if not line.startswith('%') or ' = ' not in line:
    return None
  name, rest = line[1:].split(' = ', 1)
  if rest.startswith('('):               # A tuple type: find its closing parenthesis.
    depth = 0
    for i, ch in enumerate(rest):
      depth += (ch == '(') - (ch == ')')
      if depth == 0:
        break
    shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
  else:
    shape, _, rest = rest.partition(' ')
  opcode, _, rest = rest.partition('(')
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += (ch == '(') - (ch == ')')
    if depth == 0:
      end = i
      break
  operands = tuple(re.findall(r'%([\w.\-]+)', rest[:end]))
  literal = rest[:end].strip() if opcode == 'constant' else ''
  return Instruction(name, shape, opcode, operands, rest[end + 1:], literal)


def _open_braces(line: str) -> int:
  """Braces opened and not closed on a line, outside quoted strings."""
  depth, quoted, escaped = 0, False, False
  for ch in line:
    if escaped:
      escaped = False
    elif ch == '\\':
      escaped = True
    elif ch == '"':
      quoted = not quoted
    elif not quoted:
      depth += (ch == '{') - (ch == '}')
  return depth


def _logical_lines(text: str) -> list[str]:
  """The text's lines, an instruction whose attributes run over several lines joined into one.

  Pallas kernels (splash attention on TPUs) carry a multi-line
  kernel_metadata attribute; its continuation lines start in column 0 and
  would otherwise read as the end of the computation.
  """
  out: list[str] = []
  pending, depth = '', 0
  for line in text.splitlines():
    if pending:
      pending += line
      depth += _open_braces(line)
      if depth <= 0:
        out.append(pending)
        pending = ''
      continue
    if line[:1].isspace() and ' = ' in line:
      depth = _open_braces(line)
      if depth > 0:
        pending = line
        continue
    out.append(line)
  if pending:
    out.append(pending)
  return out


# Instructions whose called computations executed() walks, each instruction in them listed.
_CONTROL_FLOW = ('while', 'conditional', 'call', 'async-start')


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str
  # Iterations counted for a while loop whose count the program leaves to its data (trip_count).
  unknown_trips: int = 1

  @classmethod
  def parse(cls, text: str, unknown_trips: int = 1) -> 'Module':
    computations: dict[str, list[Instruction]] = {}
    entry, current = '', None
    for line in _logical_lines(text):
      if line and not line[0].isspace():
        m = re.match(r'(ENTRY\s+)?%([\w.\-]+)\s*[(]', line)
        if m and line.rstrip().endswith('{'):
          current = m.group(2)
          computations[current] = []
          if m.group(1):
            entry = current
        elif line.startswith('}'):
          current = None
        continue
      if current is not None:
        instruction = _split_instruction(line)
        if instruction is not None:
          computations[current].append(instruction)
    return cls(computations, entry, unknown_trips)

  def executed(self) -> list[tuple[Instruction, int]]:
    """Top-level instructions in execution order with how often each runs.

    The entry computation's instructions, and those of while-loop bodies
    (times the loop's trip count) and conditionals, recursively; a fusion's
    own instructions are not listed (they are inside its kernel).
    """
    out: list[tuple[Instruction, int]] = []

    def walk(name: str, times: int, depth: int) -> None:
      for ins in self.computations.get(name, []):
        out.append((ins, times))
        if depth < 8 and ins.opcode in _CONTROL_FLOW:
          for called in ins.called:
            if ins.opcode == 'while' and called == self._condition(ins):
              continue
            walk(called, times * (self.trip_count(ins) if ins.opcode == 'while' else 1),
                 depth + 1)

    walk(self.entry, 1, 0)
    return out

  def trip_count(self, loop: Instruction) -> int:
    """Iterations of a while loop: XLA's known_trip_count, else `i < constant` in its condition.

    The second form is what jax.lax.scan and fori_loop compile to (a counter
    from 0); a loop of another shape (a count that the data sets, as a batch
    warm-up's accumulation over the micro-batches a step fills) counts as
    `unknown_trips` iterations.
    """
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if m:
      return int(m.group(1))
    condition = self.computations.get(self._condition(loop) or '', [])
    literals = {x.name: x.literal for x in condition if x.opcode == 'constant'}
    for x in condition:
      if x.opcode == 'compare' and 'direction=LT' in x.attributes and len(x.operands) == 2:
        bound = literals.get(x.operands[1], '')
        if re.fullmatch(r'\d+', bound):
          return int(bound)
    return self.unknown_trips

  @staticmethod
  def _condition(ins: Instruction) -> str | None:
    m = re.search(r'\bcondition=%([\w.\-]+)', ins.attributes)
    return m.group(1) if m else None

  def inner(self, ins: Instruction) -> list[Instruction]:
    """Instructions of the computations a fusion (or custom call) calls, recursively."""
    out, stack, seen = [], list(ins.called), set()
    while stack:
      name = stack.pop()
      if name in seen:
        continue
      seen.add(name)
      for x in self.computations.get(name, []):
        out.append(x)
        stack.extend(x.called)
    return out

  def shape_of(self, computation: list[Instruction], name: str) -> str:
    for x in computation:
      if x.name == name:
        return x.shape
    return ''


# ------------------------------------------------------------- FLOPs (GPU)


def _dot_flops(ins: Instruction, shapes: dict[str, str]) -> float:
  """2 x output elements x contracted elements of a `dot`."""
  out = arrays(ins.shape)
  lhs = arrays(shapes.get(ins.operands[0], '')) if ins.operands else []
  if not out or not lhs:
    return 0.0
  contracting = ins.attribute('lhs_contracting_dims') or ''
  k = math.prod(lhs[0][1][int(i)] for i in contracting.split(',') if i.strip())
  return 2.0 * math.prod(out[0][1]) * k


def _cudnn_attention_flops(ins: Instruction, shapes: dict[str, str]) -> float:
  """Matrix FLOPs of a cuDNN fused attention call from q [B, T, N, H] and k.

  Forward: Q·Kᵀ and P·V (2 matmuls of 2·B·N·Tq·Tk·H); backward: those
  recomputed scores plus dV, dP, dQ, dK (5 matmuls).
  """
  q = arrays(shapes.get(ins.operands[0], '')) if ins.operands else []
  k = arrays(shapes.get(ins.operands[1], '')) if len(ins.operands) > 1 else []
  if not q or not k or len(q[0][1]) != 4:
    return 0.0
  b, tq, n, h = q[0][1]
  tk = k[0][1][1]
  matmuls = 5 if 'Backward' in ins.attributes else 2
  return matmuls * 2.0 * b * n * tq * tk * h


def _flash_attention_flops(ins: Instruction, shapes: dict[str, str]) -> float:
  """Matrix FLOPs of one of our flash kernels from q [B, Q, N, H] and k [B, T, N, H]: the
  key tiles it computes (only the band's in a banded kernel), as flash.flash_keys counts them.

  An upper bound: the tiles of other documents and of padding, which the
  kernel skips as it runs, are counted.
  """
  from mlm_jax.model.attention import flash  # pylint: disable=import-outside-toplevel
  m = _FLASH_KERNEL.search(ins.attributes)
  q = arrays(shapes.get(ins.operands[0], '')) if ins.operands else []
  k = arrays(shapes.get(ins.operands[1], '')) if len(ins.operands) > 1 else []
  if m is None or not q or not k or len(q[0][1]) != 4:
    return 0.0
  b, tq, n, h = q[0][1]
  tk = k[0][1][1]
  window = int(m.group(2)) if m.group(2) else None
  keys = flash.flash_keys(tq, tk, window, rows=False)   # A name without a window: no band.
  return _FLASH_MATMULS[m.group(1)] * 2.0 * b * n * tq * keys * h


def matmul_flops(module: Module) -> float:
  """FLOPs of every dot and fused attention call (cuDNN's, our flash kernels) that runs in
  one execution."""
  shapes_by_computation = {name: {x.name: x.shape for x in body}
                           for name, body in module.computations.items()}
  owner = {id(x): name for name, body in module.computations.items() for x in body}
  total = 0.0
  for ins, times in module.executed():
    shapes = shapes_by_computation[owner[id(ins)]]
    if ins.opcode == 'custom-call' and _CUDNN_ATTENTION in ins.attributes:
      total += times * _cudnn_attention_flops(ins, shapes)
      continue
    if ins.opcode == 'custom-call' and _FLASH_KERNEL.search(ins.attributes):
      total += times * _flash_attention_flops(ins, shapes)
      continue
    if ins.opcode in _CONTROL_FLOW:  # Its computations are listed by executed() themselves.
      continue
    for x in [ins] + module.inner(ins):
      if x.opcode == 'dot':
        total += times * _dot_flops(x, shapes_by_computation[owner[id(x)]])
  return total


# --------------------------------------------------- collectives and cuDNN


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str       # 'all-reduce', ...
  bytes: int      # Data per device: the larger of what goes in and what comes out.
  times: int      # Executions per step.
  op_name: str


def collectives(module: Module) -> list[Collective]:
  """Every collective of one execution, top-level or inside a fusion.

  An async pair counts once, at its start, whose result type lists the
  operands first.
  """
  out = []
  shapes = {name: {x.name: x.shape for x in body} for name, body in module.computations.items()}
  owner = {id(x): name for name, body in module.computations.items() for x in body}
  for top, times in module.executed():
    if top.opcode in _CONTROL_FLOW:
      continue  # Its computations are listed by executed() themselves.
    for ins in [top] + module.inner(top):
      kind = ins.opcode.removesuffix('-start')
      if kind not in COLLECTIVES:
        continue
      result = ins.shape
      if ins.opcode.endswith('-start') and result.startswith('('):
        result = _first_tuple_element(result)
      local = shapes[owner[id(ins)]]
      operands = sum(nbytes(local.get(name, '')) for name in ins.operands)
      out.append(Collective(kind, max(nbytes(result), operands), times, ins.op_name))
  return out


def _first_tuple_element(shape: str) -> str:
  depth = 0
  for i, ch in enumerate(shape):
    depth += (ch in '({') - (ch in ')}')
    if ch == ',' and depth == 1:
      return shape[1:i]
  return shape


def cudnn_attention_calls(module: Module) -> int:
  return sum(times for ins, times in module.executed()
             if ins.opcode == 'custom-call' and _CUDNN_ATTENTION in ins.attributes)


def flash_attention_calls(module: Module) -> int:
  """Our flash kernels run (forward, and dK/dV and dQ in the backward pass)."""
  return sum(times for ins, times in module.executed()
             if ins.opcode == 'custom-call' and _FLASH_KERNEL.search(ins.attributes))


def splash_attention_calls(module: Module) -> int:
  """Pallas splash attention kernels run (forward, and dq and dkv in the backward pass)."""
  return sum(times for ins, times in module.executed()
             if ins.opcode == 'custom-call' and _SPLASH_KERNEL.match(ins.name))


# ----------------------------------------------------------- TPU cycles


def phase_and_part(op_name: str) -> tuple[str, str]:
  """('forward' | 'backward' | 'optimizer and metrics', model part) from an op_name.

  Instructions the compiler added without an op_name (layout copies and
  casts of weights, mostly) are ('compiler-added', 'copies and casts').
  """
  if not op_name:
    return 'compiler-added', 'copies and casts'
  if 'transpose(jvp' in op_name:
    phase = 'backward'
  elif 'jvp(' in op_name:
    phase = 'forward'
  else:
    phase = 'optimizer and metrics'
  part = 'other'
  for key, label in (('attention_layer_norm', 'layer norm'), ('output_layer_norm', 'layer norm'),
                     ('attention_norm', 'layer norm'), ('mlp_norm', 'layer norm'),
                     ('/attention/', 'attention'), ('/intermediate/', 'MLP'), ('/mlp/', 'MLP'),
                     ('/output/', 'MLP'), ('embeddings', 'embeddings'), ('mlm_head', 'MLM head'),
                     ('sentence_pair', 'sentence-pair head'), ('mlm_logits', 'MLM head')):
    if key in op_name:
      part = label
      break
  if phase != 'optimizer and metrics' and part == 'other':
    part = 'loss and gathers'
  return phase, part


def cycle_breakdown(module: Module) -> dict[str, int]:
  """Estimated cycles per 'phase / part', summed over one execution."""
  out: collections.Counter = collections.Counter()
  for ins, times in module.executed():
    cycles = ins.estimated_cycles
    if cycles:
      out['/'.join(phase_and_part(ins.op_name))] += cycles * times
  return dict(out)


def largest_instructions(module: Module, n: int = 10) -> list[dict]:
  """The n instructions with the most estimated cycles per step."""
  rows = [(ins.estimated_cycles * times, ins) for ins, times in module.executed()
          if ins.estimated_cycles]
  rows.sort(key=lambda r: -r[0])
  return [{'cycles': c, 'name': ins.name, 'op_name': ins.op_name, 'shape': ins.shape[:120]}
          for c, ins in rows[:n]]


def summary(text: str, unknown_trips: int = 1) -> dict:
  """Everything above for one compiled program, as plain data (JSON-able); a loop of unknown
  count runs `unknown_trips` times (Module.trip_count)."""
  module = Module.parse(text, unknown_trips)
  coll = collectives(module)
  by_kind: dict[str, dict[str, int]] = {}
  for c in coll:
    entry = by_kind.setdefault(c.kind, {'count': 0, 'bytes': 0})
    entry['count'] += c.times
    entry['bytes'] += c.bytes * c.times
  breakdown = cycle_breakdown(module)
  return {
      'estimated_cycles': sum(breakdown.values()),
      'cycles_by_part': dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
      'largest': largest_instructions(module),
      'collectives': by_kind,
      'cudnn_attention_calls': cudnn_attention_calls(module),
      'splash_attention_calls': splash_attention_calls(module),
      'flash_attention_calls': flash_attention_calls(module),
      'matmul_flops': matmul_flops(module),
  }


def dumps(summary_: dict) -> str:
  return json.dumps(summary_, indent=2)
