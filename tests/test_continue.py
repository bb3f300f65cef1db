"""Continued pretraining from published layouts: import -> train -> export -> transformers.

For each of bert-base-uncased's, roberta-base's and ModernBERT's layouts (built
offline by tests/published.py): `train` with config.init.hf_dir takes the
architecture, shape and tokenizer from the checkpoint, trains 20 steps on
another corpus, and `export` writes the source's architecture class and its
tokenizer files, which transformers loads to give the source's ids and our
predictions. Then the bad inputs, each refused in one line before anything
is prepared.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from mlm_jax.config import run_plan
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint
from tests import published
from tests.conftest import Deferred
from tests.conftest import micro_config
from tests.conftest import require
from tests.conftest import run_training

require('transformers', 'torch')
transformers = Deferred('transformers')
torch = Deferred('torch')

TEXTS = ['Café naïve façade: 東京 and 😀 emoji.', 'Return the <mask> of a list.',
         'A [MASK] after a space', 'lowercase UPPERCASE MixedCase', 'x' * 300]
ARCHITECTURES = {'bert': 'BertForMaskedLM', 'roberta': 'RobertaForMaskedLM',
                 'modern': 'ModernBertForMaskedLM'}


@pytest.fixture(scope='module')
def texts():
  return published.sample_texts(200)


@pytest.fixture(scope='module', params=sorted(published.MAKERS))
def source(request, texts, tmp_path_factory) -> tuple[str, str]:
  """(variant, a published-layout directory) for each layout."""
  directory = str(tmp_path_factory.mktemp(f'published_{request.param}'))
  return request.param, published.MAKERS[request.param](directory, texts)


def _config(corpus_glob: str, data_dir: str, hf_dir: str):
  config = micro_config(corpus_glob, data_dir)
  config.init.hf_dir = hf_dir
  config.train.num_steps = 20
  config.train.eval_every = 20
  config.train.checkpoint_every = 20
  config.train.concurrent_chains = 1
  return config


@pytest.fixture(scope='module')
def continued(source, corpus_glob, tmp_path_factory):
  """(variant, source dir, workdir, export dir, summary) of 20 steps from the source."""
  variant, hf_dir = source
  root = tmp_path_factory.mktemp(f'continued_{variant}')
  config = _config(corpus_glob, str(root / 'data'), hf_dir)
  summary = run_training(config, str(root / 'run'))
  from mlm_jax.training import workdir as workdir_lib
  out = str(root / 'export')
  workdir_lib.export_hf(str(root / 'run'), out)
  return variant, hf_dir, str(root / 'run'), out, summary


@pytest.mark.slow
def test_the_checkpoint_decides_the_architecture(continued):
  variant, hf_dir, workdir, _, summary = continued
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  with open(os.path.join(hf_dir, 'config.json')) as f:
    hf = json.load(f)
  assert saved['model']['variant'] == variant
  assert saved['model']['hidden_size'] == hf['hidden_size']
  assert saved['model']['num_layers'] == hf['num_hidden_layers']
  assert saved['model']['vocab_size'] == hf['vocab_size']
  assert summary['step'] == 20 and np.isfinite(summary['final_eval_loss'])


@pytest.mark.slow
def test_export_is_the_source_architecture_with_its_tokenizer(continued):
  variant, hf_dir, _, out, _ = continued
  model = transformers.AutoModelForMaskedLM.from_pretrained(out)
  assert type(model).__name__ == ARCHITECTURES[variant]
  with open(os.path.join(hf_dir, 'config.json')) as f:
    assert model.config.vocab_size == json.load(f)['vocab_size']
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
  exported = transformers.AutoTokenizer.from_pretrained(out)
  texts = [t.replace('[MASK]', theirs.mask_token).replace('<mask>', theirs.mask_token)
           for t in TEXTS]
  assert exported(texts)['input_ids'] == theirs(texts)['input_ids']
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with open(os.path.join(hf_dir, name), 'rb') as a, open(os.path.join(out, name), 'rb') as b:
      assert a.read() == b.read(), f'{name} was not carried over byte for byte'


@pytest.mark.slow
def test_export_predicts_as_our_trained_weights(continued):
  """The exported model's logits equal those of the weights we trained (restored here)."""
  variant, _, workdir, out, _ = continued
  from mlm_jax.training import workdir as workdir_lib
  run = workdir_lib.load(workdir)
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForMaskedLM.from_pretrained(out, attn_implementation='eager')
  batch = dict(tokenizer(['The function returns a list of strings.', 'A short one.'],
                         padding='max_length', max_length=32, truncation=True,
                         return_tensors='np'))
  with torch.no_grad():
    hf_logits = model(**{k: torch.from_numpy(np.asarray(v, np.int64))
                         for k, v in batch.items()}).logits.numpy()
  ours = _our_logits(run, batch)
  real = batch['attention_mask'].astype(bool)
  assert np.abs(ours[real] - hf_logits[real]).max() < 1e-4


def _our_logits(run, batch) -> np.ndarray:
  """[b, T, V] logits of the run's params at every position."""
  from mlm_jax import model as model_lib
  ids = np.asarray(batch['input_ids'], np.int32)
  positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int32)
  inputs = {'input_ids': ids, 'attention_mask': np.asarray(batch['attention_mask'], np.int32),
            'segment_ids': np.zeros_like(ids), 'masked_positions': positions}
  logits = model_lib.mlm_model(run.model_cfg).apply({'params': run.params}, inputs,
                                                    deterministic=True)
  return np.asarray(logits)[..., :run.model_cfg.vocab_size]


def test_ids_are_the_source_tokenizers(source):
  _, hf_dir = source
  ours = tok_lib.load(hf_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
  texts = [t.replace('[MASK]', theirs.mask_token).replace('<mask>', theirs.mask_token)
           for t in TEXTS]
  assert ours.encode(texts) == theirs(texts, add_special_tokens=False)['input_ids']
  assert ours.specials.mask == theirs.mask_token_id
  assert ours.specials.pad == theirs.pad_token_id


@pytest.mark.slow
def test_weights_only_continuation_from_a_run(continued, corpus_glob, tmp_path):
  """config.init.workdir: the earlier run's weights at step 0, its tokenizer, a fresh optimizer."""
  variant, _, workdir, _, _ = continued
  config = micro_config(corpus_glob, str(tmp_path / 'data'))
  config.init.workdir = workdir
  config.train.num_steps = 1
  config.train.warmup_steps = 3  # Step 1 trains with learning rate 0.
  config.train.concurrent_chains = 1
  run_training(config, str(tmp_path / 'run'))
  _, before, _ = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'))
  _, after, _ = checkpoint.restore_params(str(tmp_path / 'run' / 'checkpoints'))
  import jax
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                          jax.tree_util.tree_leaves(after)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  with open(tmp_path / 'run' / 'config.json') as f:
    assert json.load(f)['model']['variant'] == variant


@pytest.mark.slow
def test_context_extension_of_a_published_modernbert(texts, corpus_glob, tmp_path):
  """Rows longer than the checkpoint's positions, a larger global rotary base, documents apart:
  ModernBERT's second phase. The weights start as published, the export carries the new
  length and base."""
  hf_dir = published.make_modernbert(str(tmp_path / 'modern'), texts)
  config = _config(corpus_glob, str(tmp_path / 'data'), hf_dir)
  config.data.seq_len = 128            # The checkpoint says 64 positions,
  config.model.max_position_embeddings = 8192   # which its value replaces unless overridden.
  config.train.num_steps = 2
  config.train.warmup_steps = 4        # Learning rate 0 at step 1: weights as published.
  config.train.eval_every = config.train.checkpoint_every = 1
  with pytest.raises(ConfigError, match=r'max_position_embeddings=128'):
    run_plan.resolve(config, 8)   # Rotary: the message says how to extend.
  config.model.max_position_embeddings = 128
  config.model.global_rope_theta = 160_000.0
  config.model.document_mask = True
  overrides = ['data.seq_len', 'model.max_position_embeddings', 'model.global_rope_theta',
               'model.document_mask']
  resolved = run_plan.resolve(config, 8, overrides=overrides).config
  assert resolved.model.global_rope_theta == 160_000.0 and resolved.model.local_rope_theta == 10_000
  run_training(config, str(tmp_path / 'run'), overrides)
  with open(tmp_path / 'run' / 'config.json') as f:
    saved = json.load(f)
  assert saved['data']['seq_len'] == 128 and saved['model']['max_position_embeddings'] == 128
  _, params, _ = checkpoint.restore_params(str(tmp_path / 'run' / 'checkpoints'), 1)
  model = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir)
  np.testing.assert_allclose(params['encoder']['embeddings']['token']['embedding'][:100],
                             model.model.embeddings.tok_embeddings.weight.detach().numpy()[:100],
                             atol=1e-6)
  from mlm_jax.training import workdir as workdir_lib
  workdir_lib.export_hf(str(tmp_path / 'run'), str(tmp_path / 'export'))
  exported = transformers.AutoConfig.from_pretrained(str(tmp_path / 'export'))
  assert exported.max_position_embeddings == 128
  thetas = json.dumps(exported.to_dict())
  assert '160000' in thetas


def test_the_rotary_base_is_the_recipes_and_a_bert_table_is_not_extended(bert_dir, corpus_glob,
                                                                         tmp_path):
  config = _config(corpus_glob, str(tmp_path / 'data'), bert_dir)
  config.data.seq_len = 128
  config.model.max_position_embeddings = 128
  config.masking.max_predictions = 20
  with pytest.raises(ConfigError, match='max_position_embeddings=128 contradicts'):
    run_plan.resolve(config, 8, overrides=['model.max_position_embeddings'])
  with pytest.raises(ConfigError, match='position table has that many rows'):
    run_plan.resolve(config, 8)


# ------------------------------------------------------------------ bad input


def _refused(config, tmp_path, match: str) -> None:
  with pytest.raises(ConfigError, match=match) as e:
    run_training(config, str(tmp_path / 'run'))
  assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'data'), 'refused after preparing data'


@pytest.fixture
def bert_dir(texts, tmp_path_factory) -> str:
  return published.make_bert(str(tmp_path_factory.mktemp('bert')), texts)


def test_a_contradicting_override_is_named(bert_dir, corpus_glob, tmp_path):
  config = _config(corpus_glob, str(tmp_path / 'data'), bert_dir)
  config.model.num_layers = 7
  with pytest.raises(ConfigError, match=r'config.model.num_layers=7 contradicts'):
    run_plan.resolve(config, 8, overrides=['model.num_layers'])
  # From the config file (not the command line), the checkpoint's value is taken.
  assert run_plan.resolve(config, 8).config.model.num_layers == 2


def test_seq_len_above_the_positions_is_refused(bert_dir, corpus_glob, tmp_path):
  config = _config(corpus_glob, str(tmp_path / 'data'), bert_dir)
  config.data.seq_len = 128
  config.model.max_position_embeddings = 512
  config.masking.max_predictions = 20
  _refused(config, tmp_path, r'seq_len=128 exceeds the 64 positions')


def test_a_directory_without_tokenizer_files_is_refused(bert_dir, corpus_glob, tmp_path):
  bare = tmp_path / 'bare'
  shutil.copytree(bert_dir, bare)
  for name in os.listdir(bare):
    if name.startswith(('tokenizer', 'vocab', 'special_tokens')):
      os.remove(bare / name)
  _refused(_config(corpus_glob, str(tmp_path / 'data'), str(bare)), tmp_path,
           'has no tokenizer files')


def as_pytorch_bin(hf_dir: str, out_dir: str, extra: dict | None = None) -> str:
  """A copy of `hf_dir` whose weights are only pytorch_model.bin (the tensors of its
  model.safetensors, plus `extra` entries), as checkpoints published before safetensors are."""
  from safetensors.torch import load_file
  shutil.copytree(hf_dir, out_dir)
  os.remove(os.path.join(out_dir, 'model.safetensors'))
  torch.save({**load_file(os.path.join(hf_dir, 'model.safetensors')), **(extra or {})},
             os.path.join(out_dir, 'pytorch_model.bin'))
  return out_dir


def as_hub_cache(hf_home: str, repo_id: str, hf_dir: str, revision: str = 'a1b2c3d4' * 5) -> str:
  """`hf_dir`'s files in a Hugging Face cache under `hf_home` as huggingface_hub lays out a
  download of `repo_id` (hub/models--org--name/snapshots/<commit>/, refs/main holding the
  commit); returns the commit."""
  repo = os.path.join(hf_home, 'hub', 'models--' + repo_id.replace('/', '--'))
  shutil.copytree(hf_dir, os.path.join(repo, 'snapshots', revision))
  os.makedirs(os.path.join(repo, 'refs'))
  with open(os.path.join(repo, 'refs', 'main'), 'w') as f:
    f.write(revision)
  return revision


def test_a_pytorch_bin_checkpoint_reads_as_its_safetensors(bert_dir, tmp_path):
  """Read with torch.load(weights_only=True): the same params as the safetensors copy."""
  from configs import base
  from mlm_jax.interop import hf
  bare = as_pytorch_bin(bert_dir, str(tmp_path / 'bin'))
  assert hf.checkpoint_model_fields(bare) == hf.checkpoint_model_fields(bert_dir)
  cfg = hf.load_hf_config(bert_dir, base.get_config().model)
  import jax
  for a, b in zip(jax.tree_util.tree_leaves(hf.load_hf_params(bert_dir, cfg)),
                  jax.tree_util.tree_leaves(hf.load_hf_params(bare, cfg))):
    np.testing.assert_array_equal(a, b)


def test_a_pytorch_bin_needing_more_than_tensors_is_refused(bert_dir, corpus_glob, tmp_path):
  """A pickled object (here the training arguments) would run code to load: refused, with a
  conversion command that leaves a complete directory (tokenizer files copied)."""
  import argparse
  import subprocess
  import sys
  bare = as_pytorch_bin(bert_dir, str(tmp_path / 'bin'), {'args': argparse.Namespace(lr=1e-4)})
  with pytest.raises(ConfigError, match='holds more than tensors') as e:
    run_training(_config(corpus_glob, str(tmp_path / 'data'), bare), str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not os.path.exists(tmp_path / 'data')
  command = str(e.value).split('with that file: ', 1)[1].replace('OUT_DIR', str(tmp_path / 'out'))
  assert command.startswith('python -c ')
  subprocess.run([sys.executable, '-c', command[len('python -c "'):-1]], check=True)
  for name in os.listdir(bert_dir):
    if name != 'model.safetensors':
      with open(os.path.join(bert_dir, name), 'rb') as a, open(tmp_path / 'out' / name, 'rb') as b:
        assert a.read() == b.read(), name
  assert run_plan.resolve(_config(corpus_glob, str(tmp_path / 'data'), str(tmp_path / 'out')),
                          8).config.model.num_layers == 2


@pytest.mark.parametrize('kind', ['truncated safetensors', 'truncated bin', 'corrupt bin'])
def test_a_broken_download_is_named_in_one_line(kind, bert_dir, corpus_glob, tmp_path):
  broken = str(tmp_path / 'broken')
  if kind.endswith('bin'):
    as_pytorch_bin(bert_dir, broken)
  else:
    shutil.copytree(bert_dir, broken)
  name = 'model.safetensors' if kind.endswith('safetensors') else 'pytorch_model.bin'
  path = os.path.join(broken, name)
  with open(path, 'rb') as f:
    raw = f.read()
  with open(path, 'wb') as f:
    f.write(raw[:len(raw) // 2] if kind.startswith('truncated')
            else raw[:64] + bytes(len(raw) - 64))
  _refused(_config(corpus_glob, str(tmp_path / 'data'), broken), tmp_path,
           f'{name} is truncated or corrupt .*: download it again')


def _offline_cache(monkeypatch, hf_home: str) -> None:
  """huggingface_hub reading only the cache under `hf_home`, as with HF_HOME and
  HF_HUB_OFFLINE=1 (set on its constants: it read the environment when imported)."""
  from huggingface_hub import constants
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', os.path.join(hf_home, 'hub'))
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')


def test_a_hub_id_resolves_from_the_cache_offline_and_is_pinned(bert_dir, corpus_glob, tmp_path,
                                                                monkeypatch):
  _offline_cache(monkeypatch, str(tmp_path / 'hf'))
  revision = as_hub_cache(str(tmp_path / 'hf'), 'example-org/bert-mini', bert_dir)
  for hf_dir in ('example-org/bert-mini', f'example-org/bert-mini@{revision}'):
    resolved = run_plan.resolve(_config(corpus_glob, str(tmp_path / 'data'), hf_dir), 8).config
    # The run's config.json records the commit the id resolved to.
    assert resolved.init.hf_dir == f'example-org/bert-mini@{revision}'
    assert resolved.model.num_layers == 2 and resolved.model.vocab_size == 400
    assert resolved.tokenizer.model_file.startswith(str(tmp_path / 'hf' / 'hub'))
  from mlm_jax.finetuning import pretrained
  encoder = pretrained.from_hf_dir('example-org/bert-mini')
  assert encoder.source == {'hf_dir': f'example-org/bert-mini@{revision}'}
  assert encoder.model_cfg.num_layers == 2
  # A local directory of the same name wins over the hub id.
  monkeypatch.chdir(tmp_path)
  shutil.copytree(bert_dir, tmp_path / 'example-org' / 'bert-mini')
  resolved = run_plan.resolve(_config(corpus_glob, str(tmp_path / 'data'),
                                      'example-org/bert-mini'), 8).config
  assert resolved.init.hf_dir == 'example-org/bert-mini'


def test_a_hub_id_not_cached_offline_names_the_download(bert_dir, corpus_glob, tmp_path,
                                                         monkeypatch):
  _offline_cache(monkeypatch, str(tmp_path / 'hf'))
  _refused(_config(corpus_glob, str(tmp_path / 'data'), 'example-org/absent@v1'), tmp_path,
           r'not in the Hugging Face cache .*`hf download example-org/absent --revision v1`')
  _refused(_config(corpus_glob, str(tmp_path / 'data'), './no/such'), tmp_path,
           'no such directory, nor a hub id')
  from mlm_jax.finetuning import pretrained
  with pytest.raises(ConfigError, match='hf download example-org/absent'):
    pretrained.from_hf_dir('example-org/absent')


def test_an_unknown_model_type_is_refused(bert_dir, corpus_glob, tmp_path):
  other = tmp_path / 'gpt'
  shutil.copytree(bert_dir, other)
  with open(other / 'config.json') as f:
    hf = json.load(f)
  hf['model_type'] = 'gpt2'
  with open(other / 'config.json', 'w') as f:
    json.dump(hf, f)
  _refused(_config(corpus_glob, str(tmp_path / 'data'), str(other)), tmp_path,
           "model_type='gpt2' is not supported")


def test_a_tokenizer_without_a_mask_token_is_refused(bert_dir, corpus_glob, tmp_path):
  other = tmp_path / 'nomask'
  shutil.copytree(bert_dir, other)
  spec = json.loads((other / 'tokenizer.json').read_text())
  spec['added_tokens'] = [t for t in spec['added_tokens'] if t['content'] != '[MASK]']
  del spec['model']['vocab']['[MASK]']
  (other / 'tokenizer.json').write_text(json.dumps(spec))
  config = json.loads((other / 'tokenizer_config.json').read_text())
  config.pop('mask_token', None)
  config['added_tokens_decoder'] = {k: v for k, v in config.get('added_tokens_decoder', {}).items()
                                    if v['content'] != '[MASK]'}
  (other / 'tokenizer_config.json').write_text(json.dumps(config))
  os.remove(other / 'special_tokens_map.json')
  _refused(_config(corpus_glob, str(tmp_path / 'data'), str(other)), tmp_path,
           'has no mask token')


def test_a_tokenizer_larger_than_the_table_is_refused(bert_dir, texts, corpus_glob, tmp_path):
  bigger = published.make_bert(str(tmp_path / 'bigger'), texts, vocab_size=700)
  other = tmp_path / 'mixed'
  shutil.copytree(bert_dir, other)
  for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'vocab.txt'):
    if os.path.exists(os.path.join(bigger, name)):
      shutil.copy(os.path.join(bigger, name), other / name)
  _refused(_config(corpus_glob, str(tmp_path / 'data'), str(other)), tmp_path,
           'do not belong together')


# ------------------------------------------------------- vocabulary extension


@pytest.mark.slow
@pytest.mark.parametrize('variant', ['bert', 'roberta'])
def test_added_words_are_whole_tokens_in_and_out(variant, texts, corpus_glob, tmp_path):
  """add_tokens: new ids after the table, rows = the mean of the old pieces' rows, the export's
  tokenizer and model carry them (BERT grows its table to a multiple of 64)."""
  hf_dir = published.MAKERS[variant](str(tmp_path / 'src'), texts)
  words = ['hyperparameterization', 'Straßenbahnhaltestelle', 'zygomorphic']
  (tmp_path / 'words.txt').write_text('\n'.join(words) + '\n')
  config = _config(corpus_glob, str(tmp_path / 'data'), hf_dir)
  config.tokenizer.add_tokens = str(tmp_path / 'words.txt')
  config.train.num_steps = 1
  config.train.warmup_steps = 3  # Step 1 trains with learning rate 0: rows as initialised.
  run_training(config, str(tmp_path / 'run'))
  from mlm_jax.training import workdir as workdir_lib
  out = str(tmp_path / 'export')
  workdir_lib.export_hf(str(tmp_path / 'run'), out)
  source = transformers.AutoTokenizer.from_pretrained(hf_dir)
  exported = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForMaskedLM.from_pretrained(out)
  original = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir)
  old = original.get_input_embeddings().weight.detach().numpy()
  new = model.get_input_embeddings().weight.detach().numpy()
  # The table grew by exactly the added words: vocab_size is len(tokenizer), as transformers'
  # resize_token_embeddings(len(tokenizer)) gives.
  assert model.config.vocab_size == len(exported) >= len(source) + 3
  np.testing.assert_array_equal(new[:len(old)], old)
  for word in words:
    sentence = f'the {word} is'
    ids = exported(sentence, add_special_tokens=False)['input_ids']
    (new_id,) = [i for i in ids if i >= len(source)]
    assert exported.convert_ids_to_tokens(new_id) == (word.lower() if variant == 'bert' else word)
    pieces = source(word if variant == 'bert' else ' ' + word,
                    add_special_tokens=False)['input_ids']
    np.testing.assert_allclose(new[new_id], old[pieces].mean(axis=0), rtol=1e-6, atol=1e-7)
  assert exported(' '.join(words))['input_ids'] != source(' '.join(words))['input_ids']
