"""The evaluation suite: GLUE's files in their layouts, bad input named, protocols as their
sources state them, the selection rule, and a sweep on a small GLUE directory that is killed,
resumed without running a finished cell again, and compared with transformers'."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mlm_jax.errors import ConfigError
from mlm_jax.evaluation import glue_data
from mlm_jax.evaluation import protocols
from mlm_jax.evaluation import results
from mlm_jax.evaluation import suite_file
from mlm_jax.evaluation import sweep
from mlm_jax.evaluation import tasks as tasks_lib
from mlm_jax.finetuning import data as data_lib
from tests.conftest import REPO

# Words the micro runs' tokenizer knows; MARKER in the second text (or the sentence) decides
# the label, OTHER marks MNLI's third class.
WORDS = ('the', 'file', 'returns', 'list', 'value', 'string', 'object', 'function', 'name',
         'type', 'data', 'module', 'class')
MARKER, OTHER = 'error', 'default'
MNLI_HEADER = ('index', 'promptID', 'pairID', 'genre', 'sentence1_binary_parse',
               'sentence2_binary_parse', 'sentence1_parse', 'sentence2_parse', 'sentence1',
               'sentence2', 'label1')


def _sentence(rng: np.random.Generator, marker: str | None = None) -> str:
  words = list(rng.choice(WORDS, rng.integers(4, 9)))
  if marker:
    words.insert(int(rng.integers(0, len(words) + 1)), marker)
  return ' '.join(words)


def write_glue(root, n_train: int = 64, n_dev: int = 32, seed: int = 0) -> str:
  """A GLUE download directory with every task's files, columns and header rules (CoLA without
  a header; MNLI's 12 and 16 columns), whose labels MARKER decides."""
  rng = np.random.default_rng(seed)

  def pairs(n, labels):
    out = []
    for i in range(n):
      k = i % len(labels)
      marker = (MARKER, None, OTHER)[k] if len(labels) == 3 else (MARKER if k == 1 else None)
      out.append((_sentence(rng), _sentence(rng, marker), labels[k]))
    return out

  def write(folder, name, header, rows):
    os.makedirs(os.path.join(root, folder), exist_ok=True)
    with open(os.path.join(root, folder, name), 'w') as f:
      f.write('\t'.join(header) + '\n' if header else '')
      f.writelines('\t'.join(map(str, cells)) + '\n' for cells in rows)

  for split, n in (('train', n_train), ('dev', n_dev)):
    singles = [(_sentence(rng, MARKER if i % 2 else None), str(i % 2)) for i in range(n)]
    write('CoLA', f'{split}.tsv', None,
          [('gj04', label, '' if label == '1' else '*', s) for s, label in singles])
    write('SST-2', f'{split}.tsv', ('sentence', 'label'), singles)
    write('MRPC', f'{split}.tsv', ('Quality', '#1 ID', '#2 ID', '#1 String', '#2 String'),
          [(y, 100 + i, 200 + i, a, b) for i, (a, b, y) in enumerate(pairs(n, ('0', '1')))])
    write('STS-B', f'{split}.tsv', ('index', 'genre', 'filename', 'year', 'old_index', 'source1',
                                   'source2', 'sentence1', 'sentence2', 'score'),
          [(i, 'main-news', 'f', '2012', i, 'none', 'none', a, b,
            f'{(4.0 if y == "1" else 1.0) + rng.uniform(0, 0.5):.3f}')
           for i, (a, b, y) in enumerate(pairs(n, ('0', '1')))])
    write('QQP', f'{split}.tsv', ('id', 'qid1', 'qid2', 'question1', 'question2', 'is_duplicate'),
          [(i, 2 * i, 2 * i + 1, a, b, y) for i, (a, b, y) in enumerate(pairs(n, ('0', '1')))])
    write('QNLI', f'{split}.tsv', ('index', 'question', 'sentence', 'label'),
          [(i, a, b, y) for i, (a, b, y) in
           enumerate(pairs(n, ('not_entailment', 'entailment')))])
    for name, labels in (('RTE', ('not_entailment', 'entailment')), ('WNLI', ('0', '1'))):
      write(name, f'{split}.tsv', ('index', 'sentence1', 'sentence2', 'label'),
            [(i, a, b, y) for i, (a, b, y) in enumerate(pairs(n, labels))])
  mnli = ('entailment', 'neutral', 'contradiction')
  write('MNLI', 'train.tsv', MNLI_HEADER + ('gold_label',),
        [(i, i, f'{i}e', 'fiction', '( a )', '( b )', '(ROOT a)', '(ROOT b)', a, b, y, y)
         for i, (a, b, y) in enumerate(pairs(n_train, mnli))])
  for name in ('dev_matched.tsv', 'dev_mismatched.tsv'):
    write('MNLI', name, MNLI_HEADER + ('label2', 'label3', 'label4', 'label5', 'gold_label'),
          [(i, i, f'{i}e', 'fiction', '( a )', '( b )', '(ROOT a)', '(ROOT b)', a, b) + (y,) * 6
           for i, (a, b, y) in enumerate(pairs(n_dev, mnli))])
  return str(root)


@pytest.fixture(scope='module')
def glue_dir(tmp_path_factory) -> str:
  return write_glue(tmp_path_factory.mktemp('glue'))


# ------------------------------------------------------------------ reading


def test_each_task_reads_its_columns_and_labels(glue_dir):
  for task in tasks_lib.GLUE.values():
    for split in ('train', *task.dev_splits):
      rows = glue_data.read_split(glue_dir, task, split)
      assert len(rows) == (64 if split == 'train' else 32), (task.name, split)
      assert all(len(r.texts) == (1 if task.name in ('cola', 'sst2') else 2) for r in rows)
      if task.labels is None:
        assert all(1.0 <= r.label <= 4.5 for r in rows)
      else:
        assert {r.label for r in rows} == set(task.labels), task.name
  cola = glue_data.read_split(glue_dir, tasks_lib.GLUE['cola'], 'train')
  assert cola[0].where.endswith('CoLA/train.tsv line 1')    # No header: line 1 is a row.
  mnli = glue_data.read_split(glue_dir, tasks_lib.GLUE['mnli'], 'dev_mismatched')
  assert mnli[1].where.endswith('MNLI/dev_mismatched.tsv line 3')   # After the header.
  # The label follows the marker in the second text, wherever the file keeps its columns.
  for name in ('mrpc', 'qqp', 'rte', 'mnli'):
    for row in glue_data.read_split(glue_dir, tasks_lib.GLUE[name], 'train'):
      assert (MARKER in row.texts[1].split()) == (row.label in ('1', 'entailment'))


def test_tfds_and_hugging_face_layouts_give_glue_labels(monkeypatch):
  """tfds's and nyu-mll/glue's class names map onto GLUE's own spellings; STS-B reads a pair."""
  datasets = pytest.importorskip('datasets')
  table = datasets.Dataset.from_dict(
      {'sentence1': ['a cat', 'a dog'], 'sentence2': ['a cat sits', 'it rains'],
       'label': [1, 0], 'idx': [0, 1]},
      features=datasets.Features({
          'sentence1': datasets.Value('string'), 'sentence2': datasets.Value('string'),
          'label': datasets.ClassLabel(names=['not_equivalent', 'equivalent']),
          'idx': datasets.Value('int32')}))
  monkeypatch.setattr(glue_data, '_hf_split', lambda task, split: table)
  rows = glue_data.read_split('hf', tasks_lib.GLUE['mrpc'], 'dev')
  assert [(r.texts, r.label) for r in rows] == [(('a cat', 'a cat sits'), '1'),
                                               (('a dog', 'it rains'), '0')]
  assert rows[1].where == 'nyu-mll/glue mrpc validation record 1'

  def tfds_examples(spec, kind, fields, tfds_data_dir):
    assert (spec, kind, fields.text, fields.text_pair) == (
        'tfds:glue/mnli:validation_mismatched', 'pair', 'premise', 'hypothesis')
    return [data_lib.Example(0, ('p', 'h'), 'contradiction'),
            data_lib.Example(1, ('p', 'h'), 'unknown')]
  monkeypatch.setattr(data_lib, 'read_examples', tfds_examples)
  with pytest.raises(data_lib.DataError, match=r"validation_mismatched record 1: label "
                     r"'unknown' is none of MNLI's classes"):
    glue_data.read_split('tfds', tasks_lib.GLUE['mnli'], 'dev_mismatched')


def _rewrite(path, edit):
  with open(path) as f:
    lines = f.read().splitlines(keepends=True)
  with open(path, 'w') as f:
    f.writelines(edit(lines))


BAD_INPUT = {
    'missing task directory': (
        'rte', 'train', lambda d: os.rename(f'{d}/RTE', f'{d}/RTE.away'),
        r'RTE: no such directory; --data=.* must hold RTE\'s files there \(train.tsv, dev.tsv\)'),
    'columns not the task\'s': (
        'qqp', 'dev', lambda d: _rewrite(f'{d}/QQP/dev.tsv', lambda ls: ls[:4] + [
            ls[4].replace('\t', ' ', 1)] + ls[5:]),
        r'QQP/dev.tsv line 5: 5 cells, but the header names 6: not QQP\'s columns'),
    'header without the task\'s columns': (
        'sst2', 'train', lambda d: _rewrite(f'{d}/SST-2/train.tsv', lambda ls: [
            'text\tlabel\n'] + ls[1:]),
        r"SST-2/train.tsv line 1: the header names the columns \['text', 'label'\], without "
        r"SST-2's \['sentence'\]"),
    'a label outside the task\'s set': (
        'rte', 'dev', lambda d: _rewrite(f'{d}/RTE/dev.tsv', lambda ls: ls[:3] + [
            ls[3].rsplit('\t', 1)[0] + '\tmaybe\n'] + ls[4:]),
        r"RTE/dev.tsv line 4: label 'maybe' is none of RTE's labels \['entailment', "
        r"'not_entailment'\]"),
    'a score outside STS-B\'s range': (
        'stsb', 'train', lambda d: _rewrite(f'{d}/STS-B/train.tsv', lambda ls: ls[:2] + [
            ls[2].rsplit('\t', 1)[0] + '\t7.5\n'] + ls[3:]),
        r"STS-B/train.tsv line 3: label '7.5' is not a similarity score in \[0, 5\]"),
    'an empty split': (
        'mnli', 'dev_matched', lambda d: _rewrite(f'{d}/MNLI/dev_matched.tsv', lambda ls: ls[:1]),
        r"MNLI/dev_matched.tsv holds no rows after its header: MNLI's dev_matched split is "
        'empty'),
    'an empty headerless split': (
        'cola', 'dev', lambda d: _rewrite(f'{d}/CoLA/dev.tsv', lambda ls: []),
        r"CoLA/dev.tsv holds no rows: CoLA's dev split is empty"),
    'an empty text': (
        'cola', 'train', lambda d: _rewrite(f'{d}/CoLA/train.tsv', lambda ls: [
            'gj04\t1\t\t \n'] + ls[1:]),
        r"CoLA/train.tsv line 1: column 3 \(the text\) is empty"),
    'not UTF-8': (
        'wnli', 'train', lambda d: open(f'{d}/WNLI/train.tsv', 'ab').write(b'7\t\xff\tb\t1\n'),
        r'WNLI/train.tsv line 66: not UTF-8 text'),
}


@pytest.mark.parametrize('case', sorted(BAD_INPUT))
def test_bad_input_names_the_file_and_row(case, tmp_path):
  task, split, spoil, message = BAD_INPUT[case]
  root = write_glue(tmp_path / 'glue')
  spoil(root)
  with pytest.raises(data_lib.DataError, match=message):
    glue_data.read_split(root, tasks_lib.GLUE[task], split)


def test_rows_are_written_once_and_drawn_down_by_seed(glue_dir, tmp_path):
  task = tasks_lib.GLUE['stsb']
  rows = glue_data.read_split(glue_dir, task, 'train')
  path = str(tmp_path / 'train.jsonl')
  digest = glue_data.write_rows(path, task, rows)
  mtime = os.stat(path).st_mtime_ns
  assert glue_data.write_rows(path, task, rows) == digest == glue_data.rows_digest(task, rows)
  assert os.stat(path).st_mtime_ns == mtime   # The same rows: the file is left as it is.
  examples = data_lib.read_examples(path, 'regress')   # A pair, read as finetune reads it.
  assert [(e.texts, e.label) for e in examples] == [(r.texts, r.label) for r in rows]
  kept = glue_data.subsample(rows, 10)
  assert kept == glue_data.subsample(rows, 10) and len(kept) == 10
  assert [rows.index(r) for r in kept] == sorted(rows.index(r) for r in kept)


# ---------------------------------------------------------------- protocols


def _number(value: float) -> str:
  """As the sources write numbers: 5e-5, 0.1, 32."""
  return f'{value:g}'.replace('e-0', 'e-')


def test_published_protocols_state_their_sources_values():
  """Every grid value of a published protocol appears in the source cited for it."""
  b, r, m = protocols.BERT, protocols.ROBERTA, protocols.MODERNBERT
  assert (b.grid.learning_rates, b.grid.batch_sizes, b.grid.epochs) == (
      (5e-5, 4e-5, 3e-5, 2e-5), (32,), (3.0,))
  assert (b.grid.warmup, b.grid.weight_decay, b.grad_clip_norm, b.max_seq_len,
          b.within_run) == ((0.1,), (0.01,), 1.0, 128, 'last')
  assert (r.grid.learning_rates, r.grid.batch_sizes, r.grid.epochs, r.grid.warmup) == (
      (1e-5, 2e-5, 3e-5), (16, 32), (10.0,), (0.06,))
  assert (r.seeds, r.aggregate, r.start_from_mnli, r.adam_b2, r.grad_clip_norm) == (
      (0, 1, 2, 3, 4), 'median', ('rte', 'mrpc', 'stsb'), 0.98, 0.0)
  for protocol in (b, r):
    for field in ('learning_rates', 'batch_sizes', 'epochs', 'warmup', 'weight_decay'):
      for value in getattr(protocol.grid, field):
        shown = f'{100 * value:g}%' if field == 'warmup' and protocol is r else _number(value)
        assert shown in protocol.sources[field], (protocol.name, field, value)
  # ModernBERT: glue_jobs.py's (lr, decoupled weight decay, epochs, batch) of each task; the
  # decay is stored in optax's convention, weight_decay / lr.
  jobs = m.sources['task_grids']
  for task, grid in m.task_grids.items():
    lr, epochs, batch = grid.learning_rates[0], grid.epochs[0], grid.batch_sizes[0]
    decoupled = grid.weight_decay[0] * lr
    title = tasks_lib.GLUE[task].title
    shown = f'{title} {_number(lr)}, {_number(decoupled)}, {_number(epochs)}ep, {batch}'
    assert shown in jobs, (task, shown)
  assert m.seeds == (1618, 42, 6033) and '1618, 42, 6033' in m.sources['seeds']
  for protocol in protocols.PROTOCOLS.values():
    protocol.check()
    assert protocols.from_dict(json.loads(json.dumps(protocol.to_dict()))) == protocol


def test_selection_takes_the_best_median_cell_and_averages_without_wnli():
  protocol = protocols.Protocol('test', protocols._grid(learning_rates=(1e-5, 2e-5),
                                                        batch_sizes=16, epochs=1.0),
                                seeds=(0, 1, 2))
  a, b = [c.name for c in protocol.cells('mrpc')]

  def record(f1, accuracy):
    return {'metrics': {'f1': f1, 'accuracy': accuracy}, 'cell': {}}
  # Cell a wins one seed by far; b has the higher median task score.
  cells = {a: {0: record(0.99, 0.99), 1: record(0.5, 0.5), 2: record(0.6, 0.6)},
           b: {0: record(0.7, 0.7), 1: record(0.72, 0.7), 2: record(0.65, 0.66)}}
  mrpc = tasks_lib.GLUE['mrpc']
  assert sweep.select(protocol, mrpc, cells) == b
  wnli = tasks_lib.GLUE['wnli']
  wnli_cells = {a: {s: {'metrics': {'accuracy': 0.1}, 'cell': {}} for s in range(3)},
                b: {s: {'metrics': {'accuracy': 0.1}, 'cell': {}} for s in range(3)}}
  summary = results.summarize(protocol, [mrpc, wnli], {'mrpc': cells, 'wnli': wnli_cells},
                              averaged=['mrpc'])
  chosen = summary['tasks']['mrpc']['selected']
  assert chosen['cell'] == b and chosen['summary'] == {'f1': 0.7, 'accuracy': 0.7}
  assert chosen['spread'] == {'f1': [0.65, 0.72], 'accuracy': [0.66, 0.7]}
  assert summary['tasks']['wnli']['selected']['cell'] == a   # A tie keeps the earlier cell.
  assert summary['average'] == pytest.approx(0.7)           # WNLI left out.


def test_a_suite_file_names_its_tasks_and_refuses_a_bad_one(tmp_path):
  (tmp_path / 'train.jsonl').write_text('{"text": "a", "label": "x"}\n')
  (tmp_path / 'dev.jsonl').write_text('{"text": "b", "label": "y"}\n')
  good = {'name': 'mine', 'tasks': [{'name': 'topic', 'kind': 'classify',
                                     'train': 'train.jsonl', 'dev': 'dev.jsonl',
                                     'metrics': ['accuracy', 'macro_f1']}]}
  path = tmp_path / 'suite.json'
  path.write_text(json.dumps(good))
  name, (task,) = suite_file.load(str(path))
  assert name == 'mine' and task.task.kind == 'classify' and task.task.run_score == 'accuracy'
  assert task.files['train'] == str(tmp_path / 'train.jsonl')
  assert [m.name for m in task.task.metrics] == ['accuracy', 'macro_f1']
  bad = {'f1 without its positive label': ({'metrics': ['f1']}, 'metric f1 needs the positive'),
         'a metric the kind lacks': ({'kind': 'regress'}, "metric 'accuracy' is not reported "
                                     "for kind 'regress'"),
         'an unknown key': ({'label': 'x'}, r"unknown keys \['label'\]")}
  for case, (change, message) in bad.items():
    path.write_text(json.dumps({'tasks': [{**good['tasks'][0], **change}]}))
    with pytest.raises(ConfigError, match=message):
      suite_file.load(str(path))


# -------------------------------------------------------------- end to end


def _evaluate_command(*args: str) -> list[str]:
  return [sys.executable, '-m', 'mlm_jax.evaluate', *args]


def _sweep_env() -> dict[str, str]:
  """The environment of a sweep's command: transformers' model is tiny, so torch's threads
  would only contend with JAX's and pytest's (XLA_FLAGS, conftest's, compile the cells'
  programs without LLVM's optimisations; the persistent cache serves every later sweep's)."""
  return {**os.environ, 'OMP_NUM_THREADS': '1'}


def _cell_files(out: str) -> list[str]:
  found = []
  for folder, _, files in os.walk(os.path.join(out, 'cells')):
    found += [os.path.join(folder, f) for f in files if f == sweep.CELL_FILE]
  return found


@pytest.mark.slow
def test_quick_sweep_killed_resumes_without_rerunning_a_cell_and_matches_transformers(
    micro_run, glue_dir, tmp_path):
  """evaluate --suite=glue --protocol=quick on the nine tasks, killed once its first cell is
  finished; the same command then finishes the sweep, runs transformers' cells beside ours,
  and writes every task's metrics."""
  pytest.importorskip('transformers')
  pytest.importorskip('accelerate')
  out = str(tmp_path / 'out')
  command = _evaluate_command('--suite=glue', '--protocol=quick', f'--data={glue_dir}',
                              f'--workdir={micro_run}', f'--out={out}', '--compare=hf')
  env = _sweep_env()
  first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
  deadline = time.time() + 300
  while not _cell_files(out) and first.poll() is None and time.time() < deadline:
    time.sleep(0.2)
  first.send_signal(signal.SIGKILL)
  first.wait()
  (finished,) = _cell_files(out)
  with open(finished, 'rb') as f:
    kept = f.read()
  kept_mtime = os.stat(finished).st_mtime_ns
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                        env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  # The finished cell was neither run nor written again; every other one ran once.
  name = os.path.relpath(os.path.dirname(finished), os.path.join(out, 'cells'))
  ours = [line.split(':')[0] for line in done.stdout.splitlines() if line.startswith('ours ')]
  assert f'ours {name}' not in ours and len(ours) == len(set(ours)) == 17, ours
  with open(finished, 'rb') as f:
    assert f.read() == kept and os.stat(finished).st_mtime_ns == kept_mtime
  with open(os.path.join(out, results.JSON_FILE)) as f:
    content = json.load(f)
  assert content['protocol']['name'] == 'quick'
  assert content['model'] == {**content['model'], 'workdir': micro_run, 'step': 8}
  table = open(os.path.join(out, results.TABLE_FILE)).read()
  assert os.path.getsize(os.path.join(out, results.FIGURE_FILE)) > 1000
  for name, task in tasks_lib.GLUE.items():
    for system in (content, content['compare']['hf']):
      chosen = system['tasks'][name]['selected']
      assert sorted(chosen['summary']) == sorted(m.name for m in task.metrics)
      assert len(system['tasks'][name]['cells'][0]['seeds']) == 2
    for metric in task.metrics:
      assert f'| {task.title} | {metric.name} |' in table
    # Within seed noise: two systems' task scores on 32 dev rows (2 standard errors of a
    # difference of two accuracies or correlations at n=32: 2 * sqrt(2 / 32) = 0.5).
    ours_score = content['tasks'][name]['selected']['score']
    theirs_score = content['compare']['hf']['tasks'][name]['selected']['score']
    assert abs(ours_score - theirs_score) <= 0.5, (name, ours_score, theirs_score)


@pytest.mark.slow
def test_one_error_line_for_bad_data_before_any_cell_runs(micro_run, tmp_path):
  root = write_glue(tmp_path / 'glue')
  os.rename(os.path.join(root, 'WNLI'), os.path.join(root, 'WNLI.away'))
  out = str(tmp_path / 'out')
  bad = subprocess.run(_evaluate_command('--suite=glue', f'--data={root}', f'--out={out}',
                                         f'--workdir={micro_run}', '--tasks=sst2,wnli'),
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith(f'error: {root}/WNLI: no such directory')
  assert not os.path.exists(os.path.join(out, 'cells'))   # Nothing ran before the check.


@pytest.mark.slow
def test_rte_starts_from_the_chosen_mnli_model(micro_run, glue_dir, tmp_path):
  """Under a protocol whose RTE starts from MNLI: MNLI runs first (brought in by RTE), its
  chosen cell's model is kept, and RTE's run records that it started there. (The quick
  protocol's cells with one seed: the sweep above has compiled their programs.)"""
  spec = {**json.loads(json.dumps(protocols.QUICK.to_dict())), 'name': 'quick_from_mnli',
          'seeds': [0], 'start_from_mnli': ['rte']}
  path = tmp_path / 'protocol.json'
  path.write_text(json.dumps(spec))
  out = str(tmp_path / 'out')
  done = subprocess.run(_evaluate_command('--suite=glue', f'--protocol={path}', '--tasks=rte',
                                          f'--data={glue_dir}', f'--workdir={micro_run}',
                                          f'--out={out}'),
                        cwd=REPO, capture_output=True, text=True, timeout=600, env=_sweep_env())
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(out, results.JSON_FILE)) as f:
    assert sorted(json.load(f)['tasks']) == ['mnli', 'rte']
  cell = protocols.QUICK.cells('rte')[0].name
  mnli = os.path.join(out, 'cells', 'mnli', cell, 'seed0', 'model')
  rte = sweep.read_cell(os.path.join(out, 'cells', 'rte', cell, 'seed0'))
  assert rte['start'] == mnli
  with open(os.path.join(out, 'cells', 'rte', cell, 'seed0', 'model', 'model.json')) as f:
    started = json.load(f)['pretrained']
  assert started['finetuned'] == mnli and started['task'] == 'pair'
  assert started['from'] == {'workdir': micro_run, 'step': 8}
  assert os.listdir(os.path.join(mnli, 'best'))          # Kept: RTE started from it.
  assert not os.path.exists(os.path.join(out, 'cells', 'rte', cell, 'seed0', 'model', 'best'))
