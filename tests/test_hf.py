"""Hugging Face interop: weight layout, export/import, tokenizer, fill-mask, embedding correction.

Needs the `interop` extra (torch, transformers, safetensors, tokenizers);
skipped without it so that the core suite runs on its own.
"""

import dataclasses
import os
import sys

import numpy as np
import pytest

from tests.conftest import Deferred
from tests.conftest import require

require('torch', 'transformers', 'safetensors', 'tokenizers')
torch = Deferred('torch')
transformers = Deferred('transformers')

import flax.linen  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

from configs import base
from mlm_jax import model as model_lib  # noqa: E402
from mlm_jax.analysis import fill_mask  # noqa: E402
from mlm_jax.data import sp_tokenizer  # noqa: E402
from mlm_jax.errors import ConfigError
from mlm_jax.interop import mlm_export as export_lib  # noqa: E402
from mlm_jax.interop import hf  # noqa: E402
from mlm_jax.training import checkpoint  # noqa: E402
from mlm_jax.training import init_from  # noqa: E402
from mlm_jax.training import state as state_lib  # noqa: E402
from mlm_jax.training import workdir as workdir_lib  # noqa: E402
from tests.conftest import micro_config  # noqa: E402
from tests.conftest import model_config
from tests.conftest import run_training

SPECIALS = sp_tokenizer.SPECIALS
# Texts whose ids must agree exactly between sentencepiece and the export.
TOKENIZER_TEXTS = [
    'The quick brown fox jumps over the lazy dog.',
    'café naïve Straße — 日本語 😀 Ωµ ﬁ ①',
    'pi = 3.14159, 1e-9, 0x1F, 2024-06-30 and 42%',
    'def get_item_by_id(self, itemId): return self._items[itemId]  # snake_case, CamelCase',
    'The function returns a [MASK] of strings.',
    '[MASK] starts, ends [MASK]',
    'many     spaces   between\t\twords   ',
    'line one\nline two\n\n  indented\r\nwindows',
    '',
]


def _hf_model(vocab: int, d: int, layers: int, heads: int, d_ff: int, positions: int,
              segments: int, eps: float, seed: int):
  """A randomly initialised BertForMaskedLM with every tensor perturbed (LN and biases too)."""
  torch.manual_seed(seed)
  config = transformers.BertConfig(
      vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
      intermediate_size=d_ff, max_position_embeddings=positions, type_vocab_size=segments,
      layer_norm_eps=eps, hidden_act='gelu', hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0)
  model = transformers.BertForMaskedLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn_like(p) * 0.1 + (1.0 if 'LayerNorm.weight' in name else 0.0))
  return model


def _padded_batch(rng: np.random.Generator, vocab: int, b: int, t: int, p: int,
                  lengths: list[int], segments: int) -> dict[str, np.ndarray]:
  """Rows of the given lengths, [PAD] after; masked positions inside each row."""
  ids = rng.integers(5, vocab, (b, t))
  mask = np.arange(t)[None, :] < np.array(lengths)[:, None]
  ids = np.where(mask, ids, SPECIALS.pad)
  seg = np.where(np.arange(t)[None, :] >= t // 2, segments - 1, 0) * mask
  pos = np.stack([np.sort(rng.choice(n, p, replace=False)) for n in lengths])
  return {'input_ids': ids.astype(np.int32), 'attention_mask': mask.astype(np.int32),
          'segment_ids': seg.astype(np.int32), 'masked_positions': pos.astype(np.int32)}


def _hf_logits(model, batch: dict[str, np.ndarray]) -> np.ndarray:
  """HF logits at the masked positions: [B, P, V]."""
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(batch['input_ids'], dtype=torch.long),
                   attention_mask=torch.tensor(batch['attention_mask'], dtype=torch.long),
                   token_type_ids=torch.tensor(batch['segment_ids'], dtype=torch.long)).logits
  return np.take_along_axis(logits.numpy(), batch['masked_positions'][..., None], axis=1)


def _our_logits(cfg: model_lib.ModelConfig, params, batch) -> np.ndarray:
  logits = model_lib.BertForMLM(cfg).apply({'params': params}, batch, deterministic=True)
  return np.asarray(logits)[..., :cfg.vocab_size]


@pytest.mark.slow
@pytest.mark.parametrize('shape', [
    # vocab, d, layers, heads, d_ff, positions, segments, eps
    (300, 48, 2, 3, 100, 16, 2, 1e-12),   # 3 heads, d_ff not a multiple of d, vocab % 128 != 0
    (256, 32, 1, 4, 128, 24, 3, 1e-5),    # vocab a multiple of 128: no padding rows
    (517, 64, 3, 8, 96, 20, 1, 1e-12),
])
def test_imported_hf_model_gives_hf_logits(shape, tmp_path):
  vocab, *_, positions, segments, _ = shape
  hf_model = _hf_model(*shape, seed=sum(shape[:5]))
  hf_model.save_pretrained(tmp_path)
  cfg = hf.load_hf_config(str(tmp_path), base.get_config().model)
  assert (cfg.vocab_size, cfg.padded_vocab_size) == (vocab, -(-vocab // 128) * 128)
  params = hf.load_hf_params(str(tmp_path), cfg)
  batch = _padded_batch(np.random.default_rng(0), vocab, 3, positions, 4,
                        [positions, 9, positions - 3], segments)
  ours, theirs = _our_logits(cfg, params, batch), _hf_logits(hf_model, batch)
  diff = float(np.abs(ours - theirs).max())
  print(f'{shape}: max |ours - HF| = {diff:.2e} (logit scale {np.abs(theirs).max():.1f})')
  assert diff <= 1e-5


def _random_params(cfg: model_lib.ModelConfig, seed: int = 0):
  """Initialised params with every leaf perturbed, so that no tensor is trivially 0 or 1."""
  ids = np.zeros((1, 8), np.int32)
  batch = {'input_ids': ids, 'attention_mask': ids + 1, 'segment_ids': ids,
           'masked_positions': ids[:, :2]}
  params = model_lib.BertForMLM(cfg).init(jax.random.key(seed), batch)['params']
  params = flax.linen.unbox(params)  # Drop the logical axis names.
  leaves, tree = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_unflatten(
      tree, [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32) for x in leaves])


ODD = model_config(vocab_size=300, padded_vocab_size=384, num_layers=2, hidden_size=48,
                            num_heads=3, intermediate_size=100, max_position_embeddings=16,
                            layer_norm_eps=1e-6)


@pytest.mark.slow
def test_export_import_round_trip_is_exact(tmp_path):
  params = _random_params(ODD)
  hf.save_model(str(tmp_path), params, ODD, SPECIALS)
  assert hf.load_hf_config(str(tmp_path), base.get_config().model) == ODD
  loaded = hf.load_hf_params(str(tmp_path), ODD)
  v = ODD.vocab_size
  flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  flat_loaded = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
  assert flat.keys() == flat_loaded.keys()
  for path, x in flat.items():
    y = flat_loaded[path]
    assert y.shape == x.shape and y.dtype == np.float32, path
    if x.shape[0] == ODD.padded_vocab_size:  # Token embedding, output bias.
      np.testing.assert_array_equal(y[:v], x[:v])
      assert not y[v:].any()
    else:
      np.testing.assert_array_equal(y, x, err_msg=str(path))


@pytest.mark.slow
def test_bert_model_weights_keep_the_state_head(tmp_path):
  cfg = dataclasses.replace(ODD, vocab_size=200, padded_vocab_size=256)
  hf_model = _hf_model(200, 48, 2, 3, 100, 16, 2, 1e-6, seed=1).bert
  hf_model.save_pretrained(tmp_path)  # BertModel: no 'bert.' prefix, a pooler, no MLM head.
  model = model_lib.BertForMLM(cfg)
  ids = np.zeros((1, 8), np.int32)
  example = {'input_ids': ids, 'attention_mask': ids + 1, 'segment_ids': ids,
             'masked_positions': ids[:, :2]}
  state = state_lib.create_state(model, optax.sgd(0.1), jax.random.key(0), example)
  new = init_from.place(state, hf.load_hf_params(str(tmp_path), cfg, fallback_params=state.params))
  np.testing.assert_array_equal(
      new.params['encoder']['layer_1']['intermediate']['kernel'],
      hf_model.encoder.layer[1].intermediate.dense.weight.detach().numpy().T)
  for a, b in zip(jax.tree_util.tree_leaves(new.params['mlm_head']),
                  jax.tree_util.tree_leaves(state.params['mlm_head'])):
    np.testing.assert_array_equal(a, b)
  assert int(new.step) == 0
  with pytest.raises(ValueError, match='no MLM head'):
    hf.load_hf_params(str(tmp_path), cfg)


def test_a_pickle_holding_more_than_tensors_is_refused(tmp_path):
  """torch.load(weights_only=True) reads tensors only: an object in the file (it could run code
  when unpickled) is refused, with the conversion to run where the file is trusted."""
  import argparse
  torch.save({'bert.embeddings.word_embeddings.weight': torch.zeros(3, 2),
              'args': argparse.Namespace(lr=1e-4)}, tmp_path / 'pytorch_model.bin')
  with pytest.raises(ValueError, match=r'pytorch_model\.bin holds more than tensors.*'
                     r'weights_only=False.*save_file'):
    hf.load_hf_params(str(tmp_path), ODD)


@pytest.mark.slow
def test_shape_mismatch_names_the_tensor(tmp_path):
  hf.save_model(str(tmp_path), _random_params(ODD), ODD, SPECIALS)
  wider = dataclasses.replace(ODD, intermediate_size=64)
  with pytest.raises(ValueError, match=r'bert\.encoder\.layer\.0\.intermediate\.dense\.weight '
                     r'has shape \(100, 48\).*\(64, 48\)'):
    hf.load_hf_params(str(tmp_path), wider)


def test_embedding_correction_by_hand():
  # Rows 0-4 are the special tokens ([MASK] = 4); 5 and 6 are normal.
  e = np.array([[0, 0], [2, 2], [0, 2], [2, 0], [4, 0], [0, 4], [4, 8]], np.float32)
  weights = np.array([0, 0, 0, 0, 0, 1, 3], np.float64)  # Ebar = (E5 + 3 E6) / 4 = [3, 7]
  out = export_lib.embedding_correction(e, select_rate=0.5, mask_prob=0.5, random_prob=0.25,
                                        random_weights=weights, mask_id=4)
  # Row i: 0.5 E_i + 0.5 (0.5 [4, 0] + 0.25 E_i + 0.25 [3, 7]) = 0.625 E_i + [1.375, 0.875].
  np.testing.assert_allclose(out[5], [1.375, 3.375])
  np.testing.assert_allclose(out[6], [3.875, 5.875])
  np.testing.assert_allclose(out[4], [3.875, 0.875])  # [MASK] by the same formula.
  np.testing.assert_allclose(out[0], [1.375, 0.875])
  assert out.dtype == np.float32
  # Nothing selected: unchanged.
  np.testing.assert_array_equal(export_lib.embedding_correction(
      e, select_rate=0.0, mask_prob=0.8, random_prob=0.1, random_weights=weights, mask_id=4), e)


# ------------------------------------------------------- a short trained run


@pytest.fixture(scope='module')
def exported(micro_run, tmp_path_factory):
  """A micro model trained 8 steps (conftest's shared run), exported: (run, export dir)."""
  out = str(tmp_path_factory.mktemp('hf_export'))
  return workdir_lib.export_hf(micro_run, out), out


@pytest.mark.slow
def test_exported_model_matches_our_logits(exported):
  run, out = exported
  model, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys'])
  assert model.config.vocab_size == run.model_cfg.vocab_size
  cfg = run.model_cfg
  batch = _padded_batch(np.random.default_rng(1), cfg.vocab_size, 4, cfg.max_position_embeddings,
                        5, [cfg.max_position_embeddings, 7, 20, 12], 1)
  diff = float(np.abs(_our_logits(cfg, run.params, batch) - _hf_logits(model, batch)).max())
  print(f'trained run: max |ours - HF| = {diff:.2e}')
  assert diff <= 1e-5


@pytest.mark.slow
def test_exported_tokenizer_gives_our_ids(exported, corpus_glob):
  import glob
  run, out = exported
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  specials = run.tokenizer.specials
  assert (tokenizer.mask_token_id, tokenizer.pad_token_id) == (specials.mask, specials.pad)
  docs = [d for path in sorted(glob.glob(corpus_glob)) for d in open(path).read().split('\n\n')]
  texts = TOKENIZER_TEXTS + docs
  ours = [[specials.cls, *ids, specials.sep] for ids in run.tokenizer.encode(texts)]
  theirs = tokenizer(texts)['input_ids']
  mismatched = [t for t, a, b in zip(texts, ours, theirs) if a != b]
  assert not mismatched, mismatched[:3]
  assert specials.mask in theirs[TOKENIZER_TEXTS.index('[MASK] starts, ends [MASK]')]


@pytest.mark.slow
def test_fill_mask_pipeline_agrees_with_ours(exported):
  run, out = exported
  text = 'The function returns a [MASK] of strings.'
  pipe = transformers.pipeline('fill-mask', model=out)
  theirs = pipe(text, top_k=5)
  ours = fill_mask.predict(run, [text, 'no mask here'], top_k=5)
  assert ours[1] == []
  (candidates,) = ours[0]
  assert [run.tokenizer.id_to_piece(r['token']) for r in theirs] == [p for p, _ in candidates]
  np.testing.assert_allclose([r['score'] for r in theirs], [q for _, q in candidates], atol=1e-6)


@pytest.mark.slow
def test_corrected_export_loads(exported, tmp_path):
  run, _ = exported
  workdir_lib.export_hf(run.workdir, str(tmp_path), apply_embedding_correction=True)
  model = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path))
  m, v = run.config['masking'], run.model_cfg.vocab_size
  counts = np.load(os.path.join(run.config['resolved']['data_dir'], 'unigram_counts.npy'))
  counts = counts.astype(np.float64)
  counts[run.tokenizer.special_ids()] = 0
  table = run.params['encoder']['embeddings']['token']['embedding'][:v]
  expected = export_lib.embedding_correction(
      table, select_rate=m['select_rate'], mask_prob=m['mask_prob'],
      random_prob=m['random_prob'], random_weights=counts, mask_id=run.tokenizer.specials.mask)
  got = model.bert.embeddings.word_embeddings.weight.detach().numpy()
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)
  assert np.abs(got - table).max() > 1e-4  # It did change.
  # Everything else is exported unchanged.
  np.testing.assert_array_equal(model.cls.predictions.bias.detach().numpy(),
                                run.params['mlm_head']['output_bias'][:v])


@pytest.mark.slow
def test_export_without_safetensors_names_the_extra(exported, tmp_path, monkeypatch):
  run, _ = exported
  monkeypatch.setitem(sys.modules, 'safetensors', None)  # As if not installed.
  with pytest.raises(ImportError, match=r"pip install -e '\.\[interop\]'"):
    workdir_lib.export_hf(run.workdir, str(tmp_path))
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_training_continues_from_an_exported_model(exported, corpus_glob, tmp_path):
  run, out = exported
  config = micro_config(corpus_glob, str(tmp_path / 'data'))  # A fresh data dir.
  config.init.hf_dir = out
  config.tokenizer.vocab_size = 777  # Ignored: the export's tokenizer.model is used.
  config.train.num_steps = 1  # The first update has learning rate 0 (warm-up).
  workdir = str(tmp_path / 'continued')
  run_training(config, workdir)
  _, params, _ = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'))
  vocab = run.model_cfg.vocab_size
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [k.key for k in path]
    expected = run.params
    for k in keys:
      expected = expected[k]
    if keys[-1] == 'output_bias' or keys[-2:] == ['token', 'embedding']:
      leaf, expected = leaf[:vocab], expected[:vocab]  # Padding rows are re-zeroed.
    np.testing.assert_array_equal(leaf, expected, err_msg='/'.join(keys))
  with open(os.path.join(workdir, 'tokenizer.model'), 'rb') as f:
    assert f.read() == run.tokenizer.model_proto


@pytest.mark.slow
def test_hf_dir_without_tokenizer_files_is_refused(exported, corpus_glob, tmp_path):
  import shutil

  _, out = exported
  bare = tmp_path / 'bare'
  shutil.copytree(out, bare)
  for name in ('tokenizer.model', 'tokenizer.json', 'tokenizer_config.json'):
    os.remove(bare / name)
  config = micro_config(corpus_glob, str(tmp_path / 'data'))
  config.init.hf_dir = str(bare)
  with pytest.raises(ConfigError, match='has no tokenizer files'):
    run_training(config, str(tmp_path / 'run'))
