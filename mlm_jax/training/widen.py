"""A ModernBERT run widened and deepened into a larger model, as ModernBERT-large was started from
ModernBERT-base (`python -m mlm_jax.widen`).

AnswerDotAI/ModernBERT's `init_from_checkpoint` (mode `tile_weights_from_middle`,
`src/bert_layers/model.py` init_mlm_model_from_pretrained and
`src/bert_layers/initialization.py`): layer i of the new L' layers starts
from layer round(i·L/L') of the L old ones, and every weight is tiled from
the middle: the old tensor sits at the centre of each larger axis and is
repeated outwards on both sides, so along an axis of old size n and new size
m, new index k reads old index (k - (m - n) // 2) mod n. Fused tensors are
tiled part by part: the query, key and value blocks of Wqkv, the input and
gate halves of the GLU's Wi. The embeddings (along their width; the
vocabulary stays), every LayerNorm, the MLM head's transform and norm and
its output bias are tiled alike. The final norm is not (the source leaves it
as initialised: ones), nor is a layer's attention norm whose old layer has
none (layer 0's): ones too.

The new workdir has a run's layout (config.json: the source's with the new
sizes and a `widened` record; the tokenizer; one checkpoint of weights), so
`--config.init.workdir=WIDENED` starts a run from it (its optimizer fresh).

What must stay true: every tensor equals the source's algorithm applied to
the Hugging Face layout of the old model (tests/test_widen.py compares the
exports through a loop-by-loop copy of it); only variant 'modern' widens;
nothing is written when the sizes shrink or do not fit (one line).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from mlm_jax.config import fields
from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint as ckpt_lib
from mlm_jax.training import workdir as workdir_lib

# The config.model fields a widening changes; every other field is the source run's.
SIZES = ('num_layers', 'hidden_size', 'intermediate_size', 'num_heads')


@dataclasses.dataclass(frozen=True)
class Widened:
  out_dir: str
  step: int                  # The source checkpoint's step, kept as the new checkpoint's.
  layers: list[int]          # New layer i starts from old layer layers[i].
  sizes: dict[str, int]


def middle_index(new: int, old: int) -> np.ndarray:
  """[new] the old index each new index reads when a length-`old` axis is tiled from the
  middle to length `new`."""
  if new < old:
    raise ValueError(f'an axis of {old} cannot be tiled down to {new}')
  return (np.arange(new) - (new - old) // 2) % old


def tile(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """`x` tiled from the middle to `shape`, each axis on its own (ModernBERT's tile_weight)."""
  return x[np.ix_(*(middle_index(n, o) for n, o in zip(shape, x.shape)))]


def layer_map(old: int, new: int) -> list[int]:
  """[new] the old layer each new layer starts from: round(i·old/new), Python's rounding."""
  return [round(i * old / new) for i in range(new)]


def widen_params(params: dict[str, Any], old: Any, new: Any) -> dict[str, Any]:
  """The params of model config `new` tiled from `params` of model config `old` (both
  variant 'modern', the same vocabulary; ModelConfig or config.model)."""
  d, dd, f, ff = old.hidden_size, new.hidden_size, old.intermediate_size, new.intermediate_size
  heads, head_dim = new.num_heads, new.hidden_size // new.num_heads
  encoder = params['encoder']
  out_encoder: dict[str, Any] = {}
  emb = encoder['embeddings']
  out_encoder['embeddings'] = {
      'token': {'embedding': tile(emb['token']['embedding'],
                                  (emb['token']['embedding'].shape[0], dd))},
      'layer_norm': _norm(emb['layer_norm'], dd)}
  for i, j in enumerate(layer_map(old.num_layers, new.num_layers)):
    src, out = encoder[f'layer_{j}'], {}
    qkv = np.asarray(src['attention']['qkv']['kernel']).reshape(d, 3, d)
    out['attention'] = {
        'qkv': {'kernel': np.stack([tile(qkv[:, part], (dd, dd)) for part in range(3)],
                                   axis=1).reshape(dd, 3, heads, head_dim)},
        'out': {'kernel': tile(np.asarray(src['attention']['out']['kernel']).reshape(d, d),
                               (dd, dd)).reshape(heads, head_dim, dd)}}
    if i > 0:  # Layer 0 has no attention norm; a later one whose old layer had none starts at 1.
      out['attention_norm'] = (_norm(src['attention_norm'], dd) if 'attention_norm' in src
                               else {'scale': np.ones(dd, np.float32)})
    wi = np.asarray(src['mlp']['wi']['kernel'])
    out['mlp'] = {'wi': {'kernel': np.concatenate([tile(wi[:, :f], (dd, ff)),
                                                   tile(wi[:, f:], (dd, ff))], axis=1)},
                  'wo': {'kernel': tile(src['mlp']['wo']['kernel'], (ff, dd))}}
    out['mlp_norm'] = _norm(src['mlp_norm'], dd)
    out_encoder[f'layer_{i}'] = out
  # The source leaves the final norm as initialised.
  out_encoder['final_norm'] = {'scale': np.ones(dd, np.asarray(
      encoder['final_norm']['scale']).dtype)}
  head = params['mlm_head']
  return {'encoder': out_encoder, 'mlm_head': {
      'transform': {'kernel': tile(head['transform']['kernel'], (dd, dd))},
      'layer_norm': _norm(head['layer_norm'], dd),
      'output_bias': np.asarray(head['output_bias'])}}


def _norm(norm: dict[str, Any], size: int) -> dict[str, Any]:
  return {k: tile(np.asarray(v), (size,)) for k, v in norm.items()}


def widen_run(workdir: str, out_dir: str, sizes: dict[str, int],
              step: int | None = None) -> Widened:
  """Writes checkpoint `step` (None: the latest) of the run in `workdir`, widened to `sizes`
  (config.model fields of SIZES; the others the run's), as a new workdir `out_dir`."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(os.path.join(out_dir, 'config.json')) or os.path.exists(
      workdir_lib.checkpoint_dir(out_dir)):
    raise ConfigError(f'--out={out_dir} already holds a run: name a new directory.')
  try:
    run = workdir_lib.load(workdir, step)
  except FileNotFoundError as e:
    raise ConfigError(f'--workdir={workdir}: {e}') from None
  old = run.model_cfg
  if old.variant != 'modern' or old.scan_layers:
    raise ConfigError(f'--workdir={workdir} is a {old.variant!r} model'
                      f'{" with stacked layers" if old.scan_layers else ""}: widening tiles '
                      "ModernBERT's layers one by one (variant 'modern', scan_layers=False).")
  new = dataclasses.replace(old, **sizes)
  small = {k: getattr(old, k) for k in SIZES if getattr(new, k) < getattr(old, k)}
  if small:
    raise ConfigError(f'widening only grows the model: {", ".join(f"--{k}={getattr(new, k)}" for k in small)} '
                      f'is below the run\'s {", ".join(str(v) for v in small.values())}.')
  if new.hidden_size % new.num_heads:
    raise ConfigError(f'--hidden_size={new.hidden_size} is not divisible by '
                      f'--num_heads={new.num_heads}.')
  params = widen_params(run.params, old, new)
  resolved = run.config.to_dict()
  resolved['model'].update(sizes)
  layers = layer_map(old.num_layers, new.num_layers)
  resolved['widened'] = {'workdir': run.workdir, 'step': run.step,
                         'from': {k: getattr(old, k) for k in SIZES}, 'layers': layers,
                         'mode': 'tile_weights_from_middle'}
  workdir_lib.record(out_dir, resolved, run.tokenizer)
  ckpt_lib.save_weights(workdir_lib.checkpoint_dir(out_dir), run.step, params,
                        fields.shape_record(new))
  return Widened(out_dir, run.step, layers, {k: getattr(new, k) for k in SIZES})
