"""The shape of mlm_jax and configs/: config flows one way, no two packages import each other,
no function is too long to read as one step.

Read from the source (every `import`, those inside functions included), so
that an import hidden in a function to dodge a cycle is caught too.
"""

import ast
import collections
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'mlm_jax'
# The experiments import the library (configs/recipes build on mlm_jax.config.phases); the
# library never imports an experiment.
CONFIGS = ROOT / 'configs'

# (importer, imported): never, whatever the path. Third-party names are top-level packages.
FORBIDDEN = [
    ('mlm_jax.config', 'mlm_jax.training'),  # The command resolves; the loop receives.
    ('mlm_jax.data', 'mlm_jax.model'),  # Grain workers run the input side without the model...
    ('mlm_jax.data', 'mlm_jax.training'),
    ('mlm_jax.data', 'jax'),  # ...and without JAX.
    ('mlm_jax.data', 'flax'),
    ('mlm_jax.model', 'mlm_jax.data'),  # A model takes a ModelConfig and arrays.
    ('mlm_jax.model', 'mlm_jax.training'),
    # A converter of arrays: training reads a run and calls it (workdir.export_hf, init_from).
    ('mlm_jax.interop', 'mlm_jax.training'),
    # The run summary's MFU: FLOPs per token in model/flops.py, chips in runtime/hardware.py.
    ('mlm_jax.training', 'mlm_jax.perf'),
]


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imported(tree: ast.AST) -> list[tuple[str, int]]:
  """(module name, line) of every import in `tree`; `from a import b` gives a.b as well as a,
  since b may be a module."""
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, f'line {node.lineno}: a relative import'
      out.append((node.module, node.lineno))
      out += [(f'{node.module}.{a.name}', node.lineno) for a in node.names]
  return out


def _unit(module: str) -> str:
  """The package-level node of a module: mlm_jax.data.tokenizer -> mlm_jax.data; a module at
  the top of mlm_jax (errors, cli, train, ...) is its own node; configs/ is one node; another
  library is its top-level package."""
  parts = module.split('.')
  return '.'.join(parts[:2]) if parts[0] == 'mlm_jax' else parts[0]


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for root in (PACKAGE, CONFIGS) for p in sorted(root.rglob('*.py'))}


@functools.cache  # Read once for all the tests here; none changes it.
def _module_graph() -> dict[str, dict[str, str]]:
  """importer module -> {imported mlm_jax module or other library: 'file:line'}."""
  modules, graph = _modules(), {}
  for name, path in modules.items():
    edges = {}
    for imported, line in _imported(ast.parse(path.read_text(), str(path))):
      if imported.startswith(('mlm_jax.', 'configs.')) and imported not in modules:
        continue  # `from mlm_jax.x import NAME`: NAME is not a module.
      edges.setdefault(imported, f'{path.relative_to(ROOT)}:{line}')
    graph[name] = edges
  return graph


def _package_graph() -> dict[str, dict[str, str]]:
  """package -> {package it imports: where}, mlm_jax's own __init__ left out (it imports
  nothing of its packages)."""
  graph: dict[str, dict[str, str]] = collections.defaultdict(dict)
  for module, edges in _module_graph().items():
    for imported, where in edges.items():
      a, b = _unit(module), _unit(imported)
      if a != b and 'mlm_jax' not in (a, b):
        graph[a].setdefault(b, where)
  return graph


def _cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
  """One cycle of `graph` (its nodes, first repeated last), or None."""
  state: dict[str, int] = {}  # 1: on the path, 2: done.
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def _describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
  return ' -> '.join(f'{a} ({graph[a][b]})' for a, b in zip(cycle, cycle[1:])) + f' -> {cycle[-1]}'


def test_the_library_never_imports_an_experiment():
  """configs/ -> mlm_jax only: a config file reads the library's names (phases, recipes'
  arithmetic); the library takes a config as a value, from the command line or a caller."""
  graph = _module_graph()
  found = [f'{module} imports {name} ({where})' for module, edges in graph.items()
           if module.startswith('mlm_jax') for name, where in edges.items()
           if _unit(name) == 'configs']
  assert not found, '; '.join(found)
  assert any(_unit(name).startswith('mlm_jax') for module, edges in graph.items()
             if module.startswith('configs') for name in edges)  # The graph holds configs/.


def test_no_import_cycle_between_packages():
  """Without exception: where two packages would need each other, what both need goes to the
  lower one (FLOPs per token to model/, the chip table to runtime/; docs/layout.md)."""
  graph = _package_graph()
  cycle = _cycle(graph)
  assert cycle is None, f'import cycle: {_describe(cycle, graph)}'


@pytest.mark.parametrize('importer,imported', FORBIDDEN)
def test_a_layer_never_imports_what_it_must_not(importer, imported):
  graph = _module_graph()
  found = [f'{module} imports {name} ({where})' for module, edges in graph.items()
           if _unit(module) == importer for name, where in edges.items()
           if _unit(name) == imported]
  assert not found, '; '.join(found)


def test_no_import_cycle_between_the_modules_of_the_tokenizer_seam():
  """The interface (tokenizer_base) below both implementations, the factory above them."""
  graph = _module_graph()
  data = {m: {n: w for n, w in edges.items() if n.startswith('mlm_jax.data.')}
          for m, edges in graph.items() if m.startswith('mlm_jax.data.')}
  cycle = _cycle(data)
  assert cycle is None, f'import cycle: {_describe(cycle, data)}'
  for implementation in ('mlm_jax.data.sp_tokenizer', 'mlm_jax.data.hf_tokenizer'):
    assert 'mlm_jax.data.tokenizer_base' in data[implementation]
    assert 'mlm_jax.data.tokenizer' not in data[implementation]


def test_the_cycle_finder_finds_a_cycle_and_names_where():
  graph = {'a': {'b': 'a.py:1'}, 'b': {'c': 'b.py:2'}, 'c': {'a': 'c.py:3'}, 'd': {'a': 'd.py:4'}}
  cycle = _cycle(graph)
  assert cycle == ['a', 'b', 'c', 'a']
  assert _describe(cycle, graph) == 'a (a.py:1) -> b (b.py:2) -> c (c.py:3) -> a'
  assert _cycle({'a': {'b': ''}, 'b': {}, 'c': {'a': ''}}) is None


def test_no_function_is_longer_than_100_lines():
  """A function past 100 lines is several steps: each gets a name (STYLE.md)."""
  long = [f'{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})'
          for root in (PACKAGE, CONFIGS) for path in sorted(root.rglob('*.py'))
          for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.end_lineno - node.lineno + 1 > 100]
  assert not long, '; '.join(long)
