"""Continuing from published checkpoints: BERT, RoBERTa and ModernBERT layouts, built offline.

For each layout (tests/published.py): a checkpoint imported here computes
transformers' logits; its tokenizer, read by mlm_jax, gives transformers'
ids; an export of the imported weights and tokenizer loads in transformers
with the same logits and ids; and words added to the tokenizer survive an
export as single ids whose embedding rows start as the mean of their pieces'.
Needs the `interop` extra (torch, transformers, safetensors, tokenizers).
"""

import argparse
import dataclasses
import json
import os

import numpy as np
import pytest

from tests.conftest import Deferred
from tests.conftest import require

require('torch', 'transformers', 'safetensors', 'tokenizers')
torch = Deferred('torch')
transformers = Deferred('transformers')

import jax  # noqa: E402

from configs import base  # noqa: E402
from mlm_jax import model as model_lib  # noqa: E402
from mlm_jax.config import fields as field_table  # noqa: E402
from mlm_jax.data import tokenizer as tok_lib  # noqa: E402
from mlm_jax.interop import hf  # noqa: E402
from mlm_jax.interop.layout import get_path  # noqa: E402
from mlm_jax.training import init_from  # noqa: E402
from tests import published  # noqa: E402

LAYOUTS = ('bert', 'roberta', 'modern')
ARCHITECTURES = {'bert': 'BertForMaskedLM', 'roberta': 'RobertaForMaskedLM',
                 'modern': 'ModernBertForMaskedLM'}
# Special ids of the layouts as tests/published.py builds them (ModernBERT's
# follow its 493 pieces and 2 added tokens, as 50280... follow ModernBERT's).
SPECIAL_IDS = {'bert': dict(pad=0, unk=100, cls=101, sep=102, mask=103),
               'roberta': dict(pad=1, unk=3, cls=0, sep=2, mask=499),
               'modern': dict(pad=498, unk=495, cls=496, sep=497, mask=499)}
# Words the tokenizers split into several pieces, added as whole tokens.
NEW_WORDS = ('overfitting', 'backpropagation', 'xylophonist')


def _texts(mask: str) -> list[str]:
  """Accents, CJK, emoji, odd spacing, and the mask token after a space."""
  return [
      'The quick brown fox jumps over the lazy dog.',
      'Café naïve Straße — résumé, façade, Ångström',
      '日本語のテキスト、中文字符 and 한국어 text',
      'emoji 😀🤖 and 👍🏽 and flags 🇫🇷!',
      f'The function returns a {mask} of strings.',
      f'{mask} starts, ends with a {mask}',
      'many     spaces   between\t\twords\nand lines  ',
  ]


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory) -> dict[str, str]:
  """layout -> a directory in that published layout."""
  texts, root = published.sample_texts(), tmp_path_factory.mktemp('published')
  return {name: make(str(root / name), texts) for name, make in published.MAKERS.items()}


def _hf_model(directory: str):
  return transformers.AutoModelForMaskedLM.from_pretrained(
      directory, attn_implementation='eager', dtype=torch.float32).eval()


def _batch(hf_tokenizer, texts: list[str]) -> dict[str, np.ndarray]:
  """Rows of different lengths, padded on the right with the tokenizer's pad id."""
  enc = hf_tokenizer(texts, padding=True, return_tensors='np')
  ids = enc['input_ids'].astype(np.int32)
  return {'input_ids': ids, 'attention_mask': enc['attention_mask'].astype(np.int32),
          'segment_ids': np.zeros_like(ids),
          'masked_positions': np.tile(np.arange(ids.shape[1], dtype=np.int32), (len(ids), 1))}


def _their_logits(hf_model, batch) -> np.ndarray:
  with torch.no_grad():
    return hf_model(input_ids=torch.tensor(batch['input_ids'], dtype=torch.long),
                    attention_mask=torch.tensor(batch['attention_mask'], dtype=torch.long)
                    ).logits.numpy()


def _our_logits(cfg: model_lib.ModelConfig, params, batch) -> np.ndarray:
  logits = model_lib.mlm_model(cfg).apply({'params': params}, batch, deterministic=True)
  return np.asarray(logits)[..., :cfg.vocab_size]


def _max_diff_at_real_tokens(a: np.ndarray, b: np.ndarray, batch) -> float:
  """Padding positions are left out: no output there is ever read (and RoBERTa gives them
  the position row padding_idx, which exports write as zeros)."""
  return float(np.abs(a - b)[batch['attention_mask'] > 0].max())


def _import(directory: str):
  cfg = hf.load_hf_config(directory, base.get_config().model)
  return cfg, hf.load_hf_params(directory, cfg)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_checkpoint_fields_are_the_published_shapes(checkpoints, layout):
  fields = hf.checkpoint_model_fields(checkpoints[layout])
  expected = {
      'bert': dict(variant='bert', vocab_size=400, max_position_embeddings=64, type_vocab_size=2,
                   layer_norm_eps=1e-12),
      # 66 rows in the file, the first padding_idx + 1 = 2 of them never read.
      'roberta': dict(variant='roberta', vocab_size=500, max_position_embeddings=64,
                      type_vocab_size=1, layer_norm_eps=1e-5),
      # The model's table (512) is larger than its tokenizer (500 ids).
      'modern': dict(variant='modern', vocab_size=512, max_position_embeddings=64,
                     layer_norm_eps=1e-5, global_attn_every_n_layers=2, local_attention=16,
                     global_rope_theta=160_000.0, local_rope_theta=10_000.0),
  }[layout]
  assert {k: fields[k] for k in expected} == expected
  assert (fields['num_layers'], fields['hidden_size'], fields['num_heads'],
          fields['intermediate_size']) == (2, 32, 2, 64)
  assert set(fields) <= set(field_table.checkpoint_fields(fields['variant']))
  cfg, _ = _import(checkpoints[layout])
  assert {k: getattr(cfg, k) for k in fields} == fields


@pytest.mark.parametrize('layout', LAYOUTS)
def test_imported_checkpoint_gives_transformers_logits(checkpoints, layout):
  directory = checkpoints[layout]
  cfg, params = _import(directory)
  hf_model = _hf_model(directory)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  batch = _batch(hf_tokenizer, _texts(hf_tokenizer.mask_token))
  assert (batch['attention_mask'] == 0).any()  # Some rows are padded.
  theirs = _their_logits(hf_model, batch)
  diff = _max_diff_at_real_tokens(_our_logits(cfg, params, batch), theirs, batch)
  print(f'{layout}: max |ours - HF| = {diff:.2e} (logit scale {np.abs(theirs).max():.1f})')
  assert diff <= 1e-5


@pytest.mark.parametrize('layout', LAYOUTS)
def test_our_tokenizer_gives_transformers_ids(checkpoints, layout):
  directory = checkpoints[layout]
  ours = tok_lib.load(directory)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  specials = ours.specials
  assert dict(zip(tok_lib.ROLES, specials.ids)) == SPECIAL_IDS[layout]
  assert (specials.pad, specials.mask) == (theirs.pad_token_id, theirs.mask_token_id)
  texts = _texts(specials.token('mask'))
  expected = theirs(texts, add_special_tokens=False)['input_ids']
  assert ours.encode(texts) == expected
  # The mask token is one id (in the byte-level layouts it absorbs the space before it).
  assert (expected[4].count(specials.mask), expected[5].count(specials.mask)) == (1, 2)
  assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_export_of_an_imported_checkpoint_loads_in_transformers(checkpoints, layout, tmp_path):
  directory = checkpoints[layout]
  cfg, params = _import(directory)
  tokenizer = tok_lib.load(directory)
  out = str(tmp_path / 'export')
  hf.save_model(out, params, cfg, tokenizer.specials)
  hf.save_tokenizer(out, tokenizer, cfg.max_position_embeddings, cfg.variant)
  with open(os.path.join(out, 'config.json')) as f:
    config = json.load(f)
  with open(os.path.join(directory, 'config.json')) as f:
    source_config = json.load(f)
  assert config['architectures'] == [ARCHITECTURES[layout]]
  for key in ('vocab_size', 'max_position_embeddings', 'pad_token_id'):
    assert config[key] == source_config[key], key
  model, info = transformers.AutoModelForMaskedLM.from_pretrained(
      out, attn_implementation='eager', output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys'])
  assert type(model).__name__ == ARCHITECTURES[layout]
  source_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  exported_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  texts = _texts(source_tokenizer.mask_token)
  assert exported_tokenizer(texts)['input_ids'] == source_tokenizer(texts)['input_ids']
  for name in ('tokenizer.json', 'special_tokens_map.json'):  # Carried byte for byte.
    with open(os.path.join(directory, name), 'rb') as a, open(os.path.join(out, name), 'rb') as b:
      assert a.read() == b.read(), name
  batch = _batch(exported_tokenizer, texts)
  diff = _max_diff_at_real_tokens(_their_logits(model.eval(), batch),
                                  _their_logits(_hf_model(directory), batch), batch)
  print(f'{layout}: max |export - source| = {diff:.2e}')
  assert diff <= 1e-5


@pytest.mark.parametrize('layout', LAYOUTS)
def test_added_words_survive_export_with_mean_embeddings(checkpoints, layout, tmp_path):
  directory = checkpoints[layout]
  cfg, params = _import(directory)
  tokenizer = tok_lib.load(directory)
  grown_tokenizer, spelled = tokenizer.add_tokens(NEW_WORDS)
  assert len(spelled) == len(NEW_WORDS) and all(len(p) > 1 for p in spelled.values())
  vocab = tok_lib.model_vocab_size(cfg.vocab_size, grown_tokenizer.vocab_size)
  grown_cfg = dataclasses.replace(cfg, vocab_size=vocab,
                                  padded_vocab_size=tok_lib.padded_vocab_size(vocab))
  if layout == 'modern':  # Room in its table: the new ids take unused rows.
    assert vocab == cfg.vocab_size
  else:
    assert vocab == grown_tokenizer.vocab_size > cfg.vocab_size  # Grown by exactly the words.
  grown = init_from.grow_vocab(params, cfg, grown_cfg, spelled)
  out = str(tmp_path / 'grown')
  hf.save_model(out, grown, grown_cfg, grown_tokenizer.specials)
  hf.save_tokenizer(out, grown_tokenizer, grown_cfg.max_position_embeddings, grown_cfg.variant)

  exported_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  new_ids = {grown_tokenizer.encode([w])[0][0]: w for w in NEW_WORDS}
  assert sorted(new_ids) == sorted(spelled)
  sentence = 'so ' + ' and '.join(NEW_WORDS) + ' again'
  theirs = exported_tokenizer(sentence, add_special_tokens=False)['input_ids']
  assert theirs == grown_tokenizer.encode([sentence])[0]
  for i, word in new_ids.items():
    assert theirs.count(i) == 1, word
    assert exported_tokenizer(word, add_special_tokens=False)['input_ids'] == [i]

  model = transformers.AutoModelForMaskedLM.from_pretrained(out)
  assert model.config.vocab_size == vocab
  source = _hf_model(directory)
  old_rows = source.get_input_embeddings().weight.detach().numpy()
  new_rows = model.get_input_embeddings().weight.detach().numpy()
  old_bias = source.get_output_embeddings().bias.detach().numpy()
  new_bias = model.get_output_embeddings().bias.detach().numpy()
  assert new_rows.shape == (vocab, cfg.hidden_size)
  np.testing.assert_array_equal(new_rows[:tokenizer.vocab_size], old_rows[:tokenizer.vocab_size])
  for i, pieces in spelled.items():
    np.testing.assert_allclose(new_rows[i], old_rows[pieces].mean(axis=0), rtol=0, atol=1e-7)
    np.testing.assert_allclose(new_bias[i], old_bias[pieces].mean(), rtol=0, atol=1e-7)
  # The grown model still computes the source's logits for the old ids, on text without
  # the new words.
  batch, old = _batch(exported_tokenizer, _texts(exported_tokenizer.mask_token)[:3]), slice(
      0, tokenizer.vocab_size)
  diff = _max_diff_at_real_tokens(_their_logits(model.eval(), batch)[..., old],
                                  _their_logits(source, batch)[..., old], batch)
  assert diff <= 1e-5


def test_unknown_and_unreadable_checkpoints_are_named(checkpoints, tmp_path):
  with pytest.raises(ValueError, match='has no config.json'):
    hf.checkpoint_model_fields(str(tmp_path))
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'gpt2'}))
  with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported \(only 'bert', "
                     r"'distilbert', 'roberta', 'xlm-roberta', 'camembert', 'modernbert'\)"):
    hf.checkpoint_model_fields(str(tmp_path))
  with open(os.path.join(checkpoints['roberta'], 'config.json')) as f:
    config = json.load(f)
  (tmp_path / 'config.json').write_text(json.dumps(config | {'model_type': 'xlm-roberta'}))
  with pytest.raises(ValueError, match=r'has no model\.safetensors or pytorch_model\.bin'):
    hf.checkpoint_model_fields(str(tmp_path))
  # Unpickling anything but tensors and containers could run code: refused.
  torch.save({'step': torch.zeros(1), 'optimizer': argparse.Namespace(lr=1e-4)},
             tmp_path / 'pytorch_model.bin')
  with pytest.raises(ValueError, match=r'pytorch_model\.bin holds more than tensors'):
    hf.checkpoint_model_fields(str(tmp_path))
  # XLM-R: RoBERTa's tensors under another model_type.
  os.remove(tmp_path / 'pytorch_model.bin')
  os.symlink(os.path.join(checkpoints['roberta'], 'model.safetensors'),
             tmp_path / 'model.safetensors')
  assert hf.checkpoint_model_fields(str(tmp_path)) == hf.checkpoint_model_fields(
      checkpoints['roberta'])


@pytest.mark.slow
def test_roberta_trained_here_exports_its_positions_after_its_pad_id(tmp_path):
  """A variant 'roberta' model with this project's ids ([PAD]=0): RoBERTa numbers positions
  from padding_idx + 1 = 1, so the export has one row before ours, and imports drop it."""
  from flax import linen as nn

  from mlm_jax.data import sp_tokenizer
  from tests.conftest import model_config
  specials = sp_tokenizer.SPECIALS
  cfg = model_config(vocab_size=300, padded_vocab_size=384, variant='roberta', num_layers=2,
                     hidden_size=32, num_heads=2, intermediate_size=64,
                     max_position_embeddings=24, type_vocab_size=1, layer_norm_eps=1e-5)
  rng = np.random.default_rng(0)
  lengths = np.array([24, 9, 17])
  mask = (np.arange(24)[None] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, rng.integers(5, 300, mask.shape), specials.pad).astype(np.int32)
  batch = {'input_ids': ids, 'attention_mask': mask, 'segment_ids': np.zeros_like(ids),
           'masked_positions': np.tile(np.arange(24, dtype=np.int32), (3, 1))}
  params = nn.unbox(model_lib.mlm_model(cfg).init(jax.random.key(0), batch)['params'])
  params = jax.tree_util.tree_map(
      lambda x: np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32), params)
  hf.save_model(str(tmp_path), params, cfg, specials)
  model = _hf_model(str(tmp_path))
  assert type(model).__name__ == 'RobertaForMaskedLM'
  assert (model.config.pad_token_id, model.config.max_position_embeddings) == (0, 25)
  diff = _max_diff_at_real_tokens(_our_logits(cfg, params, batch), _their_logits(model, batch),
                                  batch)
  assert diff <= 1e-5
  assert hf.load_hf_config(str(tmp_path), base.get_config().model) == cfg
  loaded = hf.load_hf_params(str(tmp_path), cfg)
  table = ('encoder', 'embeddings', 'position', 'embedding')
  np.testing.assert_array_equal(get_path(loaded, table), get_path(params, table))
