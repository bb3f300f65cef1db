"""The docs match the tree: docs/layout.md names every module; the README stays a reference."""

import pathlib
import re

from tests.conftest import REPO

PACKAGE = REPO / 'mlm_jax'


def _modules() -> list[pathlib.Path]:
  return sorted(p for p in PACKAGE.rglob('*.py')
                if p.name != '__init__.py' and '__pycache__' not in p.parts)


def test_layout_names_every_module_in_its_folders_row():
  layout = (REPO / 'docs' / 'layout.md').read_text()
  rows = {m.group(1): m.group(0) for m in re.finditer(r'^\| `([^`]+)` \|.*$', layout, re.M)}
  missing = []
  for path in _modules():
    folder = path.parent.relative_to(REPO).as_posix()
    row = rows.get(f'{folder}/') if folder != 'mlm_jax' else rows.get('mlm_jax/*.py')
    if row is None and path.parent.parent != PACKAGE:  # A package inside a folder: its row.
      row = rows.get(f'{path.parent.parent.relative_to(REPO).as_posix()}/')
    if row is None or f'`{path.stem}`' not in row:
      missing.append(path.relative_to(REPO).as_posix())
  assert not missing, f'docs/layout.md does not name these modules in their folder\'s row: {missing}'


def test_readme_stays_a_short_reference():
  readme = (REPO / 'README.md').read_text()
  assert len(readme.splitlines()) <= 250
  # Its first two commands are the set-up and the whole test run (.ci/run runs them).
  commands = re.findall(r'^(pip install[^\n#]*?|python -m pytest)\s+#', readme, re.M)
  assert commands[:2] == ["pip install -e '.[dev]'", 'python -m pytest']
