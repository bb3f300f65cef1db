"""bert-base-cased, XLM-R, CamemBERT, DistilBERT and mmBERT in and out as themselves, offline.

For each layout: the import computes transformers' logits; our reading of
its tokenizer gives AutoTokenizer's ids (accents, CJK, emoji, a mask after a
space); the export is the source's class and model_type, carries every
tokenizer file byte for byte (sentencepiece.bpe.model included), and
AutoTokenizer on it builds the source's tokenizer class with the source's
ids; a run continued from the layout (2 steps at lr 1e-9) exports the
same, with the source's top-1 predictions; and a classifier fine-tuned from
a DistilBERT or XLM-R layout exports as that kind's ForSequenceClassification
(ForTokenClassification) with our logits. Needs the `interop` extra.
"""

import json
import os

import numpy as np
import pytest

from tests.conftest import Deferred
from tests.conftest import require

require('torch', 'transformers', 'safetensors', 'tokenizers', 'sentencepiece')
torch = Deferred('torch')
transformers = Deferred('transformers')

from configs import base  # noqa: E402
from mlm_jax import model as model_lib  # noqa: E402
from mlm_jax.data import tokenizer as tok_lib  # noqa: E402
from mlm_jax.interop import hf  # noqa: E402
from mlm_jax.interop import mlm_export  # noqa: E402
from mlm_jax.training import workdir as workdir_lib  # noqa: E402
from tests import published  # noqa: E402
from tests.conftest import micro_config  # noqa: E402
from tests.conftest import run_training  # noqa: E402

LAYOUTS = tuple(published.MORE_MAKERS)
# layout -> (architecture, model_type, tokenizer class AutoTokenizer builds).
EXPECTED = {
    'bert-cased': ('BertForMaskedLM', 'bert', 'BertTokenizer'),
    'xlm-roberta': ('XLMRobertaForMaskedLM', 'xlm-roberta', 'XLMRobertaTokenizer'),
    'camembert': ('CamembertForMaskedLM', 'camembert', 'CamembertTokenizer'),
    'distilbert': ('DistilBertForMaskedLM', 'distilbert', 'DistilBertTokenizer'),
    # tokenizer_config.json names GemmaTokenizer, but transformers builds its tokenizer.json
    # as it is (TokenizersBackend) for every model_type modernbert.
    'mmbert': ('ModernBertForMaskedLM', 'modernbert', 'TokenizersBackend'),
}
# Special ids by role as the builders lay them out (as the published checkpoints do).
SPECIAL_IDS = {'bert-cased': dict(pad=0, unk=100, cls=101, sep=102, mask=103),
               'xlm-roberta': dict(pad=1, unk=3, cls=0, sep=2, mask=401),
               'camembert': dict(pad=1, unk=3, cls=5, sep=6, mask=404),
               'distilbert': dict(pad=0, unk=100, cls=101, sep=102, mask=103),
               'mmbert': dict(pad=0, unk=3, cls=2, sep=1, mask=4)}
_WEIGHT_FILES = ('config.json', 'model.safetensors')
# Layouts continued with whole-word masking (their word starts: '##'-less pieces, '▁' pieces).
WHOLE_WORD = ('bert-cased', 'distilbert', 'mmbert')


def _texts(mask: str) -> list[str]:
  """Accents, CJK, emoji, odd spacing, and the mask token after a space."""
  return ['In the beginning God created the heaven and the earth.',
          'Café naïve Straße — résumé, façade, Ångström',
          '日本語のテキスト、中文字符 and 한국어 text',
          'emoji 😀🤖 and 👍🏽 and flags 🇫🇷!',
          f'The function returns a {mask} of strings.',
          f'{mask} starts, ends with a {mask}',
          'many     spaces   between\t\twords\nand lines  ']


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory) -> dict[str, str]:
  """layout -> a directory in that published layout."""
  texts, root = published.sample_texts(), tmp_path_factory.mktemp('layouts')
  return {name: make(str(root / name), texts) for name, make in published.MORE_MAKERS.items()}


def _batch(tokenizer, texts: list[str]) -> dict[str, np.ndarray]:
  enc = tokenizer(texts, padding=True, return_tensors='np')
  ids = enc['input_ids'].astype(np.int32)
  return {'input_ids': ids, 'attention_mask': enc['attention_mask'].astype(np.int32),
          'segment_ids': np.zeros_like(ids),
          'masked_positions': np.tile(np.arange(ids.shape[1], dtype=np.int32), (len(ids), 1))}


def _their_logits(directory: str, batch) -> np.ndarray:
  model = transformers.AutoModelForMaskedLM.from_pretrained(
      directory, attn_implementation='eager', dtype=torch.float32).eval()
  with torch.no_grad():
    return model(input_ids=torch.tensor(batch['input_ids'], dtype=torch.long),
                 attention_mask=torch.tensor(batch['attention_mask'], dtype=torch.long)
                 ).logits.numpy()


def _import(directory: str):
  cfg = hf.load_hf_config(directory, base.get_config().model)
  return cfg, hf.load_hf_params(directory, cfg)


def _check_export(source: str, out: str, layout: str) -> None:
  """The export is the source's kind: class, model_type, files, tokenizer class and ids."""
  architecture, model_type, tokenizer_class = EXPECTED[layout]
  with open(os.path.join(out, 'config.json')) as f:
    config = json.load(f)
  assert (config['architectures'], config['model_type']) == ([architecture], model_type)
  files = set(os.listdir(source)) - set(_WEIGHT_FILES)
  assert files <= set(os.listdir(out))
  for name in files:  # Every tokenizer file, byte for byte.
    with open(os.path.join(source, name), 'rb') as a, open(os.path.join(out, name), 'rb') as b:
      assert a.read() == b.read(), name
  model, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
  assert type(model).__name__ == architecture
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys'])
  theirs = transformers.AutoTokenizer.from_pretrained(source)
  exported = transformers.AutoTokenizer.from_pretrained(out)
  assert type(exported).__name__ == type(theirs).__name__ == tokenizer_class
  texts = _texts(theirs.mask_token)
  assert exported(texts)['input_ids'] == theirs(texts)['input_ids']


@pytest.mark.parametrize('layout', LAYOUTS)
def test_import_gives_transformers_logits_and_ids(checkpoints, layout):
  directory = checkpoints[layout]
  fields = hf.checkpoint_model_fields(directory)
  assert fields.get('type_vocab_size') == {'distilbert': 0, 'bert-cased': 2,
                                           'mmbert': None}.get(layout, 1)
  cfg, params = _import(directory)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  batch = _batch(theirs, _texts(theirs.mask_token))
  ours = np.asarray(model_lib.mlm_model(cfg).apply({'params': params}, batch, deterministic=True))
  real = batch['attention_mask'] > 0
  diff = np.abs(ours[..., :cfg.vocab_size] - _their_logits(directory, batch))[real].max()
  assert diff <= 1e-5

  tokenizer = tok_lib.load(directory)
  assert dict(zip(tok_lib.ROLES, tokenizer.specials.ids)) == SPECIAL_IDS[layout]
  texts = _texts(tokenizer.specials.token('mask'))
  expected = theirs(texts, add_special_tokens=False)['input_ids']
  assert tokenizer.encode(texts) == expected
  if layout == 'bert-cased':  # Case and accents kept, unlike bert-base-uncased.
    assert theirs.tokenize('Café')[0] != theirs.tokenize('cafe')[0]
  mask = tokenizer.specials.mask
  assert (expected[4].count(mask), expected[5].count(mask)) == (1, 2)
  if layout in ('xlm-roberta', 'camembert', 'mmbert'):  # The space before the mask is
    tokens = theirs.convert_ids_to_tokens(expected[4])   # absorbed (lstrip).
    assert tokens[tokens.index(theirs.mask_token) - 1] == '▁a'
  if layout == 'mmbert':  # Characters outside the pieces are spelled in bytes, never <unk>.
    assert tokenizer.specials.unk not in sum(expected, [])
    assert '<0xF0>' in theirs.convert_ids_to_tokens(expected[3])
    # Gemma's normalizer spells spaces '▁' (no Metaspace): words start at '▁' pieces.
    starts = tokenizer.word_start_mask()
    pieces = tokenizer.pieces()
    assert all(starts[i] == p.startswith('▁') for i, p in enumerate(pieces) if i > 260)
    assert 0 < starts[261:].sum() < len(pieces) - 261


@pytest.mark.parametrize('layout', LAYOUTS)
def test_export_is_the_source_kind(checkpoints, layout, tmp_path):
  directory = checkpoints[layout]
  cfg, params = _import(directory)
  tokenizer = tok_lib.load(directory)
  assert mlm_export.export_format(cfg, tokenizer).model_type == EXPECTED[layout][1]
  out = str(tmp_path / 'export')
  mlm_export.write(out, params, cfg, tokenizer)
  _check_export(directory, out, layout)
  with open(os.path.join(out, 'tokenizer_config.json'), 'rb') as a, open(
      os.path.join(directory, 'tokenizer_config.json'), 'rb') as b:
    assert a.read() == b.read()  # No key added: transformers loads it as it is.
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  batch = _batch(theirs, _texts(theirs.mask_token))
  diff = np.abs(_their_logits(out, batch) - _their_logits(directory, batch))
  assert diff[batch['attention_mask'] > 0].max() <= 1e-5


def test_xlm_roberta_without_tokenizer_config_still_exports_as_xlm_roberta(checkpoints, tmp_path):
  """The hub's xlm-roberta-base has no tokenizer_config.json: its unigram vocabulary says
  XLM-R (and CamemBERT's <s>NOTUSED says CamemBERT)."""
  for layout in ('xlm-roberta', 'camembert'):
    bare = tmp_path / layout
    bare.mkdir()
    for name in os.listdir(checkpoints[layout]):
      if name != 'tokenizer_config.json':
        os.symlink(os.path.join(checkpoints[layout], name), bare / name)
    cfg = hf.load_hf_config(str(bare), base.get_config().model)
    assert mlm_export.export_format(cfg, tok_lib.load(str(bare))).model_type == EXPECTED[layout][1]


def test_distilbert_layout_is_checked():
  """type_vocab_size 0 (no token-type table) is DistilBERT's layout, of the BERT encoder only;
  DistilBERT's fixed LayerNorm eps is refused otherwise, in one line."""
  from mlm_jax.errors import ConfigError
  from mlm_jax.data import sp_tokenizer
  from mlm_jax.model import config as model_config_lib
  from tests.conftest import model_config
  config = base.get_config()
  config.model.type_vocab_size, config.model.variant = 0, 'roberta'
  with pytest.raises(ConfigError, match="or 0 .* with variant='bert'"):
    model_config_lib.check_config(config.model)
  cfg = model_config(vocab_size=300, padded_vocab_size=384, type_vocab_size=0,
                     layer_norm_eps=1e-5)
  assert hf.model_format(cfg) is hf.DISTILBERT
  with pytest.raises(ValueError, match='DistilBertForMaskedLM fixes it at 1e-12'):
    hf.to_hf_config(cfg, sp_tokenizer.SPECIALS)
  with pytest.raises(ValueError, match='has no RobertaForMaskedLM form'):
    hf.to_hf_config(cfg, sp_tokenizer.SPECIALS, hf.ROBERTA)


@pytest.mark.slow
@pytest.mark.parametrize('layout', LAYOUTS)
def test_continued_run_exports_the_source_kind(checkpoints, layout, corpus_glob, tmp_path):
  """import -> 2 steps at lr 1e-9 -> export: the source's class, tokenizer and predictions
  (the WordPiece layouts and mmBERT with whole-word masking)."""
  directory = checkpoints[layout]
  config = micro_config(corpus_glob, str(tmp_path / 'data'))
  config.init.hf_dir = directory
  config.data.seq_len = 32
  config.train.num_steps = 2
  config.train.learning_rate = 1e-9
  if layout in WHOLE_WORD:
    config.masking.mode = 'whole_word'
  workdir, out = str(tmp_path / 'run'), str(tmp_path / 'export')
  run_training(config, workdir)
  run = workdir_lib.export_hf(workdir, out)
  if layout != 'mmbert':  # ModernBERT has no token-type table at all.
    assert run.model_cfg.type_vocab_size == {'distilbert': 0, 'bert-cased': 2}.get(layout, 1)
  _check_export(directory, out, layout)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  batch = _batch(theirs, _texts(theirs.mask_token))
  real = batch['attention_mask'] > 0
  top1 = [_their_logits(d, batch).argmax(-1)[real] for d in (directory, out)]
  np.testing.assert_array_equal(top1[0], top1[1])


@pytest.mark.slow
@pytest.mark.parametrize('layout,task', [('distilbert', 'classify'), ('distilbert', 'tag'),
                                         ('xlm-roberta', 'classify')])
def test_fine_tuned_classifier_exports_as_the_source_kind(checkpoints, layout, task, tmp_path):
  """finetune --hf_dir (a DistilBERT or XLM-R layout) -> export: DistilBertFor- (XLMRobertaFor-)
  SequenceClassification or TokenClassification, which loads in transformers with our logits
  and the source's tokenizer class."""
  from tests.test_finetune import _classify_rows
  from tests.test_finetune import _config
  from tests.test_finetune import _export_matches_ours
  from tests.test_finetune import _tag_rows
  from tests.test_finetune import _write_jsonl
  from mlm_jax.finetuning import loop
  rows = _tag_rows if task == 'tag' else _classify_rows
  train = _write_jsonl(tmp_path / 'train.jsonl', rows(0, 64))
  evaluation = _write_jsonl(tmp_path / 'eval.jsonl', rows(1, 32))
  config = _config(num_epochs=2.0, eval_every=4)
  config.data.seq_len = 32
  out = str(tmp_path / 'classifier')
  loop.finetune(None, out, task, train, evaluation, config, hf_dir=checkpoints[layout])
  head = 'TokenClassification' if task == 'tag' else 'SequenceClassification'
  diff = _export_matches_ours(out, evaluation, tmp_path, f'AutoModelFor{head}')
  assert diff <= 1e-5, diff
  hf_dir = str(tmp_path / 'hf')   # _export_matches_ours's export.
  with open(os.path.join(hf_dir, 'config.json')) as f:
    config_json = json.load(f)
  architecture, model_type, tokenizer_class = EXPECTED[layout]
  assert config_json['architectures'] == [architecture.replace('MaskedLM', head)]
  assert config_json['model_type'] == model_type
  assert type(transformers.AutoTokenizer.from_pretrained(hf_dir)).__name__ == tokenizer_class
