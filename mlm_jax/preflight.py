"""Command line: python -m mlm_jax.preflight --config=configs/base.py --target=v4-32.

Compiles the run's train and eval steps for an accelerator target on this
machine, without the accelerator, and says whether they fit:

  python -m mlm_jax.preflight --config=configs/base.py --target=h100x8 \
      [--config.train.batch_size=512 ...] [--search_budget_s=60] [--json_out=preflight.json]

A config in phases (config.phases) is compiled phase by phase; each must fit.

Exit status 0: fits; 1: does not fit, or asked for cuDNN attention and did
not get it (with compiled suggestions that fit); 2: bad input. Needs
`pip install -e '.[aot]'`. See mlm_jax/perf/preflight.py and docs/preflight.md.
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import flags

from mlm_jax import cli
from mlm_jax.config import phases
from mlm_jax.perf import preflight
from mlm_jax.perf import targets

_CONFIG = cli.config_flag()
_TARGET = flags.DEFINE_string('target', None, 'Accelerator target: ' + '; '.join(targets.KNOWN))
flags.mark_flags_as_required(['target'])
_SEARCH_BUDGET = flags.DEFINE_float(
    'search_budget_s', preflight.SEARCH_BUDGET_S,
    'When a step does not fit: seconds of compiles the search for what would fit may spend '
    'past its first three (two small ones and the prediction); when spent, the best '
    'bounds found are printed.')
_JSON_OUT = flags.DEFINE_string('json_out', '', 'Also write every figure to this JSON file.')


def main() -> int:
  log = lambda s: print(s, file=sys.stderr, flush=True)
  target = targets.parse(_TARGET.value)
  config = _CONFIG.value
  # A run in phases: every phase is compiled and must fit (its length, batch and masking).
  plan = phases.Plan(config) if config.get('phases') else None
  runs = plan.phases if plan else [None]
  reports = []
  compiled = {}  # Phases that share a program (an eval step, often) compile it once.
  for phase in runs:
    if phase is not None:
      print(f'Phase {phase.index + 1}/{len(runs)} {phase.name!r}:', flush=True)
    report = preflight.Preflight(config if phase is None else phase.config, target, log,
                                 search_budget_s=_SEARCH_BUDGET.value, compiled=compiled).run()
    report['command'] = shlex.join(['python', '-m', 'mlm_jax.preflight', *sys.argv[1:]])
    if phase is not None:
      report['phase'] = phase.name
    print(preflight.format_report(report), flush=True)
    reports.append(report)
  ok = all(r['ok'] for r in reports)
  if plan:
    print(f"{sum(r['ok'] for r in reports)} of {len(reports)} phases fit on {target.name}.",
          flush=True)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, 'w') as f:
      json.dump(reports[0] if plan is None else {'phases': reports, 'ok': ok}, f, indent=2,
                default=str)
    print(f'Wrote {_JSON_OUT.value}')
  return 0 if ok else 1


if __name__ == '__main__':
  cli.run(main, backend_choice='compile_only')
