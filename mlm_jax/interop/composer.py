"""Composer training checkpoints of FlexBERT (ModernBERT, Ettin, mmBERT) read into our params,
and StableAdamW's moments, step and learning rate into our optimizer's terms.

A Composer checkpoint (`torch.save` of {'state': ..., 'rng': ...}) holds in `state`:

  model        FlexBertForMaskedLM's state dict under Composer's 'model.' prefix
  optimizers   {class name: the optimizer's state dict}: with torch >= 2.3 and a process
               group (every multi-GPU run) torch.distributed's get_optimizer_state_dict, its
               `state` and param_groups' `params` keyed by parameter names; else
               Optimizer.state_dict(), keyed by each parameter's index in the groups
  timestamp    {'Timestamp': {'batch': steps taken, 'token': ..., 'total_wct': timedelta}}
  integrations {'huggingface': {'model': {'config': {'content': FlexBertConfig's dict}}}}
  schedulers, callbacks, train_metrics, rank_zero_seed, run_name, metadata, and 'rng'.

It is read with torch.load(weights_only=True): only tensors, containers and the few types
Composer itself allows (SAFE_GLOBALS: timedelta, numpy arrays and dtypes, torch's version
string) are unpickled, so no code from the file runs; a file that needs any other type is
refused in one line.

FlexBERT's names are ModernBertForMaskedLM's under other prefixes (FLEX_PREFIXES:
`model.bert.encoder.layers.N.` is `model.layers.N.`, `model.head.` is `head.`, ...), so the
tensors go through interop/modernbert.py's layout to our params. The moments are
StableAdamW's as ModernBERT's (optimi's) keeps them: `exp_avg` and `exp_avg_sq` are Adam's
moments already bias-corrected (optimi folds the correction into its betas), and its param
groups hold the step count; optax's scale_by_adam keeps them uncorrected with its count, so
mu = exp_avg * (1 - beta1^t) and nu = exp_avg_sq * (1 - beta2^t). A checkpoint of bfloat16
weights with Kahan summation holds each weight's lost low bits in `kahan_comp`: they are
added back.

The file may be local, at a bucket URL (gs://, s3://: copied once into mlm_jax's cache,
paths.cache_root(), as a data dir is) or a hub file (org/name[@revision]/path, through the
Hugging Face cache: interop/hub.py); `local_file` finds it, and `read` reads it once per
process (a training checkpoint is GBs: the command's config check and the loop share it).

What must stay true: logits of the read params through our model equal the source model's
(ModernBertForMaskedLM with the same weights) to 1e-5, and one optimizer step of ours from the
read state equals one step of the source optimizer (tests/test_composer.py); every error in
the file (not a checkpoint, truncated, a disallowed type, another architecture) is one line
naming the file.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import os
import pickle
import re
import shutil
from typing import Any

import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import paths
from mlm_jax.interop import hf
from mlm_jax.interop import hub

Params = dict[str, Any]
# FlexBERT (Composer's 'model.' prefix included) -> ModernBertForMaskedLM, by name prefix.
FLEX_PREFIXES = (('model.bert.encoder.layers.', 'model.layers.'),
                 ('model.bert.embeddings.', 'model.embeddings.'),
                 ('model.bert.final_norm.', 'model.final_norm.'),
                 ('model.head.', 'head.'),
                 ('model.decoder.', 'decoder.'))
# FlexBertConfig settings our 'modern' encoder computes (the values ModernBERT, Ettin and
# mmBERT train with; FlexBertConfig's defaults where a config leaves them out).
_EXPECTED = {
    'bert_layer': ('prenorm', 'prenorm'), 'mlp_layer': ('glu', 'mlp'),
    'attention_layer': ('rope', 'base'), 'embedding_layer': ('sans_pos', 'absolute_pos'),
    'normalization': ('layernorm', 'rmsnorm'), 'embed_norm': (True, True),
    'final_norm': (True, False), 'skip_first_prenorm': (True, False),
    'head_pred_norm': (True, True), 'head_pred_act': ('gelu', 'silu'),
    'hidden_act': ('gelu', 'gelu'), 'attn_qkv_bias': (False, False),
    'attn_out_bias': (False, False), 'mlp_in_bias': (False, False),
    'mlp_out_bias': (False, False), 'head_pred_bias': (False, False),
    'decoder_bias': (True, True), 'tie_word_embeddings': (True, True),
    'rotary_emb_dim': (None, None), 'rotary_emb_interleaved': (False, False),
    'local_attn_rotary_emb_dim': (None, None),
}


def safe_globals() -> list[Any]:
  """The types besides tensors and containers a Composer checkpoint may hold, as Composer's own
  loader allows them (composer/utils/checkpoint.py, _COMPOSER_CHECKPOINT_SAFE_GLOBALS)."""
  from torch.torch_version import TorchVersion  # pylint: disable=import-outside-toplevel
  allowed: list[Any] = [datetime.timedelta, np.ndarray, np.dtype, TorchVersion]
  allowed += [t for t in vars(np.dtypes).values()
              if isinstance(t, type) and issubclass(t, np.dtype)]
  for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
    try:
      allowed.append(__import__(module, fromlist=['_reconstruct'])._reconstruct)
    except (ImportError, AttributeError):
      pass
  return allowed


@dataclasses.dataclass
class Checkpoint:
  """What a Composer checkpoint of FlexBERT holds, in ModernBertForMaskedLM's names.

  tensors: {HF name: float32 array} of the weights. moments: {HF name: (exp_avg, exp_avg_sq)}
  as optimi keeps them (bias-corrected), or None where the file has no optimizer state.
  step: the optimizer steps taken (Timestamp's batch). optimizer_step: the count optimi
  corrects its moments with. learning_rate: the last step's; hyper: the optimizer's
  beta1, beta2, eps, weight_decay (the decayed group's), max_lr. model_fields: the
  ModelConfig fields the file's FlexBertConfig decides (with `fields` given to load).
  """
  path: str
  tensors: dict[str, np.ndarray]
  moments: dict[str, tuple[np.ndarray, np.ndarray]] | None
  step: int
  optimizer_step: int | None
  learning_rate: float | None
  hyper: dict[str, float]
  model_fields: dict[str, Any]

  def params(self, cfg: model_lib.ModelConfig) -> Params:
    """Our params (numpy, float32) for `cfg` (the shape of model_fields)."""
    return hf.from_hf_state_dict(self.tensors, cfg, source=self.path)

  def adam_moments(self, cfg: model_lib.ModelConfig) -> tuple[Params, Params] | None:
    """(mu, nu) in our params' tree as optax.scale_by_adam keeps them after optimizer_step
    steps (uncorrected); vocabulary padding rows 0. None: no optimizer state in the file."""
    if self.moments is None:
      return None
    t = self.optimizer_step
    b1, b2 = self.hyper['beta1'], self.hyper['beta2']
    mu = {n: m * np.float32(1 - b1 ** t) for n, (m, _) in self.moments.items()}
    nu = {n: v * np.float32(1 - b2 ** t) for n, (_, v) in self.moments.items()}
    return (hf.from_hf_state_dict(mu, cfg, source=f'{self.path} (exp_avg)'),
            hf.from_hf_state_dict(nu, cfg, source=f'{self.path} (exp_avg_sq)'))


def _error(path: str, what: str) -> ValueError:
  return ValueError(f'{path}: {what}')


def _torch_load(path: str) -> Any:
  """The file unpickled with weights_only=True and Composer's safe globals: no code runs."""
  torch = hf.require('torch')
  try:
    with torch.serialization.safe_globals(safe_globals()):
      return torch.load(path, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError as e:
    found = re.search(r'Unsupported global: GLOBAL ([\w.]+)', str(e))
    if found or 'Weights only load failed' in str(e):
      name = found.group(1) if found else 'an object of a type not allowed'
      raise _error(path, f'holds {name}, which loading would construct by running code named '
                         'in the file; a Composer checkpoint of FlexBERT needs only tensors, '
                         'containers, timedelta and numpy arrays, so it is not read. Save the '
                         "state without it, or read it with Composer's own loader if you trust "
                         'the file.') from None
    raise _error(path, f'is truncated or corrupt ({e}): copy it again.') from None
  except FileNotFoundError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # torch raises RuntimeError, EOFError...
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise _error(path, f'is truncated or corrupt ({reason}): copy it again.') from None


def _hf_name(name: str) -> str | None:
  for flex, ours in FLEX_PREFIXES:
    if name.startswith(flex):
      return ours + name[len(flex):]
  return None


def _array(x: Any) -> np.ndarray:
  torch = hf.require('torch')
  return x.detach().to(torch.float32).numpy().copy()


def model_fields(flex: dict[str, Any], path: str) -> dict[str, Any]:
  """A FlexBertConfig dict -> our ModelConfig fields (variant 'modern'); ValueError (one line)
  for a setting our encoder does not compute."""
  for key, (allowed, default) in _EXPECTED.items():
    value = flex.get(key, default)
    if value != allowed:
      raise _error(path, f'its FlexBertConfig has {key}={value!r}; only {allowed!r} (ModernBERT, '
                         "Ettin and mmBERT's architecture) is read into variant 'modern'.")
  bias = (flex.get('norm_kwargs') or {}).get('bias', True)
  if bias:
    raise _error(path, 'its FlexBertConfig has norm_kwargs.bias=True; ModernBERT has no norm '
                       'biases, nor has our encoder.')
  window = flex.get('sliding_window', -1)
  every_n = flex.get('global_attn_every_n_layers', -1)
  theta = float(flex.get('rotary_emb_base', 10_000.0))
  local_theta = float(flex.get('local_attn_rotary_emb_base', -1))
  return {
      'variant': 'modern',
      'vocab_size': flex['vocab_size'],
      'num_layers': flex['num_hidden_layers'],
      'hidden_size': flex['hidden_size'],
      'num_heads': flex['num_attention_heads'],
      'intermediate_size': flex['intermediate_size'],
      'max_position_embeddings': flex.get('max_position_embeddings', 8192),
      'layer_norm_eps': float((flex.get('norm_kwargs') or {}).get('eps', 1e-5)),
      'initializer_range': float(flex.get('init_std', 0.02)),
      # No window (-1): every layer global.
      'global_attn_every_n_layers': 1 if window <= 0 or every_n <= 0 else every_n,
      'local_attention': window if window > 0 else flex.get('max_position_embeddings', 8192),
      'global_rope_theta': theta,
      'local_rope_theta': theta if local_theta <= 0 else local_theta,
  }


def _optimizer(state: dict[str, Any], names: list[str], path: str) -> tuple[
    dict[str, dict[str, Any]] | None, int | None, float | None, dict[str, float]]:
  """(each parameter's optimizer state by its Composer name, optimi's step count, the last
  learning rate, the hyperparameters) of a checkpoint's state; Nones without an optimizer."""
  optimizers = state.get('optimizers') or {}
  if not optimizers:
    return None, None, None, {}
  if len(optimizers) != 1:
    raise _error(path, f'holds {len(optimizers)} optimizers ({sorted(optimizers)}); one is '
                       'read.')
  (kind, osd), = optimizers.items()
  groups, per_param = osd.get('param_groups') or [], osd.get('state') or {}
  if not groups or not all('beta1' in g and 'step' in g for g in groups):
    raise _error(path, f'its optimizer {kind} is not StableAdamW as ModernBERT trains with it '
                       "(optimi's param groups with beta1, beta2 and step); its moments are "
                       'not read.')
  keys = [p for g in groups for p in g['params']]
  order = keys if keys and isinstance(keys[0], str) else _param_names(
      names, groups, per_param, state['model'], path)
  steps = {int(g['step']) for g in groups}
  if len(steps) != 1:
    raise _error(path, f'its param groups have taken different numbers of steps {steps}.')
  entries = {}
  for key, name in zip(keys, order):
    entry = per_param.get(key)
    if entry is None or 'exp_avg' not in entry or 'exp_avg_sq' not in entry:
      raise _error(path, f'its optimizer holds no moments for {name}.')
    entries[name] = entry
  first = groups[0]
  decayed = [g['weight_decay'] for g in groups if g['weight_decay']]
  hyper = {'beta1': float(first['beta1']), 'beta2': float(first['beta2']),
           'eps': float(first['eps']), 'weight_decay': float(decayed[0] if decayed else 0.0),
           'max_lr': float(first.get('max_lr') or first['lr'])}
  return entries, steps.pop(), float(first['lr']), hyper


def _param_names(names: list[str], groups: list[dict], per_param: dict, model: dict,
                 path: str) -> list[str]:
  """The names of an index-keyed optimizer's parameters (Optimizer.state_dict(), a run
  without a process group), in its groups' order.

  Its parameters are the model's in state-dict order, each once (a tied weight under its
  first name), as one group, or as ModernBERT's two (main.py's param_groups_weight_decay:
  the vectors and biases, undecayed, then the rest); each moment's shape is checked.
  """
  seen, params = set(), []
  for name in names:
    x = model[name]
    key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape))
    if key not in seen:
      seen.add(key)
      params.append(name)
  undecayed = [n for n in params if model[n].ndim <= 1 or n.endswith('.bias')]
  order = params if len(groups) == 1 else undecayed + [n for n in params if n not in undecayed]
  keys = [p for g in groups for p in g['params']]
  sizes = [len(g['params']) for g in groups]
  if len(order) != len(keys) or len(groups) > 2 or (len(groups) == 2
                                                    and sizes[0] != len(undecayed)):
    raise _error(path, f'its optimizer has {len(keys)} parameters in groups of {sizes}, which '
                       'do not match the model in the order ModernBERT builds them; its moments '
                       'are not read.')
  for key, name in zip(keys, order):
    entry = per_param.get(key) or {}
    if 'exp_avg' in entry and tuple(entry['exp_avg'].shape) != tuple(model[name].shape):
      raise _error(path, f"its optimizer's parameter {key} has shape "
                         f"{tuple(entry['exp_avg'].shape)}, not {name}'s "
                         f'{tuple(model[name].shape)}; its moments are not read.')
  return order


def load(path: str, fields: dict[str, Any] | None = None) -> Checkpoint:
  """A Composer checkpoint of FlexBERT read without running code from it (module docstring).

  `fields`: ModelConfig fields to use where the file has no FlexBertConfig (a state saved
  without Composer's Hugging Face integration), or to override it. ValueError, one line
  naming the file, for anything it cannot read.
  """
  checkpoint = _torch_load(path)
  state = checkpoint.get('state') if isinstance(checkpoint, dict) else None
  if not isinstance(state, dict) or not isinstance(state.get('model'), dict):
    raise _error(path, "is not a Composer checkpoint (no 'state' with a 'model' state dict).")
  model = state['model']
  names = [n for n in model if _hf_name(n) is not None]
  if not any(n.startswith('model.bert.encoder.layers.') for n in names):
    raise _error(path, 'holds no FlexBERT encoder (model.bert.encoder.layers.N...): not a '
                       'ModernBERT, Ettin or mmBERT checkpoint.')
  tensors = {_hf_name(n): _array(model[n]) for n in names}
  entries, optimizer_step, lr, hyper = _optimizer(state, names, path)
  moments = None
  if entries is not None:
    moments = {}
    for name, entry in entries.items():
      ours = _hf_name(name)
      if ours is None:
        continue
      m, v = _array(entry['exp_avg']), _array(entry['exp_avg_sq'])
      if m.shape != tensors[ours].shape or v.shape != tensors[ours].shape:
        raise _error(path, f'the moments of {name} have shape {m.shape}, the weight '
                           f'{tensors[ours].shape}.')
      moments[ours] = (m, v)
      if entry.get('kahan_comp') is not None:  # bfloat16 weights' lost low bits.
        tensors[ours] = tensors[ours] + _array(entry['kahan_comp'])
  content = (((state.get('integrations') or {}).get('huggingface') or {}).get('model') or {})
  flex = (content.get('config') or {}).get('content')
  found = model_fields(flex, path) if isinstance(flex, dict) else {}
  found.update(fields or {})
  missing = [k for k in ('vocab_size', 'num_layers', 'hidden_size', 'num_heads',
                         'intermediate_size') if k not in found]
  if missing:
    raise _error(path, "has no FlexBertConfig (Composer's Hugging Face integration), so give "
                       f'the model fields {missing} (and its window and rotary bases).')
  timestamp = (state.get('timestamp') or {}).get('Timestamp') or {}
  step = int(timestamp.get('batch', optimizer_step or 0))
  return Checkpoint(path, tensors, moments, step, optimizer_step, lr, hyper, found)


# ---------------------------------------------------------------- where the file is


def local_file(name: str, flag: str) -> hub.ResolvedFile:
  """`name` as a file on this machine: a local path as it is, a bucket URL copied once into
  the cache (CACHE/remote/), a hub file through the Hugging Face cache (pinned to its commit).
  `flag` names the setting in errors: ValueError, one line."""
  if paths.is_url(name):
    return hub.ResolvedFile(_copy_down(name, flag), None)
  if hub.is_hub_file(name):
    return hub.resolve_file(name, flag)
  path = os.path.expanduser(name)
  if not os.path.isfile(path):
    raise ValueError(f'{flag}={name!r}: no such file, nor a bucket URL (gs://...) or a hub file '
                     '(org/name[@revision]/path/in/repo).')
  return hub.ResolvedFile(path, None)


def _copy_down(url: str, flag: str) -> str:
  """The local copy of the file at `url`, made unless one of its size is there; written under
  another name and renamed, so that an interrupted copy is never taken as complete."""
  digest = hashlib.sha256(url.encode()).hexdigest()[:16]
  local = os.path.join(paths.cache_root(), 'remote', f'{digest}-{os.path.basename(url)}')
  try:
    size = paths.size(url)
  except Exception as e:  # pylint: disable=broad-except  # fsspec back ends raise their own.
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f'{flag}={url!r} cannot be read ({reason}): check the URL, and that the '
                     'back end of its scheme is installed (gcsfs for gs://, s3fs for s3://).'
                     ) from None
  if os.path.isfile(local) and os.path.getsize(local) == size:
    return local
  os.makedirs(os.path.dirname(local), exist_ok=True)
  partial = f'{local}.copy-{os.getpid()}'
  with paths.open_binary(url) as reader, open(partial, 'wb') as writer:
    shutil.copyfileobj(reader, writer, 1 << 24)
  os.replace(partial, local)
  return local


# Checkpoints read in this process, by (local path, size, modification time): the newest only.
_LOADED: collections.OrderedDict[tuple, Checkpoint] = collections.OrderedDict()
_MAX_LOADED = 1


def read(name: str, flag: str) -> Checkpoint:
  """The checkpoint `name` names (local_file), read by `load`; a file read before in this
  process and unchanged since gives the same Checkpoint again. ValueError, one line naming
  `flag`, for a file that cannot be found or read."""
  path = local_file(name, flag).local_path
  try:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
      _LOADED[key] = load(path)
      while len(_LOADED) > _MAX_LOADED:
        _LOADED.popitem(last=False)
    return _LOADED[key]
  except (ValueError, FileNotFoundError) as e:
    raise ValueError(f'{flag}={name!r}: {e}') from None


def forget() -> None:
  """Lets the checkpoints `read` keeps go (their tensors are the size of the model, thrice)."""
  _LOADED.clear()
