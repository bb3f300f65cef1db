"""Fine-tuning end to end on tiny runs and published-layout checkpoints: it learns, keeps the
best evaluation, resumes, refuses bad input, predicts, exports."""

import json
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest

from mlm_jax.errors import ConfigError
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import config as config_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import loop
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import predict as predict_lib
from mlm_jax.finetuning import scores
from tests.conftest import Deferred

tfds = Deferred('tensorflow_datasets')

# Words the stdlib-docstring tokenizer knows; MARKER decides the label.
WORDS = ('the', 'file', 'returns', 'list', 'value', 'string', 'object', 'function', 'name',
         'type', 'data', 'module', 'class', 'default', 'path', 'number')
MARKER = 'error'


def _sentences(rng: np.random.Generator, n: int) -> tuple[list[list[str]], list[bool]]:
  """Random word sequences, half of them holding MARKER at a random place."""
  out, has = [], []
  for i in range(n):
    words = list(rng.choice(WORDS, rng.integers(4, 10)))
    if i % 2:
      words.insert(int(rng.integers(0, len(words) + 1)), MARKER)
    out.append(words)
    has.append(bool(i % 2))
  return out, has


def _write_jsonl(path, rows) -> str:
  with open(path, 'w') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  return str(path)


def _classify_rows(seed: int, n: int) -> list[dict]:
  sentences, has = _sentences(np.random.default_rng(seed), n)
  return [{'text': ' '.join(s), 'label': 'yes' if h else 'no'} for s, h in zip(sentences, has)]


def _tag_rows(seed: int, n: int) -> list[dict]:
  """Tag MARKER 'B-ERR' and every other word 'O'."""
  sentences, _ = _sentences(np.random.default_rng(seed), n)
  return [{'tokens': s, 'tags': ['B-ERR' if w == MARKER else 'O' for w in s]} for s in sentences]


def _pair_rows(seed: int, n: int) -> list[dict]:
  """Label 1 when the second text holds MARKER (MARKER in the first says nothing)."""
  rng = np.random.default_rng(seed)
  firsts, _ = _sentences(rng, n)
  seconds, has = _sentences(rng, n)
  order = rng.permutation(n)
  return [{'text': ' '.join(firsts[i]), 'text_pair': ' '.join(s), 'label': int(h)}
          for i, s, h in zip(order, seconds, has)]


@pytest.fixture(scope='module')
def pretrained(micro_run):
  """A micro BERT pretraining run (8 steps): its workdir (conftest's, shared)."""
  return micro_run


def _config(**train):
  config = config_lib.get_config()
  config.train.batch_size = 32
  config.eval.batch_size = 32
  config.train.log_every = 20
  config.train.min_steps = 0   # The epochs given decide: these files are tiny.
  for k, v in train.items():
    config.train[k] = v
  return config


@pytest.fixture(scope='module')
def classify_files(tmp_path_factory):
  d = tmp_path_factory.mktemp('classify')
  return (_write_jsonl(d / 'train.jsonl', _classify_rows(0, 256)),
          _write_jsonl(d / 'eval.jsonl', _classify_rows(1, 64)))


@pytest.fixture(scope='module')
def classified(pretrained, classify_files, tmp_path_factory):
  """The micro run fine-tuned to tell sentences with MARKER: (out dir, result)."""
  out = str(tmp_path_factory.mktemp('classified'))
  result = loop.finetune(pretrained, out, 'classify', *classify_files,
                         _config(num_epochs=12.0, eval_every=48))
  return out, result


@pytest.mark.slow
def test_classifier_learns_a_word_it_must_find(classified):
  out, result = classified
  assert result['step'] == 96    # 12 epochs of 256 rows in batches of 32.
  assert result['eval_accuracy'] >= 0.95, result
  assert result['eval_mcc'] >= 0.9, result
  with open(os.path.join(out, 'labels.json')) as f:
    assert json.load(f) == ['no', 'yes']
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  assert [r['step'] for r in records if 'eval_accuracy' in r] == [48, 96]
  assert os.listdir(os.path.join(out, 'tb'))


@pytest.mark.slow
def test_rerun_resumes_from_the_last_checkpoint_identically(pretrained, classified,
                                                            classify_files, tmp_path):
  out, result = classified
  copy = str(tmp_path / 'resumed')
  shutil.copytree(out, copy)
  shutil.rmtree(os.path.join(copy, 'checkpoints', '96'))   # As if stopped after step 48.
  again = loop.finetune(pretrained, copy, 'classify', *classify_files,
                        _config(num_epochs=12.0, eval_every=48))
  assert again['step'] == 96
  with open(os.path.join(copy, 'metrics.jsonl')) as f:
    steps = [json.loads(line)['step'] for line in f]
  assert steps[-3:] == [80, 96, 96]     # Train records after 48, then the final evaluation.
  ours, theirs = model_dir.load(out), model_dir.load(copy)
  for a, b in zip(jax.tree_util.tree_leaves(ours.params), jax.tree_util.tree_leaves(theirs.params)):
    np.testing.assert_array_equal(a, b)
  assert again['eval_accuracy'] == result['eval_accuracy']


@pytest.mark.slow
def test_predict_writes_a_label_and_probabilities_per_row(classified, tmp_path):
  out, result = classified
  rows = _classify_rows(1, 64)
  data = _write_jsonl(tmp_path / 'unlabelled.jsonl', [{'text': r['text']} for r in rows])
  written = str(tmp_path / 'predictions.jsonl')
  assert predict_lib.predict(out, data, written) == 64
  with open(written) as f:
    predictions = [json.loads(line) for line in f]
  assert [p['line'] for p in predictions] == list(range(1, 65))
  for p in predictions:
    assert set(p['probabilities']) == {'no', 'yes'}
    assert abs(sum(p['probabilities'].values()) - 1) < 1e-5
    assert p['label'] == max(p['probabilities'], key=p['probabilities'].get)
  accuracy = np.mean([p['label'] == r['label'] for p, r in zip(predictions, rows)])
  assert accuracy == pytest.approx(result['eval_accuracy'])


# ------------------------------------------------------------- other tasks


@pytest.fixture(scope='module')
def pretrained_modern(modern_micro_run):
  """A micro ModernBERT pretraining run (4 steps; a local window narrower than the rows)."""
  return modern_micro_run


@pytest.fixture(scope='module')
def tagged(pretrained_modern, tmp_path_factory):
  """The ModernBERT run fine-tuned to tag MARKER: (out dir, result, eval file)."""
  d = tmp_path_factory.mktemp('tagged')
  train = _write_jsonl(d / 'train.jsonl', _tag_rows(2, 256))
  evaluation = _write_jsonl(d / 'eval.jsonl', _tag_rows(3, 64))
  out = str(d / 'out')
  return out, loop.finetune(pretrained_modern, out, 'tag', train, evaluation,
                            _config(num_epochs=12.0)), evaluation


@pytest.mark.slow
def test_modern_tagger_finds_the_word_and_predicts_per_word_tags(tagged, tmp_path):
  out, result, evaluation = tagged
  assert result['eval_accuracy'] >= 0.98, result
  assert result['eval_f1'] >= 0.95, result   # Entity F1: the tags are BIO.
  written = str(tmp_path / 'tags.jsonl')
  predict_lib.predict(out, evaluation, written)
  with open(evaluation) as f, open(written) as g:
    pairs = [(json.loads(a), json.loads(b)) for a, b in zip(f, g)]
  assert len(pairs) == 64
  for gold, predicted in pairs:
    assert predicted['tokens'] == gold['tokens']
    assert len(predicted['tags']) == len(predicted['probabilities']) == len(gold['tokens'])
  correct = [p['tags'] == g['tags'] for g, p in pairs]
  assert np.mean(correct) >= 0.9


@pytest.mark.slow
def test_regression_follows_the_target(pretrained, tmp_path):
  def rows(seed, n):
    sentences, has = _sentences(np.random.default_rng(seed), n)
    return [{'text': ' '.join(s), 'label': 2.0 if h else -1.0} for s, h in zip(sentences, has)]
  train = _write_jsonl(tmp_path / 'train.jsonl', rows(4, 256))
  evaluation = _write_jsonl(tmp_path / 'eval.jsonl', rows(5, 64))
  result = loop.finetune(pretrained, str(tmp_path / 'out'), 'regress', train, evaluation,
                         _config(num_epochs=12.0, learning_rate=3e-3, eval_every=48))
  assert result['eval_pearson'] >= 0.9 and result['eval_spearman'] >= 0.8, result
  assert not os.path.exists(tmp_path / 'out' / 'labels.json')   # No labels: one output.


@pytest.mark.slow
def test_pair_classifier_reads_the_second_text(pretrained, tmp_path):
  train = _write_jsonl(tmp_path / 'train.jsonl', _pair_rows(6, 256))
  evaluation = _write_jsonl(tmp_path / 'eval.jsonl', _pair_rows(7, 64))
  out = str(tmp_path / 'out')
  result = loop.finetune(pretrained, out, 'pair', train, evaluation,
                         _config(num_epochs=12.0, learning_rate=3e-3, eval_every=96))
  assert result['eval_accuracy'] >= 0.9, result
  written = str(tmp_path / 'predictions.jsonl')
  predict_lib.predict(out, evaluation, written)
  with open(written) as f:
    assert {json.loads(line)['label'] for line in f} == {0, 1}   # Integer labels stay integers.


# ------------------------------------------------------------- tfds splits


CLASSIFY = 'tfds:marker_sentences/classify'


@pytest.fixture(scope='module')
def tfds_dirs(tmp_path_factory):
  """{'array_record': MarkerSentences's data dir, 'tfrecord': a copy that says tfrecord}."""
  from tests import tfds_datasets  # pylint: disable=import-outside-toplevel
  tfds.disable_progress_bar()
  root = tmp_path_factory.mktemp('tfds')
  for name in ('classify', 'tag'):
    tfds_datasets.MarkerSentences(config=name, data_dir=str(root / 'array_record')
                                  ).download_and_prepare(file_format='array_record')
  shutil.copytree(root / 'array_record', root / 'tfrecord')
  for path in (root / 'tfrecord').glob('marker_sentences/*/1.0.0/dataset_info.json'):
    info = json.loads(path.read_text())
    info['fileFormat'] = 'tfrecord'
    path.write_text(json.dumps(info))
  return {kind: str(root / kind) for kind in ('array_record', 'tfrecord')}


def test_a_tfds_split_reads_as_its_rows_with_class_names(tfds_dirs):
  read = data_lib.read_examples
  examples = read(f'{CLASSIFY}:train', 'classify', tfds_data_dir=tfds_dirs['array_record'])
  # 'sentence' is the split's only text feature; ClassLabel integers are read as their names.
  assert sorted((e.texts[0], e.label) for e in examples) == sorted(
      (r['text'], r['label']) for r in _classify_rows(0, 256))
  assert sorted(e.line for e in examples) == list(range(256))   # Lines are record indices.
  tags = read('tfds:marker_sentences/tag:validation', 'tag', fields=data_lib.Fields(tags='ner'),
              tfds_data_dir=tfds_dirs['array_record'])
  assert sorted((e.texts, e.label) for e in tags) == sorted(
      (tuple(r['tokens']), r['tags']) for r in _tag_rows(1, 64))
  assert 'tensorflow' not in sys.modules


@pytest.mark.slow
def test_finetune_and_predict_read_tfds_splits(pretrained, tfds_dirs, tmp_path):
  config = _config(num_epochs=12.0)
  config.data.tfds_data_dir = tfds_dirs['array_record']
  out = str(tmp_path / 'out')
  result = loop.finetune(pretrained, out, 'classify', f'{CLASSIFY}:train',
                         f'{CLASSIFY}:validation', config)
  assert result['eval_accuracy'] >= 0.95, result
  with open(os.path.join(out, 'labels.json')) as f:
    assert json.load(f) == ['no', 'yes']
  # The unlabelled test split: predict reads it with the fine-tuning's tfds data dir.
  written = str(tmp_path / 'predictions.jsonl')
  assert predict_lib.predict(out, f'{CLASSIFY}:test', written) == 64
  texts = {e.line: e.texts[0] for e in data_lib.read_examples(
      f'{CLASSIFY}:test', 'classify', labelled=False, tfds_data_dir=tfds_dirs['array_record'])}
  truth = {r['text']: r['label'] for r in _classify_rows(1, 64)}
  with open(written) as f:
    predictions = [json.loads(line) for line in f]
  assert sorted(p['record'] for p in predictions) == list(range(64))
  assert np.mean([p['label'] == truth[texts[p['record']]] for p in predictions]) >= 0.9


def test_fields_named_in_the_config_read_other_columns(tmp_path):
  path = tmp_path / 'train.csv'
  path.write_text('premise,hypothesis,gold\n'
                  'A cat sat.,A cat is sitting.,yes\nIt rains.,It is dry.,no\n')
  read = data_lib.read_examples
  pairs = read(str(path), 'pair', fields=data_lib.Fields(label='gold'))   # GLUE's names: found.
  assert [(e.line, e.texts, e.label) for e in pairs] == [
      (2, ('A cat sat.', 'A cat is sitting.'), 'yes'), (3, ('It rains.', 'It is dry.'), 'no')]
  single = read(str(path), 'classify', fields=data_lib.Fields(text='hypothesis', label='gold'))
  assert [e.texts for e in single] == [('A cat is sitting.',), ('It is dry.',)]
  with pytest.raises(ConfigError, match='set config.data.text_pair_field too'):
    read(str(path), 'pair', fields=data_lib.Fields(text='premise', label='gold'))
  with pytest.raises(data_lib.DataError, match="train.csv line 2: field 'label' is missing"):
    read(str(path), 'classify', fields=data_lib.Fields(text='premise'))


BAD_TFDS = {
    'unknown dataset': ('tfds:no_such_dataset:train', {},
                        r'tfds:no_such_dataset:train: no such dataset or split prepared in .*'
                        r'Prepare it with `tfds build no_such_dataset --file_format=array_record`'
                        r', or set config.data.tfds_data_dir to where it is'),
    'missing split': (f'{CLASSIFY}:tran', {}, r"marker_sentences/classify in .* has no split "
                      r"'tran' .*; its splits are \['test', 'train', 'validation'\]"),
    'no split named': (CLASSIFY, {}, re.escape(
        f"'{CLASSIFY}' names no split; write tfds:NAME:SPLIT, e.g. {CLASSIFY}:train.")),
    'missing field': (f'{CLASSIFY}:train', {'label_field': 'rating'}, re.escape(
        f"{CLASSIFY}:train has no feature 'rating' (config.data.label_field); its features are "
        "['idx', 'label', 'sentence'].")),
    'no text feature': ('tfds:marker_sentences/tag:train', {}, re.escape(
        "has no feature 'text' and 0 text features []: name the one to read with "
        'config.data.text_field')),
    'unlabelled split': (f'{CLASSIFY}:test', {}, f"{CLASSIFY}:test record \\d+: field 'label' is "
                         r"-1, which is none of the dataset's 2 classes .*: train and evaluate "
                         'on a labelled split'),
    'tfrecord': (f'{CLASSIFY}:train', {'tfds_data_dir': 'tfrecord'},
                 'in a format that needs TensorFlow to read \\(tfrecord\\).* Prepare it again '
                 'with `tfds build marker_sentences/classify --file_format=array_record`'),
}


@pytest.mark.slow
@pytest.mark.parametrize('case', list(BAD_TFDS))
def test_bad_tfds_input_names_split_and_fix_before_anything_is_built(case, pretrained, tfds_dirs,
                                                                      tmp_path):
  spec, data, message = BAD_TFDS[case]
  config = _config()
  config.data.tfds_data_dir = tfds_dirs[data.get('tfds_data_dir', 'array_record')]
  config.data.update({k: v for k, v in data.items() if k != 'tfds_data_dir'})
  out = tmp_path / 'out'
  with pytest.raises(data_lib.DataError, match=message):
    loop.finetune(pretrained, str(out), 'classify', spec, f'{CLASSIFY}:validation', config)
  assert not out.exists()


# ----------------------------------------------------------------- encoding


@pytest.mark.slow
def test_pair_rows_are_cls_a_sep_b_sep_with_segments_and_longest_first_truncation(pretrained):
  from mlm_jax.training import workdir as workdir_lib
  tokenizer = workdir_lib.load(pretrained).tokenizer
  a, b = 'the file returns a list', 'name of the module'
  ids_a, ids_b = tokenizer.encode([a, b])
  examples = [data_lib.Example(1, (a, b), 'x'), data_lib.Example(2, (a * 9, b), 'x')]
  encoded = data_lib.encode(examples, 'pair', tokenizer, 24, ['x'])
  row = [2, *ids_a, 3, *ids_b, 3]
  np.testing.assert_array_equal(encoded.input_ids[0, :len(row)], row)
  assert not encoded.input_ids[0, len(row):].any() and encoded.attention_mask[0].sum() == len(row)
  np.testing.assert_array_equal(encoded.segment_ids[0, :len(row)],
                                [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1))
  # The long first text is cut, the short second kept whole; one row counted.
  assert encoded.truncated == 1 and encoded.attention_mask[1].sum() == 24
  assert encoded.segment_ids[1].sum() == len(ids_b) + 1
  assert data_lib._pair_lengths(30, 30, 21) == (11, 10)


@pytest.mark.slow
def test_tag_rows_label_first_pieces_and_mark_cut_words(pretrained):
  from mlm_jax.training import workdir as workdir_lib
  tokenizer = workdir_lib.load(pretrained).tokenizer
  words = ('unbelievably', 'the', 'file')
  pieces = tokenizer.encode(list(words))
  assert len(pieces[0]) > 1   # A word of several pieces: only its first is labelled.
  examples = [data_lib.Example(1, words, ['B-X', 'O', 'B-X'])]
  encoded = data_lib.encode(examples, 'tag', tokenizer, 16, ['B-X', 'O'])
  starts = [1, 1 + len(pieces[0]), 2 + len(pieces[0])]
  np.testing.assert_array_equal(encoded.word_starts[0], starts)
  np.testing.assert_array_equal(np.flatnonzero(encoded.weights[0]), starts)
  np.testing.assert_array_equal(encoded.targets[0, starts], [0, 1, 0])
  cut = data_lib.encode(examples, 'tag', tokenizer, len(pieces[0]) + 3, ['B-X', 'O'])
  assert cut.truncated == 1 and list(cut.word_starts[0]) == starts[:2] + [-1]


def test_entity_f1_counts_whole_spans():
  gold = [['B-P', 'I-P', 'O', 'B-L']]
  assert scores.tagging(gold, gold, ['B-L', 'B-P', 'I-P', 'O'])['f1'] == 1.0
  half = scores.tagging([['B-P', 'O', 'O', 'B-L']], gold, ['B-L', 'B-P', 'I-P', 'O'])
  assert half['f1'] == 0.5 and half['accuracy'] == 0.75   # A cut span is a miss.


@pytest.mark.slow
def test_encoder_comes_from_the_run_and_the_pooler_from_its_sentence_pair_head(pretrained):
  from mlm_jax.finetuning import step as step_lib
  from mlm_jax.runtime import sharding
  from mlm_jax.training import workdir as workdir_lib
  run = workdir_lib.load(pretrained)
  d = run.model_cfg.hidden_size
  pooler = {'kernel': np.full((d, d), 0.5, np.float32), 'bias': np.ones(d, np.float32)}
  mesh = sharding.make_mesh(1, jax.devices()[:1])
  plan = config_lib.plan(_config().train, 64, d)
  built = step_lib.build(run.model_cfg, 'pair', 3, 0.0, plan.train_section(_config().train), 16,
                         0, mesh)
  state = step_lib.with_pretrained(built.init_state(), {**run.params,
                                                        'sentence_pair': {'pooler': pooler}}, 'run')
  for a, b in zip(jax.tree_util.tree_leaves(state.params['encoder']),
                  jax.tree_util.tree_leaves(run.params['encoder'])):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(state.params['head']['pooler']['kernel'], pooler['kernel'])
  assert state.params['head']['classifier']['kernel'].shape == (d, 3)


# ---------------------------------------------------------------- bad input


BAD_INPUT = {
    'missing label': ('classify', 'train.jsonl',
                      ['{"text": "a", "label": "x"}', '{"text": "b", "label": "y"}',
                       '{"text": "c"}'],
                      "train.jsonl line 3: field 'label' is missing"),
    'empty label': ('classify', 'train.csv', ['text,label', 'a,x', 'b,', 'c,y'],
                    "train.csv line 3: field 'label' is empty"),
    'empty file': ('classify', 'train.tsv', ['text\tlabel'], 'train.tsv holds no examples'),
    'pair side missing': ('pair', 'train.jsonl',
                          ['{"text_a": "a", "text_b": "b", "label": 1}',
                           '{"text_a": "a", "label": 0}'],
                          "train.jsonl line 2: field 'text_b' is missing"),
    'tag lengths differ': ('tag', 'train.jsonl',
                           ['{"tokens": ["a", "b", "c"], "tags": ["O", "O"]}'],
                           "train.jsonl line 1: field 'tags' must be a list of 3 tags"),
    'regress label not a number': ('regress', 'train.csv', ['text,label', 'a,0.5', 'b,high'],
                                   "train.csv line 3: field 'label' must be a finite number"),
    'empty tag': ('tag', 'train.jsonl', ['{"tokens": ["a", "b"], "tags": ["O", " "]}'],
                  "train.jsonl line 1: field 'tags[1]' is empty"),
    'csv row with extra cells': ('classify', 'train.csv', ['text,label', 'a,x', 'b,y,z'],
                                 'train.csv line 3: 3 cells, but the header names 2 columns'),
    'not json': ('classify', 'train.jsonl', ['{"text": "a", "label": "x"}', '{"text": '],
                 'train.jsonl line 2: not valid JSON'),
}


@pytest.mark.slow
@pytest.mark.parametrize('case', list(BAD_INPUT))
def test_bad_input_names_file_line_and_field_before_anything_is_built(case, pretrained, tmp_path):
  task, name, lines, message = BAD_INPUT[case]
  train = tmp_path / name
  train.write_text(''.join(line + '\n' for line in lines))
  good = _write_jsonl(tmp_path / 'eval.jsonl', [{'text': 'a', 'label': 'x'}])
  out = tmp_path / 'out'
  with pytest.raises(data_lib.DataError, match=re.escape(message)):
    loop.finetune(pretrained, str(out), task, str(train), good, _config())
  assert not out.exists()


@pytest.mark.slow
def test_eval_label_unseen_in_training_is_refused(pretrained, tmp_path):
  train = _write_jsonl(tmp_path / 'train.jsonl', [{'text': 'a', 'label': 'x'},
                                                   {'text': 'b', 'label': 'y'}])
  evaluation = _write_jsonl(tmp_path / 'eval.jsonl', [{'text': 'a', 'label': 'x'},
                                                      {'text': 'b', 'label': 'maybe'}])
  with pytest.raises(data_lib.DataError, match="eval.jsonl line 2: field 'label' is 'maybe', "
                     r"which the training file does not have \(it has \['x', 'y'\]\)"):
    loop.finetune(pretrained, str(tmp_path / 'out'), 'classify', train, evaluation, _config())


@pytest.mark.slow
def test_command_prints_one_error_line_and_exits_2(pretrained, tmp_path):
  import subprocess
  train = _write_jsonl(tmp_path / 'train.jsonl', [{'text': 'a', 'label': 'x'}, {'text': 'b'}])
  result = subprocess.run(
      [sys.executable, '-m', 'mlm_jax.finetune', f'--workdir={pretrained}',
       f'--out={tmp_path / "out"}', '--task=classify', f'--train_data={train}',
       f'--eval_data={train}'], check=False, capture_output=True, text=True, timeout=120,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: {train} line 2: field 'label' is missing.")


# ------------------------------------------------------------------- export


def _export_matches_ours(out, evaluation, tmp_path, auto_class: str):
  """Exports `out`, loads it with transformers: max |ours - theirs| over the eval file's logits."""
  transformers = pytest.importorskip('transformers')
  torch = pytest.importorskip('torch')
  from mlm_jax.finetuning import task_eval
  from mlm_jax.finetuning import classifier_export as export_lib
  hf_dir = str(tmp_path / 'hf')
  model = export_lib.export(out, hf_dir)
  theirs, info = getattr(transformers, auto_class).from_pretrained(
      hf_dir, output_loading_info=True, attn_implementation='eager')
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys']), info
  examples = data_lib.read_examples(evaluation, model.task, labelled=False)
  encoded = data_lib.encode(examples, model.task, model.tokenizer, model.seq_len,
                            row_format=model.row_format)
  ours = task_eval.all_logits(predict_lib._logits_fn(model), encoded, 32)
  inputs = {'input_ids': encoded.input_ids, 'attention_mask': encoded.attention_mask}
  if model.model_cfg.variant != 'modern':
    inputs['token_type_ids'] = encoded.segment_ids
  with torch.no_grad():
    logits = theirs.eval()(**{k: torch.tensor(v, dtype=torch.long) for k, v in inputs.items()})
  logits = logits.logits.numpy()
  if model.task == 'tag':   # Padding positions are nobody's prediction.
    real = encoded.attention_mask.astype(bool)
    ours, logits = ours[real], logits[real]
  assert theirs.config.id2label == dict(enumerate(str(x) for x in model.labels))
  return float(np.abs(ours - logits).max())


@pytest.mark.slow
def test_bert_classifier_exports_as_bert_for_sequence_classification(classified, classify_files,
                                                                     tmp_path):
  out, _ = classified
  diff = _export_matches_ours(out, classify_files[1], tmp_path,
                              'AutoModelForSequenceClassification')
  assert diff <= 1e-5, diff


@pytest.mark.slow
def test_modern_tagger_exports_as_modernbert_for_token_classification(tagged, tmp_path):
  out, _, evaluation = tagged
  diff = _export_matches_ours(out, evaluation, tmp_path, 'AutoModelForTokenClassification')
  assert diff <= 1e-5, diff


@pytest.mark.slow
def test_export_command_writes_the_library_export_of_a_fine_tuned_model(classified, pretrained,
                                                                        tmp_path):
  import subprocess
  pytest.importorskip('transformers')
  from mlm_jax.finetuning import classifier_export as export_lib
  out, _ = classified
  command = [sys.executable, '-m', 'mlm_jax.export', f'--out={tmp_path / "cmd"}']
  result = subprocess.run(command + [f'--model={out}'], capture_output=True, text=True,
                          check=True)
  assert 'as BertForSequenceClassification to' in result.stdout, result.stdout
  export_lib.export(out, str(tmp_path / 'lib'))
  for name in ('config.json', 'model.safetensors', 'tokenizer.json'):
    assert (tmp_path / 'cmd' / name).read_bytes() == (tmp_path / 'lib' / name).read_bytes(), name
  both = subprocess.run(command + [f'--model={out}', f'--workdir={pretrained}'],
                        capture_output=True, text=True)
  assert both.returncode != 0
  assert 'name exactly one of --workdir (a pretraining run) and --model' in both.stderr


# ------------------------------------------------------- length and selection


def test_default_length_is_the_epochs_but_at_least_min_steps():
  train = config_lib.get_config().train   # 3 epochs, at least 400 steps, batch 32.
  small = config_lib.plan(train, 1000, 768)   # 32 steps per epoch: 96 < 400.
  assert (small.steps_per_epoch, small.num_steps) == (32, 400)
  assert small.eval_every == 32 and small.checkpoint_every == 32   # Once per epoch: 13 times.
  assert small.warmup_steps == 40
  large = config_lib.plan(train, 67_349, 768)   # SST-2's size: 2,105 steps per epoch.
  assert large.num_steps == 6315
  assert large.eval_every == 1263   # An epoch is a third of the run: 5 evaluations.
  tiny = config_lib.plan(train, 40, 768)   # 2 steps per epoch: 200 epochs of 400 steps.
  assert tiny.num_steps == 400 and tiny.eval_every == 20   # At most 20 evaluations.
  named = train.copy_and_resolve_references()
  named.num_steps = 50
  assert config_lib.plan(named, 1000, 768).num_steps == 50   # Named steps win.
  named.num_steps, named.min_steps = 0, 0
  assert config_lib.plan(named, 1000, 768).num_steps == 96   # Epochs alone.
  assert config_lib.default_num_steps(2.5, 10, 0) == 25


def test_best_metric_is_the_task_main_score_unless_named():
  assert config_lib.selection('classify', '', 2) == config_lib.Selection('accuracy', True)
  assert config_lib.selection('regress', '', None) == config_lib.Selection('pearson', True)
  assert config_lib.selection('tag', '', 3) == config_lib.Selection('f1', True)
  lowest = config_lib.selection('pair', 'loss', 2)
  assert lowest.better({'loss': 0.3}, {'loss': 0.4}) and lowest.better({'loss': 9.0}, None)
  assert not lowest.better({'loss': 0.4}, {'loss': 0.4})   # A tie keeps the earlier.
  highest = config_lib.selection('classify', '', 2)
  assert highest.better({'accuracy': 0.9, 'loss': 0.5}, {'accuracy': 0.8, 'loss': 0.1})
  # Equal accuracy: the lower loss wins, and a full tie keeps the earlier.
  assert highest.better({'accuracy': 1.0, 'loss': 0.1}, {'accuracy': 1.0, 'loss': 0.2})
  assert not highest.better({'accuracy': 1.0, 'loss': 0.2}, {'accuracy': 1.0, 'loss': 0.2})
  with pytest.raises(ConfigError, match="task 'regress' reports pearson, spearman, mse, loss"):
    config_lib.selection('regress', 'accuracy', None)
  with pytest.raises(ConfigError, match='needs two labels; the training file has 3'):
    config_lib.selection('classify', 'mcc', 3)
  config = _config()
  config.train.best_metric = 'acc'
  with pytest.raises(ConfigError, match="config.train.best_metric='acc' is none of the scores"):
    config_lib.check_config(config, 1)


def _evaluations(out: str, metric: str) -> dict[int, tuple[float, float]]:
  """{step: (score, loss)} of every evaluation metrics.jsonl logged."""
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: (r[f'eval_{metric}'], r['eval_loss']) for r in records
          if f'eval_{metric}' in r}


def _check_best_kept(out: str, result: dict, metric: str) -> None:
  """The reported best is the max over the logged evaluations (ties: the lowest loss, then the
  first step), and OUT/best holds exactly that step, which model_dir.load gives."""
  logged = _evaluations(out, metric)
  best = max(score for score, _ in logged.values())
  assert result['best_metric'] == metric
  assert result[f'eval_{metric}'] == best
  lowest = min(loss for score, loss in logged.values() if score == best)
  assert result['eval_loss'] == lowest
  assert result['best_step'] == min(step for step, (score, loss) in logged.items()
                                    if (score, loss) == (best, lowest))
  assert model_dir.saved_steps(model_dir.best_dir(out)) == [result['best_step']]
  model = model_dir.load(out)
  assert model.step == result['best_step'] and model.best['value'] == best


@pytest.mark.slow
def test_the_best_evaluation_is_kept_and_loaded(classified):
  out, result = classified
  _check_best_kept(out, result, 'accuracy')


def test_a_model_to_start_from_is_named_exactly_once(tmp_path):
  from mlm_jax.finetuning import pretrained as pretrained_lib
  for workdir, hf_dir in ((None, None), ('a', 'b')):
    with pytest.raises(ConfigError, match='name exactly one model to fine-tune'):
      pretrained_lib.load(workdir, hf_dir)
  with pytest.raises(ConfigError, match='no such directory'):
    pretrained_lib.load(hf_dir=str(tmp_path / 'missing'))


# ------------------------------------------------ from published checkpoints


# Each published layout with the task that exercises most of its row format.
PUBLISHED_TASKS = {'bert': 'classify', 'roberta': 'pair', 'modern': 'tag'}
PUBLISHED_ROWS = {'classify': _classify_rows, 'pair': _pair_rows, 'tag': _tag_rows}
PUBLISHED_METRIC = {'classify': 'accuracy', 'pair': 'accuracy', 'tag': 'f1'}


@pytest.fixture(scope='module', params=sorted(PUBLISHED_TASKS))
def published_finetuned(request, tmp_path_factory):
  """(variant, hf dir, out dir, result, eval file): a published-layout masked LM (random
  weights) fine-tuned from --hf_dir on its layout's task, evaluating every 16 steps."""
  pytest.importorskip('transformers')
  pytest.importorskip('torch')
  from tests import published
  variant = request.param
  task = PUBLISHED_TASKS[variant]
  d = tmp_path_factory.mktemp(f'published_{variant}')
  texts = [' '.join(s) for s in _sentences(np.random.default_rng(9), 400)[0]]
  hf_dir = published.MAKERS[variant](str(d / 'hf'), texts)
  rows = PUBLISHED_ROWS[task]
  train = _write_jsonl(d / 'train.jsonl', rows(10, 256))
  evaluation = _write_jsonl(d / 'eval.jsonl', rows(11, 64))
  out = str(d / 'out')
  result = loop.finetune(None, out, task, train, evaluation,
                         _config(num_epochs=12.0, eval_every=16, learning_rate=3e-3),
                         hf_dir=hf_dir)
  return variant, hf_dir, out, result, evaluation


@pytest.mark.slow
def test_hf_dir_fine_tunes_keeps_the_best_and_exports(published_finetuned, tmp_path):
  variant, hf_dir, out, result, evaluation = published_finetuned
  task = PUBLISHED_TASKS[variant]
  metric = PUBLISHED_METRIC[task]
  assert result['step'] == 96
  assert result[f'eval_{metric}'] >= 0.9, result
  _check_best_kept(out, result, metric)
  with open(os.path.join(out, 'model.json')) as f:
    record = json.load(f)
  assert record['pretrained'] == {'hf_dir': hf_dir} and record['model']['variant'] == variant
  model = model_dir.load(out)
  assert model.tokenizer.digest() == tok_lib.load(hf_dir).digest()   # The checkpoint's own.
  auto = 'AutoModelForTokenClassification' if task == 'tag' else \
      'AutoModelForSequenceClassification'
  diff = _export_matches_ours(out, evaluation, tmp_path, auto)
  assert diff <= 1e-4, diff


@pytest.mark.slow
def test_hf_dir_rows_are_what_its_own_tokenizer_gives(published_finetuned):
  """[CLS] a [SEP] (b [SEP]) in the checkpoint's ids: BERT's segments, RoBERTa's
  <s> a </s></s> b </s> with one segment."""
  transformers = pytest.importorskip('transformers')
  variant, hf_dir, out, _, evaluation = published_finetuned
  model = model_dir.load(out)
  if model.task == 'tag':
    pytest.skip('tag rows encode each word on its own; compared through the export instead')
  examples = data_lib.read_examples(evaluation, model.task, labelled=False)[:16]
  ours = data_lib.encode(examples, model.task, model.tokenizer, model.seq_len,
                         row_format=model.row_format)
  columns = [list(texts) for texts in zip(*[e.texts for e in examples])]   # a (and b) texts.
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)(
      *columns, padding='max_length', max_length=model.seq_len, return_token_type_ids=True)
  np.testing.assert_array_equal(ours.input_ids, theirs['input_ids'])
  np.testing.assert_array_equal(ours.attention_mask, theirs['attention_mask'])
  np.testing.assert_array_equal(ours.segment_ids, theirs['token_type_ids'])
  assert model.seq_len % 8 == 0 and model.seq_len >= ours.longest() > model.seq_len - 8
