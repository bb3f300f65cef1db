"""Command line: python -m mlm_jax.sizing [--out=docs/sizing.md] [--only=base-128@v4-32,...]
                                          [--table_only].

Regenerates the sizing table of the docs with the pre-flight: BERT-base and
BERT-large at T=128 and T=512 on TPU slices and H100 nodes, the largest
per-device batch that fits, its memory and the TPU compiler's estimates.
Figures accumulate in the JSON beside the table, so a stopped run continues
where it stopped. See mlm_jax/perf/sizing.py.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.perf import sizing

_OUT = flags.DEFINE_string('out', 'docs/sizing.md',
                           'Markdown table to write; the JSON beside it keeps the figures.')
_ONLY = flags.DEFINE_list('only', [], 'Cells to (re)compute, as MODEL-T@TARGET (e.g. '
                          'base-128@v4-32); default: every cell not yet in the JSON.')

_TABLE_ONLY = flags.DEFINE_bool('table_only', False,
                                'Rewrite the table from the JSON without compiling.')


def main() -> None:
  sizing.run(_OUT.value, _ONLY.value, compile_missing=not _TABLE_ONLY.value)


if __name__ == '__main__':
  cli.run(main, backend_choice='compile_only')
