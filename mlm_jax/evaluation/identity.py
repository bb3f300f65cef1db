"""What a results file was computed with: the model's identity and mlm_jax's version.

  a run (--workdir)      its directory, the checkpoint step evaluated, and the
                         sha256 of its config.json
  a checkpoint (--hf_dir) its directory (a hub id as org/name@commit) and the
                         sha256 of each file a fine-tuning reads there (config,
                         weights, tokenizer files)
  mlm_jax                the package's version, and the git commit of the
                         checkout it runs from when there is one (with
                         '-dirty' for uncommitted changes)

What must stay true: two sweeps whose identities are equal evaluated the
same weights; a sweep directory refuses to continue with another model
(sweep.py compares these records).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import subprocess
from typing import Any

from mlm_jax.finetuning import pretrained as pretrained_lib

# The files of a Hugging Face directory that decide a fine-tuning's start.
_HF_FILES = ('config.json', 'model.safetensors', 'pytorch_model.bin', 'tokenizer.json',
             'tokenizer_config.json', 'vocab.txt', 'vocab.json', 'merges.txt',
             'special_tokens_map.json', 'sentencepiece.bpe.model', 'spiece.model')


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def model_identity(pretrained: pretrained_lib.Pretrained) -> dict[str, Any]:
  """The record of the encoder evaluated (see the module docstring)."""
  source = dict(pretrained.source)
  if 'workdir' in source:
    config = os.path.join(source['workdir'], 'config.json')
    if os.path.exists(config):
      source['config_sha256'] = file_sha256(config)
    return source
  directory = local_dir(pretrained)
  if directory:
    source['files'] = {name: file_sha256(os.path.join(directory, name))
                       for name in _HF_FILES if os.path.isfile(os.path.join(directory, name))}
  return source


def local_dir(pretrained: pretrained_lib.Pretrained) -> str | None:
  """The directory a --hf_dir encoder was read from (the description names it)."""
  hf_dir = pretrained.source.get('hf_dir', '')
  if os.path.isdir(hf_dir):
    return hf_dir
  # A hub id: 'org/name@commit (LOCAL_DIR)'.
  description = pretrained.description
  if description.endswith(')') and ' (' in description:
    local = description[description.rindex(' (') + 2:-1]
    return local if os.path.isdir(local) else None
  return None


@functools.cache
def mlm_jax_version() -> dict[str, str]:
  """{'version': the package's, 'git': the checkout's commit (if any)}."""
  out = {'version': importlib.metadata.version('mlm_jax')}
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if os.path.isdir(os.path.join(root, '.git')):
    try:
      commit = subprocess.run(['git', '-C', root, 'rev-parse', 'HEAD'], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
      dirty = subprocess.run(['git', '-C', root, 'status', '--porcelain', '--untracked-files=no'],
                             capture_output=True, text=True, timeout=10).stdout.strip()
      out['git'] = commit + ('-dirty' if dirty else '')
    except (OSError, subprocess.SubprocessError):
      pass
  return out
