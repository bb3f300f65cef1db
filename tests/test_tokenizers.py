"""The tokenizer kinds through prepare: trained WordPiece and byte-level BPE, given and grown
tokenizers, whole-word masking by each kind's word marks, the data dir's key, unknown tokens."""

import json
import logging
import os
import shutil

import ml_collections
import numpy as np
import pytest

from configs import tiny
from mlm_jax.config import fields
from mlm_jax.errors import ConfigError
from mlm_jax.data import hf_tokenizer
from mlm_jax.data import masking
from mlm_jax.data import prepare
from mlm_jax.data import prepared as prepared_lib
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.training import checkpoint
from mlm_jax.training import workdir as workdir_lib
from tests.conftest import write_corpus
from tests.test_tables import bucket  # noqa: F401  (the fixture: gs:// served from tmp_path)

KINDS = ('sentencepiece', 'wordpiece', 'bpe')
# A made-up word, frequent in its own documents, and a rare word (added as a token below).
WORD, RARE = 'zorbleflux', 'hummingbird'


def _config(corpus_glob: str, data_dir, kind: str = 'sentencepiece'):
  """configs/tiny.py on a small corpus: short rows, a small vocabulary, one worker."""
  config = tiny.get_config()
  config.data.corpus = corpus_glob
  config.data.data_dir = str(data_dir)
  config.data.seq_len = 32
  config.data.val_fraction = 0.1
  config.data.num_workers = 1
  config.tokenizer.kind = kind
  config.tokenizer.vocab_size = 400
  config.masking.max_predictions = 6
  return config


@pytest.fixture(scope='module')
def small_corpus(tmp_path_factory) -> str:
  root = tmp_path_factory.mktemp('corpus')
  glob = write_corpus(root, num_files=2, docs_per_file=100)
  (root / 'made_up.txt').write_text('\n\n'.join(
      f'The {WORD} number {i} glows; a {WORD} hums at night.'
      + (f' A {RARE} sings.' if i % 10 == 0 else '') for i in range(30)) + '\n')
  return glob


@pytest.fixture(scope='module')
def by_kind(small_corpus, tmp_path_factory):
  """kind -> (config, PreparedData), each trained on the small corpus."""
  out = {}
  for kind in KINDS:
    config = _config(small_corpus, tmp_path_factory.mktemp('data') / kind, kind)
    out[kind] = config, prepare.prepare(*fields.data_request(config))
  return out


def _rows(data, split='train', n=None) -> np.ndarray:
  source = data.source(split)
  return source.read(np.arange(len(source) if n is None else min(n, len(source))))


@pytest.mark.parametrize('kind', ['wordpiece', 'bpe'])
def test_trained_kinds_pack_rows_with_their_own_ids(by_kind, kind):
  config, data = by_kind[kind]
  t = data.tokenizer
  assert isinstance(t, hf_tokenizer.HFTokenizer) and t.kind == kind
  assert t.vocab_size <= config.tokenizer.vocab_size
  # An HF tokenizer lives in DATA_DIR/tokenizer/ and loads back the same.
  assert os.path.isfile(os.path.join(data.data_dir, 'tokenizer', 'tokenizer.json'))
  assert not os.path.exists(os.path.join(data.data_dir, 'tokenizer.model'))
  assert not os.path.exists(os.path.join(data.data_dir, 'tokenizer_sample.json'))
  assert prepared_lib.load(data.data_dir).tokenizer.digest() == t.digest()
  s = t.specials
  for split in ('train', 'validation'):
    rows = _rows(data, split)
    assert np.all(rows[:, 0] == s.cls)
    is_pad = rows == s.pad
    last_real = rows.shape[1] - 1 - np.argmax(~is_pad[:, ::-1], axis=1)
    assert np.all(rows[np.arange(len(rows)), last_real] == s.sep)
    assert is_pad.any(axis=1).sum() <= 1
    content = (~np.isin(rows, (s.pad, s.cls))).sum() - len(rows)
    stats = data.stats[split]
    stream = stats['tokens'] + stats['documents']  # Each document and its [SEP]...
    assert content == stream - bool(stream % (rows.shape[1] - 2))  # ...but a padded last one.
  assert data.unigram_counts.sum() == data.stats['train']['tokens']
  assert data.stats['train']['unknown_rate'] == data.unknown_rate() == 0.0
  # The rows hold the corpus's text.
  text = ' '.join(t.decode(row[1:-1]) for row in _rows(data, n=200))
  assert 'the' in text.split() and WORD in text
  assert data.report['tokenizer']['trained'] is True
  assert data.most_frequent_token() not in t.special_ids()


def test_lowercase_makes_an_uncased_wordpiece_tokenizer(small_corpus, tmp_path):
  config = _config(small_corpus, tmp_path / 'data', 'wordpiece')
  config.tokenizer.lowercase = True
  data = prepare.prepare(*fields.data_request(config))
  special = data.tokenizer.special_ids()
  text = ' '.join(data.tokenizer.decode(row[~np.isin(row, special)]) for row in _rows(data))
  assert text == text.lower() and 'the' in text.split()


# How each kind marks the pieces of a word, as its pieces read: a piece that
# continues the word before it.
CONTINUES = {
    'sentencepiece': lambda piece: not piece.startswith('\u2581'),
    'wordpiece': lambda piece: piece.startswith('##'),
    'bpe': lambda piece: not piece.startswith('\u0120'),
}


def _words(row: np.ndarray, tokenizer: tok_lib.Tokenizer, kind: str) -> list[list[int]]:
  """Positions of each word of a row, by the kind's marks on its pieces (a word never runs
  over [CLS], [SEP] or [PAD])."""
  never = set(tokenizer.specials.never_masked)
  words: list[list[int]] = []
  for pos, i in enumerate(row):
    if i in never:
      continue
    if words and words[-1][-1] == pos - 1 and CONTINUES[kind](tokenizer.id_to_piece(i)):
      words[-1].append(pos)
    else:
      words.append([pos])
  return words


def _selected(batch) -> np.ndarray:
  sel = np.zeros(batch['input_ids'].shape, bool)
  r, s = np.nonzero(batch['masked_weights'])
  sel[r, batch['masked_positions'][r, s]] = True
  return sel


@pytest.mark.parametrize('kind', KINDS)
def test_whole_word_masking_masks_whole_words_of_each_kind(by_kind, kind):
  config, data = by_kind[kind]
  t = data.tokenizer
  rows = _rows(data, n=400)
  masking_config = ml_collections.ConfigDict(config.masking.to_dict())
  masking_config.mode = 'whole_word'
  batch = masking.make_masker(masking_config, t, data.unigram_counts)(
      rows, seed=1, step=0, rows=np.arange(len(rows)))
  sel = _selected(batch)
  multi_piece = 0
  for r, row in enumerate(rows):
    for word in _words(row, t, kind):
      chosen = sel[r, word]
      assert chosen.all() or not chosen.any(), (kind, [t.id_to_piece(i) for i in row[word]])
      if chosen.all():
        multi_piece += len(word) > 1
        # Decoded, a selected word is one word (or a lone space piece): no space inside, no
        # continuation mark (but for a word cut by the row's start).
        decoded = t.decode(row[word]).strip()
        assert ' ' not in decoded, decoded
        assert not decoded.startswith('##') or row[word[0] - 1] == t.specials.cls, decoded
  assert multi_piece > 20  # Words of several pieces were selected, whole.
  k = masking_config.max_predictions
  assert batch['masked_weights'].sum() > 0.8 * min(k, 0.15 * 30) * len(rows)
  # Token masking of the same rows splits words: the check above can fail.
  masking_config.mode = 'token'
  tokens = _selected(masking.make_masker(masking_config, t, data.unigram_counts)(
      rows, seed=1, step=0, rows=np.arange(len(rows))))
  assert any(0 < tokens[r, w].sum() < len(w) for r, row in enumerate(rows)
             for w in _words(row, t, kind))


def test_the_data_dir_key_follows_the_tokenizers_content(by_kind, small_corpus, tmp_path):
  sp_config, _ = by_kind['sentencepiece']
  # The default's entries are those of earlier versions: their cached data dirs stay valid.
  assert prepared_lib.fingerprint(fields.rows_key(sp_config.data), sp_config.tokenizer)['tokenizer'] == {
      'vocab_size': 400, 'model_type': 'unigram', 'character_coverage': 0.9995,
      'max_sentences': sp_config.tokenizer.max_sentences}

  def key(config) -> str:
    config.data.data_dir = ''
    return prepared_lib.resolve_data_dir(*fields.data_request(config))[0]

  keys = {key(_config(small_corpus, '', kind)) for kind in KINDS}
  uncased = _config(small_corpus, '', 'wordpiece')
  uncased.tokenizer.lowercase = True
  keys.add(key(uncased))
  assert len(keys) == 4
  # A given tokenizer: keyed by its files' content, not by where they are.
  _, wordpiece = by_kind['wordpiece']
  given = _config(small_corpus, '', 'sentencepiece')
  given.tokenizer.model_file = os.path.join(wordpiece.data_dir, 'tokenizer')
  copy = tmp_path / 'copy'
  shutil.copytree(given.tokenizer.model_file, copy)
  moved = _config(small_corpus, '', 'bpe')  # The kind of a given tokenizer does not matter.
  moved.tokenizer.model_file = str(copy)
  assert key(given) == key(moved) and key(given) not in keys
  assert prepared_lib.fingerprint(fields.rows_key(given.data), given.tokenizer)['tokenizer'] == {
      'tokenizer_sha256': wordpiece.tokenizer.digest()}
  spec = json.loads((copy / 'tokenizer.json').read_text())
  spec['model']['vocab'] = {(f'{p}x' if i == 300 else p): i
                            for p, i in spec['model']['vocab'].items()}
  (copy / 'tokenizer.json').write_text(json.dumps(spec))
  assert key(moved) != key(given)
  # Words to add are part of the key.
  words = tmp_path / 'words.txt'
  words.write_text(f'{WORD}\n')
  grown = _config(small_corpus, '', 'sentencepiece')
  grown.tokenizer.model_file = given.tokenizer.model_file
  grown.tokenizer.add_tokens = str(words)
  before = key(grown)
  assert before != key(given)
  words.write_text(f'{WORD}\nglows\n')
  assert key(grown) != before


def test_a_given_tokenizer_is_kept_and_grows_by_the_words_to_add(by_kind, small_corpus, tmp_path):
  _, wordpiece = by_kind['wordpiece']
  source = os.path.join(wordpiece.data_dir, 'tokenizer')
  plain = _config(small_corpus, tmp_path / 'plain')
  plain.tokenizer.model_file = source
  data = prepare.prepare(*fields.data_request(plain))
  # The same files, the same rows: given or trained, the tokenizer is the same.
  assert data.tokenizer.digest() == wordpiece.tokenizer.digest()
  assert data.report['tokenizer']['trained'] is False and data.added_tokens() == {}
  np.testing.assert_array_equal(_rows(data), _rows(wordpiece))

  words = tmp_path / 'words.txt'
  words.write_text(f'{RARE}\nthe\n\n')   # 'the' is one token already: nothing to add.
  grown_config = _config(small_corpus, tmp_path / 'grown')
  grown_config.tokenizer.model_file = source
  grown_config.tokenizer.add_tokens = str(words)
  grown = prepare.prepare(*fields.data_request(grown_config))
  base = wordpiece.tokenizer
  assert len(base.encode([RARE])[0]) > 1
  added = grown.added_tokens()
  assert list(added) == [base.vocab_size] and grown.tokenizer.vocab_size == base.vocab_size + 1
  new_id, = added
  assert base.decode(added[new_id]) == RARE and added[new_id] == base.encode([RARE])[0]
  assert grown.tokenizer.id_to_piece(new_id) == RARE
  with open(os.path.join(grown.data_dir, prepared_lib.ADDED_TOKENS)) as f:
    assert json.load(f) == {'spelled': {str(new_id): added[new_id]},
                            'base_vocab_size': base.vocab_size}
  # The rows spell the word's 3 uses with its new id, and nothing else changed.
  splits = ('train', 'validation')
  assert sum((_rows(grown, split) == new_id).sum() for split in splits) == 3
  assert (sum(grown.stats[split]['tokens'] for split in splits)
          == sum(wordpiece.stats[split]['tokens'] for split in splits)
          - 3 * (len(added[new_id]) - 1))
  assert grown.report['tokenizer']['added_tokens'] == 1
  assert prepared_lib.load(grown.data_dir).tokenizer.digest() == grown.tokenizer.digest()


def test_a_sentencepiece_tokenizer_cannot_take_added_words(by_kind, small_corpus, tmp_path):
  _, data = by_kind['sentencepiece']
  words = tmp_path / 'words.txt'
  words.write_text(f'{WORD}\n')
  config = _config(small_corpus, tmp_path / 'data')
  config.tokenizer.model_file = os.path.join(data.data_dir, sp_tokenizer.FILE_NAME)
  config.tokenizer.add_tokens = str(words)
  with pytest.raises(ConfigError, match='cannot take added tokens') as e:
    prepare.prepare(*fields.data_request(config))
  assert '\n' not in str(e.value)
  assert not (tmp_path / 'data').exists() and not (tmp_path / 'data.partial').exists()


def test_a_tokenizer_that_cannot_spell_the_corpus_is_reported(by_kind, tmp_path, caplog):
  # Words of a script the WordPiece tokenizer never saw: each one [UNK].
  (tmp_path / 'a.txt').write_text('\n\n'.join(
      f'Document {i} says \u1200\u1208\u1210 and \u1218\u1220 here.' for i in range(60)) + '\n')
  _, wordpiece = by_kind['wordpiece']
  config = _config(str(tmp_path / 'a.txt'), tmp_path / 'data')
  config.tokenizer.model_file = os.path.join(wordpiece.data_dir, 'tokenizer')
  with caplog.at_level(logging.WARNING):
    data = prepare.prepare(*fields.data_request(config))
  rate = data.stats['train']['unknown_rate']
  assert rate == pytest.approx(data.unknown_rate()) and 0.1 < rate < 0.5
  assert data.unigram_counts[wordpiece.tokenizer.specials.unk] > 0
  warned = [r.getMessage() for r in caplog.records if 'unknown token' in r.getMessage()]
  assert len(warned) == 1 and f'{100 * rate:.2f}%' in warned[0] and 'byte-level' in warned[0]
  # Byte fallback: the default tokenizer spells the same text without [UNK].
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    bytes_data = prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.txt'), tmp_path / 'sp')))
  assert bytes_data.unknown_rate() == 0.0
  assert not [r for r in caplog.records if 'unknown token' in r.getMessage()]


def test_a_run_keeps_its_tokenizer_and_refuses_another(by_kind, tmp_path):
  workdir = tmp_path / 'run'
  _, wordpiece = by_kind['wordpiece']
  _, sentencepiece = by_kind['sentencepiece']
  workdir_lib.record(str(workdir), {'resolved': {}}, wordpiece.tokenizer)
  assert (workdir / 'tokenizer' / 'tokenizer.json').is_file()
  assert tok_lib.load(str(workdir / 'tokenizer')).digest() == wordpiece.tokenizer.digest()
  (workdir / 'checkpoints' / '4').mkdir(parents=True)  # A run with checkpoints.
  workdir_lib.check_tokenizer(str(workdir), wordpiece.tokenizer)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='tokenizer'):
    workdir_lib.check_tokenizer(str(workdir), by_kind['bpe'][1].tokenizer)
  # Another kind replaces the recorded one whole (a new run in the same directory).
  workdir_lib.record(str(workdir), {'resolved': {}}, sentencepiece.tokenizer)
  assert sorted(p.name for p in workdir.iterdir()) == ['checkpoints', 'config.json',
                                                        sp_tokenizer.FILE_NAME]
  assert (workdir / sp_tokenizer.FILE_NAME).read_bytes() == open(
      os.path.join(sentencepiece.data_dir, sp_tokenizer.FILE_NAME), 'rb').read()
  workdir_lib.check_tokenizer(str(workdir), sentencepiece.tokenizer)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='tokenizer'):
    workdir_lib.check_tokenizer(str(workdir), wordpiece.tokenizer)


def test_a_tokenizer_at_a_bucket_url_loads_as_it_does_from_disk(by_kind, small_corpus, bucket,
                                                                tmp_path):
  """A workdir's, a data dir's and a published tokenizer read from gs:// (served here from a
  local directory through fsspec), given to a run as config.tokenizer.model_file, and written
  back to a bucket."""
  text = [f'The {WORD} hums; a {RARE} sings at night.']
  for kind in KINDS:
    local = by_kind[kind][1].tokenizer
    workdir_lib.record(str(tmp_path / kind), {'resolved': {}}, local)
    shutil.copytree(tmp_path / kind, bucket / 'runs' / kind)
    url = f'gs://bucket/runs/{kind}'
    for path in (url, tok_lib.tokenizer_files(url)):
      remote = tok_lib.load(path)
      assert remote.digest() == local.digest() and remote.vocab_size == local.vocab_size
      assert remote.encode(text) == local.encode(text)
    saved = local.save(f'gs://bucket/saved/{kind}')
    assert saved.startswith('gs://bucket/saved/') and tok_lib.load(saved).digest() == local.digest()
  # BERT's published form: a WordPiece vocab.txt alone.
  pieces = by_kind['wordpiece'][1].tokenizer.pieces()
  for directory in (bucket / 'bert', tmp_path / 'bert'):
    directory.mkdir()
    (directory / 'vocab.txt').write_text('\n'.join(pieces) + '\n', encoding='utf-8')
  assert (tok_lib.load('gs://bucket/bert').encode(text)
          == tok_lib.load(str(tmp_path / 'bert')).encode(text))
  # A run given the tokenizer at a URL prepares with it.
  config = _config(small_corpus, tmp_path / 'data', 'wordpiece')
  config.tokenizer.model_file = 'gs://bucket/runs/wordpiece/tokenizer/tokenizer.json'
  tok_lib.check_config(config.tokenizer)
  assert prepare.prepare(*fields.data_request(config)).tokenizer.digest() == by_kind['wordpiece'][1].tokenizer.digest()
  config.tokenizer.model_file = 'gs://bucket/runs/nothing.json'
  with pytest.raises(ConfigError, match="model_file='gs://bucket/runs/nothing.json': no such"):
    tok_lib.check_config(config.tokenizer)


def test_a_tokenizer_is_read_once_until_its_files_change(by_kind, tmp_path):
  """The config check, prepare and the loop all ask tok_lib.load: one reading serves them."""
  for kind in KINDS:
    directory = tmp_path / kind
    path = by_kind[kind][1].tokenizer.save(str(directory))
    first = tok_lib.load(str(directory))
    assert tok_lib.load(str(directory)) is first and tok_lib.load(path) is first
    # Written again (here: its modification time set back): read again.
    changed = directory / ('tokenizer_config.json' if kind != 'sentencepiece' else
                           sp_tokenizer.FILE_NAME)
    os.utime(changed, ns=(0, 0))
    assert tok_lib.load(str(directory)) is not first
