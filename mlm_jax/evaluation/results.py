"""A sweep's results: results.json (every figure), results.md (one table), results.png.

  results.json  the suite, the protocol (with its sources), the model's identity,
                mlm_jax's version, the data read; per task every cell and seed with
                every metric, each cell's summary over seeds (median or mean, and
                min-max), the chosen cell and its figures; the suite's average; the
                same for transformers' runs under 'compare' (--compare=hf)
  results.md    one table, task by metric: the chosen cell's summary and spread
                over seeds (x100, as papers print them), ours beside transformers',
                and the average as the papers compute it (tasks.py)
  results.png   the task scores, ours beside transformers', with their spread

What must stay true: the files are written whole (a temporary file, then a
rename), from finished cells only, and results.md says which protocol and
model its figures come from.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from mlm_jax.analysis import plot
from mlm_jax.evaluation import protocols as protocols_lib
from mlm_jax.evaluation import sweep as sweep_lib
from mlm_jax.evaluation import tasks as tasks_lib

JSON_FILE, TABLE_FILE, FIGURE_FILE = 'results.json', 'results.md', 'results.png'


def summarize(protocol: protocols_lib.Protocol, tasks: list[tasks_lib.Task],
              cells: dict[str, dict[str, dict[int, dict[str, Any]]]],
              averaged: list[str]) -> dict[str, Any]:
  """Per task: its cells (each seed's record, the summary and spread of every metric, the
  cell's score), the chosen cell; the average of the chosen scores over `averaged`."""
  out: dict[str, Any] = {}
  for task in tasks:
    rows = []
    for name, seeds in cells[task.name].items():
      values = {m.name: [seeds[s]['metrics'][m.name] for s in protocol.seeds]
                for m in task.metrics}
      rows.append({
          'cell': name, 'values': next(iter(seeds.values()))['cell'],
          'seeds': {str(s): {k: r[k] for k in ('metrics', 'best_step', 'start', 'plan',
                                               'wall_time_s') if k in r}
                    for s, r in seeds.items()},
          'summary': {m: sweep_lib.aggregate(protocol, v) for m, v in values.items()},
          'spread': {m: [min(v), max(v)] for m, v in values.items()},
          'score': sweep_lib.cell_score(protocol, task, seeds)})
    chosen_name = sweep_lib.select(protocol, task, cells[task.name])
    chosen = next(r for r in rows if r['cell'] == chosen_name)
    out[task.name] = {'title': task.title or task.name, 'kind': task.kind,
                      'metrics': [m.name for m in task.metrics], 'cells': rows,
                      'selected': {k: chosen[k] for k in ('cell', 'summary', 'spread', 'score')}}
  scored = [out[t]['selected']['score'] for t in averaged if t in out]
  return {'tasks': out, 'average': statistics.fmean(scored) if scored else None,
          'averaged_tasks': [t for t in averaged if t in out]}


def write(out_dir: str, header: dict[str, Any], ours: dict[str, Any],
          theirs: dict[str, Any] | None) -> dict[str, Any]:
  """Writes results.json, results.md and results.png into `out_dir`; returns the json's
  content. `header`: suite, protocol, model, mlm_jax, data."""
  content = {**header, **ours}
  if theirs is not None:
    content['compare'] = {'hf': theirs}
  sweep_lib.write_json(os.path.join(out_dir, JSON_FILE), content)
  _write_text(os.path.join(out_dir, TABLE_FILE), table(header, ours, theirs))
  figure(os.path.join(out_dir, FIGURE_FILE), header, ours, theirs)
  return content


def _pct(x: float) -> str:
  return f'{100 * x:.2f}'


def _figure_cell(summary: float, spread: list[float], seeds: int) -> str:
  return _pct(summary) if seeds == 1 else f'{_pct(summary)} ({_pct(spread[0])}–{_pct(spread[1])})'


def table(header: dict[str, Any], ours: dict[str, Any], theirs: dict[str, Any] | None) -> str:
  """results.md: the chosen cells' figures, task by metric (see the module docstring)."""
  protocol = header['protocol']
  seeds = len(protocol['seeds'])
  lines = [f'# {header["suite"]} dev results: protocol `{protocol["name"]}`', '',
           f'Model: {describe_model(header["model"])}. mlm_jax {header["mlm_jax"]["version"]}'
           + (f' ({header["mlm_jax"]["git"]})' if header['mlm_jax'].get('git') else '')
           + f'. Data: {header["data_source"]}.', '',
           f'Each figure is the chosen cell\'s {protocol["aggregate"]} over {seeds} seed(s)'
           + (' (min–max)' if seeds > 1 else '') + ', x100; the cell is the one whose '
           f'{protocol["aggregate"]} task score on dev is highest; runs count their '
           f'{protocol["within_run"]} evaluation. The protocol\'s values and their sources '
           'are in results.json.', '']
  columns = ['task', 'metric', 'ours'] + (['transformers'] if theirs else []) + ['cell (ours)']
  lines += ['| ' + ' | '.join(columns) + ' |', '|' + ' --- |' * len(columns)]
  for name, task in ours['tasks'].items():
    chosen = task['selected']
    for metric in task['metrics']:
      row = [task['title'], metric, _figure_cell(chosen['summary'][metric],
                                                 chosen['spread'][metric], seeds)]
      if theirs:
        t = theirs['tasks'][name]['selected']
        row.append(_figure_cell(t['summary'][metric], t['spread'][metric], seeds))
      lines.append('| ' + ' | '.join(row + [f'`{chosen["cell"]}`']) + ' |')
  if ours['average'] is not None:
    which = ', '.join(ours['averaged_tasks'])
    row = [f'average ({which})', 'mean of task scores', _pct(ours['average'])]
    if theirs:
      row.append(_pct(theirs['average']) if theirs['average'] is not None else '')
    lines.append('| ' + ' | '.join(row + ['']) + ' |')
  lines += ['', 'A task\'s score is the mean of its metrics (as the GLUE leaderboard scores a '
            'task); the GLUE average leaves out WNLI, as BERT, RoBERTa and ModernBERT do.', '']
  return '\n'.join(lines)


def describe_model(model: dict[str, Any]) -> str:
  if 'workdir' in model:
    return f'the run {model["workdir"]} at step {model["step"]}'
  return f'the checkpoint {model.get("hf_dir", "?")}'


def figure(path: str, header: dict[str, Any], ours: dict[str, Any],
           theirs: dict[str, Any] | None) -> None:
  """results.png: each task's chosen score (x100), ours beside transformers', min-max bars."""
  plt = plot.pyplot()
  names = list(ours['tasks'])
  systems = [('ours', ours)] + ([('transformers', theirs)] if theirs else [])
  width = 0.8 / len(systems)
  fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(names) + 1), 3.6), dpi=120)
  for k, (label, result) in enumerate(systems):
    scores, low, high = [], [], []
    for name in names:
      task = result['tasks'][name]
      per_seed = _task_scores(task)
      score = 100 * task['selected']['score']
      scores.append(score)
      low.append(score - 100 * min(per_seed))
      high.append(100 * max(per_seed) - score)
    xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(names))]
    ax.bar(xs, scores, width, yerr=[low, high], capsize=3, label=label)
  ax.set_xticks(range(len(names)), [ours['tasks'][n]['title'] for n in names])
  ax.set_ylabel('task score (x100)')
  ax.set_title(f'{header["suite"]}, protocol {header["protocol"]["name"]}', fontsize=10)
  ax.legend(fontsize=8, loc='lower right', framealpha=0.9)
  fig.tight_layout()
  tmp = f'{path}.{os.getpid()}.tmp.png'
  fig.savefig(tmp)
  plt.close(fig)
  os.replace(tmp, path)


def _task_scores(task: dict[str, Any]) -> list[float]:
  """The chosen cell's task score of each seed (the mean of the task's metrics)."""
  chosen = next(c for c in task['cells'] if c['cell'] == task['selected']['cell'])
  return [statistics.fmean(r['metrics'][m] for m in task['metrics'])
          for r in chosen['seeds'].values()]


def _write_text(path: str, text: str) -> None:
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)
