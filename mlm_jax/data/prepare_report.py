"""Prepare's report for the console: a data dir's splits, inputs skipped or repaired, and what
tokenizer training saw, in a few lines (report.json holds it all)."""

from __future__ import annotations

import json
import os

from mlm_jax.data import line_sample
from mlm_jax.data.prepared import SPLITS


def format_report(report: dict, data_dir: str, names: tuple[str, ...] = ()) -> str:
  """The report as a few lines for the console (report.json has it all); `names`: a mixture's
  sources."""
  w = report['work']
  stages = ', '.join(f'{k} {v:.1f}s' for k, v in w['stage_seconds'].items())
  where = (f'{w["workers"]} workers' if w.get('beam_options') is None
           else f'Apache Beam {" ".join(w["beam_options"])}')
  lines = [f'Prepared {report["corpus"]} into {data_dir} in {w["seconds"]:.1f}s ({stages}; '
           f'{where}; reused {w["units_reused"]}/{w["units"]} units, '
           f'{w["shards_reused"]}/{w["shards"]} shards)']
  splits = report['splits']
  members = [(f'{names[p]} ' if p < len(names) else f'source {p} ', m)
             for p, m in enumerate(splits.get('parts', ()))]
  for prefix, stats in [('', splits)] + members:
    for s in SPLITS:
      st = stats[s]
      unknown = f', unknown {st["unknown_rate"]:.4%}' if st.get('unknown_rate') else ''
      dropped = (f', {st["dropped_tokens"]:,} tokens of short last chunks dropped'
                 if 'dropped_tokens' in st else '')
      lines.append(f'  {prefix}{s}: {st["documents"]:,} documents, {st["tokens"]:,} tokens, '
                   f'{st["rows"]:,} rows, padding {st["padding_fraction"]:.4%}{dropped}{unknown}')
  t = report['tokenizer']
  # A tokenizer stage finished by an older version (a resumed prepare) has other counts.
  if t.get('trained') and 'sentences_seen' in t:
    lines.extend(f'  tokenizer: {line}' for line in tokenizer_sample_summary(t))
  inputs = report['inputs']
  counts = {k: v for k, v in inputs['counts'].items() if v}
  lines.append(f'  inputs: {json.dumps(counts)}')
  for kind in ('skipped', 'repaired'):
    for e in inputs[kind]:
      count = f' x{e["count"]}' if e.get('count', 1) != 1 else ''
      where = 'rows' if 'rows' in e else 'lines'
      at = (f' ({where} {", ".join(map(str, e[where]))}{"..." if e["count"] > 10 else ""})'
            if e.get(where) else '')
      lines.append(f'  {kind}: {e["input"]}: {e["reason"]}{count}{at}')
  lines.append(f'  full report: {os.path.join(data_dir, "report.json")}')
  return '\n'.join(lines)


def tokenizer_sample_summary(info: dict) -> list[str]:
  """What tokenizer training saw (sample_lines' counts): a line, then one per part left out.

  A sentence is one input of sentencepiece's trainer: a line, or a piece of a
  line too long for it.
  """
  pieces = info['sentences_seen'] - info['lines_seen'] + info['lines_split']
  split = (f'; {info["lines_split"]:,} lines over {line_sample.MAX_SENTENCE_BYTES} bytes cut into '
           f'{pieces:,} pieces' if info['lines_split'] else '')
  out = [f'sampled {info["sentences_sampled"]:,} of {info["sentences_seen"]:,} sentences '
         f'({_size(info["bytes_sampled"])} of {_size(info["bytes_seen"])}) from the '
         f'{info["lines_seen"]:,} lines of {info["documents"]:,} training documents{split}']
  if info['capped_sentences']:
    out.append(f'{info["capped_sentences"]:,} sentences ({_size(info["capped_bytes"])}) left out: '
               'the sample is capped at config.tokenizer.max_sentences')
  if info['reserved_sentences']:
    out.append(f'{info["reserved_sentences"]:,} sentences ({_size(info["reserved_bytes"])}) left '
               "out: they hold U+2047, which sentencepiece reserves and skips")
  return out


def _size(num_bytes: int) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:,.1f} {unit}'
  return f'{num_bytes} bytes'
