"""Built-in probing tasks, made offline from the Python standard library's docstrings.

Three of SentEval's probing tasks (Conneau et al., 2018, "What you can cram
into a single vector") and one document task, so that any run can be probed
with no download:

  sentence_length    which of 6 length bins a sentence falls in (bins of
                     equal size by the run's tokenizer pieces)
  word_content       which of 20 mid-frequency words a sentence holds (each
                     sentence holds exactly one of them)
  bigram_shift       whether two adjacent words of a sentence were swapped
  docstring_package  which of the 8 standard-library packages with the most
                     docstrings a docstring comes from

Sentences are the docstrings' sentences of 5 to 40 words. Every task has the
same number of examples per class (chance = 1 / classes), drawn with `seed`.
The docstrings are the default corpus's text, so a run on it has seen these
texts (as BERT had seen SentEval's books): what a probe measures is what
the representations make available about properties that were never a
training target.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import sysconfig

import numpy as np

from mlm_jax.data import corpus

TASKS = ('sentence_length', 'word_content', 'bigram_shift', 'docstring_package')
# Examples per task, at most: TASK_EXAMPLES // classes of each class (fewer
# when the text has fewer).
TASK_EXAMPLES = 2400
_MIN_PER_CLASS = 50
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=[A-Z])')
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


@dataclasses.dataclass(frozen=True)
class Task:
  """Texts and their integer labels; label_names[i] names label i."""
  name: str
  texts: list[str]
  labels: np.ndarray
  label_names: list[str]

  @property
  def num_classes(self) -> int:
    return len(self.label_names)


class TaskError(ValueError):
  """A task that cannot be made or read (the message names the fix)."""


@functools.cache
def _docstrings_by_package() -> list[tuple[str, str]]:
  """(package, docstring) of every docstring; the package is the top directory, '' for a module."""
  root = sysconfig.get_paths()['stdlib']
  out = []
  for path in corpus.stdlib_files():
    rel = os.path.relpath(path, root).split(os.sep)
    package = rel[0] if len(rel) > 1 else ''
    out.extend((package, ' '.join(doc.split())) for doc in corpus.docstrings_of(path))
  return out


@functools.cache
def _sentences() -> list[str]:
  """The docstrings' sentences of 5 to 40 words, each once, in corpus order."""
  seen, out = set(), []
  for _, doc in _docstrings_by_package():
    for sentence in _SENTENCE_END.split(doc):
      if 5 <= len(sentence.split()) <= 40 and sentence not in seen:
        seen.add(sentence)
        out.append(sentence)
  return out


def _balanced(labels: np.ndarray, num_classes: int, rng: np.random.Generator,
              per_class: int) -> np.ndarray:
  """Indices of an equal number (<= per_class) of examples of every class, shuffled."""
  counts = np.bincount(labels, minlength=num_classes)
  n = min(per_class, int(counts.min()))
  if n < min(per_class, _MIN_PER_CLASS):
    raise TaskError(f'only {n} examples of some class (at least {_MIN_PER_CLASS} needed)')
  picked = np.concatenate([rng.choice(np.flatnonzero(labels == c), n, replace=False)
                           for c in range(num_classes)])
  return rng.permutation(picked)


def _task(name: str, texts: list[str], labels: list[int] | np.ndarray, label_names: list[str],
          rng: np.random.Generator, examples: int) -> Task:
  labels = np.asarray(labels, np.int32)
  keep = _balanced(labels, len(label_names), rng, examples // len(label_names))
  return Task(name, [texts[i] for i in keep], labels[keep], label_names)


def sentence_length(rng: np.random.Generator, count_pieces, max_pieces: int,
                    examples: int = TASK_EXAMPLES) -> Task:
  """6 equal-frequency bins of the sentences' lengths in tokenizer pieces (<= max_pieces)."""
  lengths = np.array([len(ids) for ids in count_pieces(_sentences())])
  sentences = [s for s, n in zip(_sentences(), lengths) if n <= max_pieces]
  lengths = lengths[lengths <= max_pieces]
  edges = np.unique(np.quantile(lengths, np.linspace(0, 1, 7)[1:-1]).round())
  labels = np.searchsorted(edges, lengths, side='right')
  bounds = [int(lengths.min()), *edges.astype(int).tolist(), int(lengths.max()) + 1]
  names = [f'{lo}-{hi - 1} pieces' for lo, hi in zip(bounds, bounds[1:])]
  return _task('sentence_length', sentences, labels, names, rng, examples)


def word_content(rng: np.random.Generator, examples: int = TASK_EXAMPLES,
                 num_words: int = 20) -> Task:
  """The one of `num_words` words a sentence holds: words ranked by how many sentences hold
  them, the first `num_words` of at least 5 letters after the 100 most common."""
  sentences = _sentences()
  words = [{w.lower() for w in _WORD.findall(s)} for s in sentences]
  df = collections.Counter(w for ws in words for w in ws)
  targets = [w for w, _ in df.most_common()[100:] if len(w) >= 5][:num_words]
  index = {w: i for i, w in enumerate(targets)}
  texts, labels = [], []
  for sentence, ws in zip(sentences, words):
    held = ws & index.keys()
    if len(held) == 1:
      texts.append(sentence)
      labels.append(index[held.pop()])
  return _task('word_content', texts, labels, targets, rng, examples)


def bigram_shift(rng: np.random.Generator, examples: int = TASK_EXAMPLES) -> Task:
  """Half of the sentences with two adjacent words (not the first two) swapped."""
  texts, labels = [], []
  for sentence in _sentences():
    words = sentence.split()
    if rng.random() < 0.5:
      i = int(rng.integers(1, len(words) - 1))
      if words[i] == words[i + 1]:
        continue  # A swap that changes nothing.
      words[i], words[i + 1] = words[i + 1], words[i]
      texts.append(' '.join(words))
      labels.append(1)
    else:
      texts.append(sentence)
      labels.append(0)
  return _task('bigram_shift', texts, labels, ['original', 'swapped'], rng, examples)


def docstring_package(rng: np.random.Generator, examples: int = TASK_EXAMPLES,
                      num_packages: int = 8) -> Task:
  """The package of a docstring (its first 60 words), among the packages with the most."""
  docs = [(p, d) for p, d in _docstrings_by_package() if p and len(d.split()) >= 5]
  packages = [p for p, _ in collections.Counter(p for p, _ in docs).most_common(num_packages)]
  index = {p: i for i, p in enumerate(packages)}
  docs = [(p, d) for p, d in docs if p in index]
  return _task('docstring_package', [' '.join(d.split()[:60]) for _, d in docs],
               [index[p] for p, _ in docs], packages, rng, examples)


def make(name: str, seed: int, count_pieces, max_pieces: int,
         examples: int | None = None) -> Task:
  """Built-in task `name` (one of TASKS) with the examples of `seed`.

  count_pieces: texts -> their token ids (the run's tokenizer), for the
  length bins of sentences of at most max_pieces (what fits a row).
  examples: at most this many (default TASK_EXAMPLES).
  """
  rng = np.random.default_rng(seed)
  examples = examples or TASK_EXAMPLES
  if name == 'sentence_length':
    return sentence_length(rng, count_pieces, max_pieces, examples)
  makers = {'word_content': word_content, 'bigram_shift': bigram_shift,
            'docstring_package': docstring_package}
  if name not in makers:
    raise TaskError(f'unknown task {name!r}; built-in tasks: {", ".join(TASKS)}')
  return makers[name](rng, examples)
