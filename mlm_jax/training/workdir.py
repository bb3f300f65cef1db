"""A run's directory: what training writes there, and loading it back for inference and export.

`export_hf` is the export of a run: it reads the checkpoint here and hands its
arrays to the converter (interop/mlm_export.py), which reads no run itself.

  WORKDIR/config.json       the resolved config (model shape, masking, data dir, vocab); in
                            a run of phases, the current phase's
  WORKDIR/phases.json       a run of phases: a row per phase (steps, tokens, T, masking, ...)
  WORKDIR/handover.json     a run of phases over a mixture: where its streams stood at each
                            boundary (rows and tokens each source had given)
  WORKDIR/tokenizer.model   the run's tokenizer: a sentencepiece model, or
  WORKDIR/tokenizer/        a Hugging Face tokenizer's files
  WORKDIR/checkpoints/<n>/  Orbax checkpoints
  WORKDIR/metrics.jsonl, tb/, summary.json, profile/: see training/metrics.py, summary.py

A resumed run writes config.json again; everything else it appends to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from mlm_jax import model as model_lib
from mlm_jax.config import fields
from mlm_jax.config import saved
from mlm_jax.data import prepared
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import mlm_export
from mlm_jax.training import checkpoint as ckpt_lib

# Where a run keeps its tokenizer: a sentencepiece model, or a Hugging Face tokenizer's folder.
_SP_TOKENIZER, _HF_TOKENIZER = sp_tokenizer.FILE_NAME, 'tokenizer'


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(workdir, 'checkpoints')


def resolved_config(config: ml_collections.ConfigDict,
                    data: prepared.PreparedData) -> dict[str, Any]:
  """The config as a dict, with what it resolved to on this machine under 'resolved'."""
  resolved = config.to_dict()
  # The model's rows: the tokenizer's ids, or a checkpoint's larger table (config.init).
  vocab_size = tok_lib.model_vocab_size(config.model.vocab_size, data.tokenizer.vocab_size)
  resolved['resolved'] = {'data_dir': data.data_dir, 'vocab_size': vocab_size,
                          'padded_vocab_size': tok_lib.padded_vocab_size(vocab_size),
                          'tokenizer_vocab_size': data.tokenizer.vocab_size,
                          'num_devices': jax.device_count(), 'num_processes': jax.process_count(),
                          'backend': jax.default_backend()}
  return resolved


# A mixture's stream positions at each phase boundary (record_handover).
HANDOVER_FILE = 'handover.json'


def record_plan(workdir: str, plan: list[dict[str, Any]]) -> None:
  """Writes WORKDIR/phases.json: a row per phase of a run in phases (phases.Plan.describe)."""
  os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, 'phases.json'), plan)


def record_handover(workdir: str, phase_index: int, handover: dict[str, Any]) -> None:
  """Records, in WORKDIR/handover.json, where a mixture's streams stand as phase
  `phase_index` starts (training/mixture_run.py's MixtureRun.handover), written by the phase
  before it at their boundary."""
  path = os.path.join(workdir, HANDOVER_FILE)
  records = read_handovers(workdir)
  records[str(phase_index)] = {k: (v.tolist() if hasattr(v, 'tolist') else v)
                               for k, v in handover.items()}
  _write_json(path, records)


def start_handovers_from(source_workdir: str, workdir: str, up_to_phase: int) -> None:
  """Starts WORKDIR/handover.json with `source_workdir`'s hand-overs into phases up to
  `up_to_phase`: a branch of that run (config.init.branch) draws a mixture's streams on from
  where that run's stood. Nothing when WORKDIR already has hand-overs, or the source none."""
  if os.path.exists(os.path.join(workdir, HANDOVER_FILE)):
    return
  kept = {k: v for k, v in read_handovers(source_workdir).items() if int(k) <= up_to_phase}
  if kept:
    os.makedirs(workdir, exist_ok=True)
    _write_json(os.path.join(workdir, HANDOVER_FILE), kept)


def read_handovers(workdir: str) -> dict[str, dict[str, Any]]:
  """{phase index: the hand-over recorded at its start} (record_handover); {} if none."""
  path = os.path.join(workdir, HANDOVER_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, value: Any) -> None:
  """Writes `value` to `path` whole or not at all (a new file renamed over the old)."""
  tmp = f'{path}.tmp'
  with open(tmp, 'w') as f:
    json.dump(value, f, indent=2, default=str)
  os.replace(tmp, path)


def _recorded_tokenizer(workdir: str) -> str | None:
  """The tokenizer `record` left in `workdir` (tokenizer.model or tokenizer/), or None."""
  for name in (_SP_TOKENIZER, _HF_TOKENIZER):
    if os.path.exists(os.path.join(workdir, name)):
      return os.path.join(workdir, name)
  return None


def check_tokenizer(workdir: str, tokenizer: tok_lib.Tokenizer) -> None:
  """Refuses to resume checkpoints with a tokenizer other than the one they were trained with.

  The same vocabulary size is not enough: ids would silently mean other
  pieces (a data dir prepared again with other tokenizer settings). The
  tokenizers' contents (digest()) are compared.
  """
  recorded, checkpoints = _recorded_tokenizer(workdir), checkpoint_dir(workdir)
  if not (recorded and os.path.isdir(checkpoints) and os.listdir(checkpoints)):
    return
  try:
    same = tok_lib.load(recorded).digest() == tokenizer.digest()
  except (ValueError, OSError, RuntimeError):  # Unreadable: not the one the checkpoints know.
    same = False
  if not same:
    raise ckpt_lib.CheckpointMismatchError(
        f'{workdir} holds checkpoints trained with the tokenizer in {recorded}, but the data '
        f'dir\'s tokenizer ({tokenizer.describe()}) differs: resume with the data dir that run '
        f'used (its config.json names it), set --config.tokenizer.model_file={recorded} and '
        f'prepare again, or start a new --workdir.')


def record(workdir: str, resolved: dict[str, Any], tokenizer: tok_lib.Tokenizer) -> None:
  """Writes config.json (atomically) and the tokenizer the run uses into `workdir`.

  A sentencepiece tokenizer becomes WORKDIR/tokenizer.model, a Hugging Face one
  WORKDIR/tokenizer/; the other form, if an earlier run left it, is removed,
  so that tokenizer.load(workdir) finds this one.
  """
  os.makedirs(workdir, exist_ok=True)
  sp_path, hf_path = os.path.join(workdir, _SP_TOKENIZER), os.path.join(workdir, _HF_TOKENIZER)
  if isinstance(tokenizer, sp_tokenizer.SentencePieceTokenizer):
    tokenizer.save(workdir)
    shutil.rmtree(hf_path, ignore_errors=True)
  else:
    # Written whole under another name: a folder mixing two tokenizers' files
    # (a stale special_tokens_map.json) would load as neither.
    tmp = f'{hf_path}.tmp-{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save(tmp)
    shutil.rmtree(hf_path, ignore_errors=True)
    os.rename(tmp, hf_path)
    if os.path.exists(sp_path):
      os.remove(sp_path)
  _write_json(os.path.join(workdir, 'config.json'), resolved)


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  workdir: str
  step: int
  config: ml_collections.ConfigDict   # WORKDIR/config.json
  model_cfg: model_lib.ModelConfig     # float32 compute, for exact inference
  params: dict[str, Any]               # host numpy arrays
  tokenizer: tok_lib.Tokenizer


def load(workdir: str, step: int | None = None, ema: bool = False) -> TrainedRun:
  """Config, tokenizer and the parameters of checkpoint `step` (None: the latest); with `ema`,
  the average of the parameters the run kept (config.train.ema_decay > 0) instead."""
  workdir = os.path.abspath(workdir)
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(f'{workdir} is not a training workdir (no config.json).')
  with open(config_path) as f:
    config = saved.read(json.load(f), config_path)
  resolved = config.resolved
  model_cfg = model_lib.ModelConfig.from_config(
      config.model, resolved.vocab_size, resolved.padded_vocab_size, jnp.float32,
      platform=model_lib.local_platform(), sentence_pair_head=config.sentence_pair.task != 'none')
  step, params, meta = ckpt_lib.restore_params(checkpoint_dir(workdir), step,
                                               'ema_params' if ema else 'params')
  ckpt_lib.check_meta(meta, fields.shape_record(model_cfg), f'{step} of {workdir}')
  recorded = _recorded_tokenizer(workdir)
  if recorded is None:
    raise FileNotFoundError(f'{workdir} holds no tokenizer (tokenizer.model or tokenizer/).')
  tokenizer = tok_lib.load(recorded)
  return TrainedRun(workdir, step, config, model_cfg, params, tokenizer)


def export_hf(workdir: str, out_dir: str, step: int | None = None,
              apply_embedding_correction: bool = False, ema: bool = False) -> TrainedRun:
  """Writes checkpoint `step` (None: the latest) of the run in `workdir` as a Hugging Face
  masked LM in `out_dir` (interop/mlm_export.py); returns the run it was made from.
  `ema`: the run's average of the parameters (config.train.ema_decay) instead of them.

  apply_embedding_correction: each token embedding replaced by its expectation
  under the run's masking (mlm_export.embedding_correction), with the unigram
  counts of the data dir the run trained on where its masking drew by them.
  """
  mlm_export.require_extras()  # Fail before any work, naming the extra to install.
  run = load(workdir, step, ema)
  params = run.params
  if apply_embedding_correction:
    params = mlm_export.corrected_params(params, run.model_cfg, run.tokenizer,
                                         run.config['masking'],
                                         run.config['resolved']['data_dir'])
  mlm_export.write(out_dir, params, run.model_cfg, run.tokenizer)
  return run
