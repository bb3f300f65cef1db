"""The tfds datasets the tests build, as tfds builders.

Module level, so that prepare's worker processes unpickle them; in a module of their own, imported
by the tests that build them, so that collecting the tests does not import tensorflow_datasets.
"""

import numpy as np
import tensorflow_datasets as tfds


class ShortTexts(tfds.core.GeneratorBasedBuilder):
  """A real tfds text dataset (title + text features): test_sources' first 200 documents."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {'title': tfds.features.Text(), 'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    from tests.test_sources import DOCS  # pylint: disable=import-outside-toplevel
    for i, doc in enumerate(DOCS[:200]):
      yield i, {'title': f'doc {i}', 'text': doc}


class MarkerSentences(tfds.core.GeneratorBasedBuilder):
  """test_finetune's classify and tag rows as a tfds dataset, with glue/sst2's and conll2003's kinds
  of features."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='classify'), tfds.core.BuilderConfig(name='tag')]

  def _info(self):
    if self.builder_config.name == 'classify':
      features = {'sentence': tfds.features.Text(), 'idx': np.int32,
                  'label': tfds.features.ClassLabel(names=['no', 'yes'])}
    else:
      features = {'tokens': tfds.features.Sequence(tfds.features.Text()),
                  'ner': tfds.features.Sequence(tfds.features.ClassLabel(names=['O', 'B-ERR']))}
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

  def _split_generators(self, dl_manager):
    # 'test' is unlabelled, as GLUE's test splits are: its labels are -1.
    return {'train': self._generate_examples(0, 256), 'validation': self._generate_examples(1, 64),
            'test': self._generate_examples(1, 64, labelled=False)}

  def _generate_examples(self, seed=0, n=0, labelled=True):
    # pylint: disable-next=import-outside-toplevel
    from tests.test_finetune import _classify_rows, _tag_rows
    if self.builder_config.name == 'tag':
      for i, row in enumerate(_tag_rows(seed, n)):
        yield i, {'tokens': row['tokens'], 'ner': row['tags']}
      return
    for i, row in enumerate(_classify_rows(seed, n)):
      yield i, {'sentence': row['text'], 'idx': i, 'label': row['label'] if labelled else -1}
