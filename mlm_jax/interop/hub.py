"""Hugging Face hub ids (`org/name`, `org/name@revision`) as model directories, and hub files
(`org/name[@revision]/path/in/repo`) as local files.

config.init.hf_dir and finetune --hf_dir take a local directory or a hub id.
A hub id resolves through huggingface_hub's `snapshot_download` to the
snapshot directory of its cache ($HF_HOME/hub/models--org--name/snapshots/
<commit>/), fetching only the files an import reads (config, weights,
tokenizer files), or only the tokenizer files where that is all a run
takes from it. A hub file (config.init.composer) resolves through
`hf_hub_download` to its place in the same snapshot. With HF_HUB_OFFLINE=1 a
cached copy is used as it is; one that is not cached is one line naming the
download command.

What must stay true: an existing local path is never taken for a hub id (a
directory named `org/name` under the working directory wins), and the
revision a run records is the commit the id resolved to, so the same files
are read again when the run's config is read back (`pinned`).
"""

from __future__ import annotations

import dataclasses
import os
import re

# org/name with an optional @revision (a branch, tag or commit); hub names use letters,
# digits, '-', '_' and '.'.
_HUB_ID = re.compile(r'^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$')
# What an import reads: config, weights (safetensors or PyTorch, whole or sharded), and the
# tokenizer files of every kind data/tokenizer.py loads.
ALLOW_PATTERNS = ('config.json', '*.safetensors', 'model.safetensors.index.json',
                  'pytorch_model*.bin', 'pytorch_model.bin.index.json', 'tokenizer.json',
                  'tokenizer_config.json', 'special_tokens_map.json', 'vocab.txt', 'vocab.json',
                  'merges.txt', '*.model', 'added_tokens.json')
# The tokenizer files alone (a Composer checkpoint's run reads only these of its model's id).
TOKENIZER_PATTERNS = tuple(p for p in ALLOW_PATTERNS if 'safetensors' not in p
                           and not p.startswith('pytorch_model'))
# org/name[@revision]/path: one file of a repository (a revision without '/' here).
_HUB_FILE = re.compile(r'^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w.-]+))?'
                       r'/(?P<file>[^/].*)$')


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A model directory on this machine, and where it came from."""

  local_dir: str        # The directory to read.
  repo_id: str | None   # 'org/name' for a hub id; None for a local directory.
  revision: str | None  # The commit the hub id resolved to; None for a local directory.

  @property
  def pinned(self) -> str | None:
    """'org/name@commit': the id that gives exactly these files again (None: local)."""
    return f'{self.repo_id}@{self.revision}' if self.repo_id else None


def is_hub_id(name: str) -> bool:
  """True for `org/name[@revision]` that is not an existing local path."""
  if not name or os.path.exists(os.path.expanduser(name)):
    return False
  return name[0] not in './~' and _HUB_ID.match(name) is not None


def resolve(name: str, flag: str, patterns: tuple[str, ...] = ALLOW_PATTERNS) -> Resolved:
  """`name` (a directory or a hub id) as a directory on this machine.

  `flag` names the setting in errors (e.g. 'config.init.hf_dir'); `patterns`:
  the files of a hub id to fetch. Raises ValueError (one line) for a hub id
  that cannot be fetched: not cached while offline, unknown, or
  huggingface_hub not installed.
  """
  if not is_hub_id(name):
    return Resolved(os.path.expanduser(name), None, None)
  match = _HUB_ID.match(name)
  repo_id, revision = match.group('repo'), match.group('revision')
  huggingface_hub, errors = _hub_library(flag, name, 'a hub id', 'a local directory')
  command = f'hf download {repo_id}' + (f' --revision {revision}' if revision else '')
  local_dir = _download(lambda: huggingface_hub.snapshot_download(
      repo_id, revision=revision, allow_patterns=list(patterns)), flag, name, command,
      'directory', errors, huggingface_hub)
  return Resolved(local_dir, repo_id, os.path.basename(os.path.normpath(local_dir)))


def _hub_library(flag: str, name: str, what: str, instead: str):
  """(huggingface_hub, its errors module); ValueError (one line) where it is not installed."""
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel  # interop extra
    from huggingface_hub import errors  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError(f"{flag}={name!r} is {what}, which needs huggingface_hub: pip install -e "
                     f"'.[interop]' (or give {instead}).") from e
  return huggingface_hub, errors


def _download(fetch, flag: str, name: str, command: str, kind: str, errors, huggingface_hub):
  """fetch() (a huggingface_hub download), its hub errors as one ValueError line naming `flag`,
  `name` (a hub id of a `kind`, 'directory' or 'file') and the download `command`. Errors it
  does not name (a missing file in a repository) pass through."""
  try:
    return fetch()
  except errors.LocalEntryNotFoundError as e:
    as_hub = 'a hub id' if kind == 'directory' else 'a hub file'
    raise ValueError(f'{flag}={name!r}: no such local {kind}, and as {as_hub} it is not in the '
                     f'Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) '
                     f'while the hub cannot be reached (HF_HUB_OFFLINE or no network): download it '
                     f'with `{command}` (same HF_HOME), or give a local {kind}.') from e
  except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
    raise ValueError(f'{flag}={name!r}: no such model or revision on the hub '
                     f'({type(e).__name__}); check the id, or log in with `hf auth login` for '
                     'a gated or private model.') from e
  except errors.EntryNotFoundError:
    raise
  except errors.HfHubHTTPError as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f'{flag}={name!r}: the hub refused the download ({first}); try '
                     f'`{command}`.') from e


def is_hub_file(name: str) -> bool:
  """True for `org/name[@revision]/path/in/repo` that is not an existing local path."""
  if not name or os.path.exists(os.path.expanduser(name)) or '://' in name:
    return False
  return name[0] not in './~' and _HUB_FILE.match(name) is not None


@dataclasses.dataclass(frozen=True)
class ResolvedFile:
  """A file on this machine, and the hub file it is (None: a local file)."""

  local_path: str
  pinned: str | None  # 'org/name@commit/path': the name that gives exactly this file again.


def resolve_file(name: str, flag: str) -> ResolvedFile:
  """`name` (a local file or a hub file, `is_hub_file`) as a file on this machine, a hub file
  through the Hugging Face cache. ValueError (one line) as `resolve`'s, and for a repository
  without that file."""
  if not is_hub_file(name):
    return ResolvedFile(os.path.expanduser(name), None)
  match = _HUB_FILE.match(name)
  repo_id, revision, filename = match.group('repo'), match.group('revision'), match.group('file')
  huggingface_hub, errors = _hub_library(flag, name, 'a hub file', 'a local file')
  command = f'hf download {repo_id} {filename}' + (f' --revision {revision}' if revision else '')
  try:
    local_path = _download(lambda: huggingface_hub.hf_hub_download(
        repo_id, filename, revision=revision), flag, name, command, 'file', errors,
        huggingface_hub)
  except errors.EntryNotFoundError as e:
    raise ValueError(f'{flag}={name!r}: {repo_id} has no file {filename!r}' + (
        f' at {revision}' if revision else '') + '; see its files at '
        f'https://huggingface.co/{repo_id}/tree/{revision or "main"}.') from e
  # The cache keeps it as .../snapshots/<commit>/<filename>.
  snapshot = local_path[:len(local_path) - len(filename)].rstrip(os.sep)
  return ResolvedFile(local_path, f'{repo_id}@{os.path.basename(snapshot)}/{filename}')
