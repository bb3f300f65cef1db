"""Hugging Face directories in the layouts of published checkpoints, built offline.

Not a test module: helpers for tests that start from a "published" model.
Each maker trains a small tokenizer on `texts`, saves it with transformers'
own tokenizer class (`save_pretrained`: tokenizer.json, tokenizer_config.json,
special_tokens_map.json, as the hub has them) and saves a small
random-weight masked LM next to it (`save_pretrained`: config.json and
model.safetensors). What must stay true, per layout:

  make_bert       bert-base-uncased: lowercase WordPiece, [PAD]=0,
                  [unused0..98]=1..99, [UNK]=100, [CLS]=101, [SEP]=102,
                  [MASK]=103, '##' continuations; BertForMaskedLM with 2
                  token types and pad_token_id 0.
  make_roberta    roberta-base: byte-level BPE, <s>=0 <pad>=1 </s>=2 <unk>=3,
                  <mask> the last id with lstrip; RobertaForMaskedLM with
                  max_position_embeddings = positions + 2 (514-style: ids
                  start at padding_idx + 1), type_vocab_size 1, eps 1e-5.
  make_modernbert ModernBERT: byte-level BPE pieces first, then the added
                  tokens in ModernBERT's order (|||IP_ADDRESS|||,
                  <|endoftext|>, [UNK], [CLS], [SEP], [PAD], [MASK]), [MASK]
                  lstrip; ModernBertForMaskedLM whose vocab_size is the
                  tokenizer's rounded up to a multiple of 64 (as 50368 > 50285).
  make_xlm_roberta xlm-roberta-base: a sentencepiece unigram model
                  (sentencepiece.bpe.model, nmt_nfkc) and its tokenizer.json; ids
                  <s>=0 <pad>=1 </s>=2 <unk>=3, the pieces after them (fairseq's
                  offset of 1), <mask> last with lstrip; XLMRobertaForMaskedLM
                  (model_type xlm-roberta) as RoBERTa's config.
  make_camembert  camembert-base: the same with CamemBERT's ids <s>NOTUSED=0
                  <pad>=1 </s>NOTUSED=2 <unk>=3 <unk>NOTUSED=4 <s>=5 </s>=6 (offset
                  4), <mask> last; CamembertForMaskedLM, bos 5, eos 6.
  make_bert_cased bert-base-cased: make_bert's ids, WordPiece without lowercasing
                  or accent stripping (do_lower_case false).
  make_distilbert distilbert-base-uncased: bert-base-uncased's tokenizer as
                  DistilBertTokenizer; DistilBertForMaskedLM (no token types).
  make_mmbert     mmBERT (jhu-clsp/mmBERT-base): Gemma's tokenizer, a BPE over
                  '▁'-spelled spaces with byte fallback (<0x00>..<0xFF> pieces),
                  <pad>=0 <eos>=1 <bos>=2 <unk>=3 <mask>=4 (lstrip), '<bos> $A
                  <eos>' around a text, saved by GemmaTokenizer (tokenizer.json,
                  tokenizer_class GemmaTokenizer); ModernBertForMaskedLM whose
                  table is the tokenizer's size (as 256000), cls = bos, sep = eos.

Every weight is perturbed after initialisation (norms and biases too), so a
conversion that drops or misplaces any tensor changes the logits. Needs
torch, transformers and tokenizers; models are float32 with eager attention.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

import tokenizers as tk

from mlm_jax.data import corpus

# bert-base-uncased's special tokens, in id order 0..103 (the rest of its
# 994 [unusedN] tokens come after the specials and are not reproduced).
BERT_SPECIALS = ('[PAD]', *(f'[unused{i}]' for i in range(99)), '[UNK]', '[CLS]', '[SEP]',
                 '[MASK]')
ROBERTA_FIRST = ('<s>', '<pad>', '</s>', '<unk>')
# ModernBERT's added tokens after its BPE pieces, in id order (50254, 50279, 50280...50284).
MODERNBERT_ADDED = ('|||IP_ADDRESS|||', '<|endoftext|>', '[UNK]', '[CLS]', '[SEP]', '[PAD]',
                    '[MASK]')
MODERNBERT_SPECIAL_ADDED = MODERNBERT_ADDED[1:]
# Small model shapes, overridable through **model_kw.
_SMALL = {'hidden_size': 32, 'num_hidden_layers': 2, 'num_attention_heads': 2,
          'intermediate_size': 64}


def _perturb(model, seed: int) -> None:
  """Every parameter replaced by noise around its initial value (norm weights stay near 1)."""
  import torch  # pylint: disable=import-outside-toplevel
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      base = 1.0 if ('norm' in name.lower() and name.endswith('weight')) else 0.0
      p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + base)


def _save_tokenizer(tokenizer, directory: str, tokenizer_class: str | None = None) -> None:
  """save_pretrained, plus the special_tokens_map.json the hub's copies carry (transformers 5
  no longer writes it) and, if given, the hub's tokenizer_class."""
  tokenizer.save_pretrained(directory)
  added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
  special_map = {}
  for key, value in tokenizer.special_tokens_map.items():
    token = added.get(str(value))
    special_map[key] = str(value) if token is None else {
        'content': token.content, 'lstrip': token.lstrip, 'normalized': token.normalized,
        'rstrip': token.rstrip, 'single_word': token.single_word}
  with open(os.path.join(directory, 'special_tokens_map.json'), 'w') as f:
    json.dump(special_map, f, indent=2)
  if tokenizer_class:
    path = os.path.join(directory, 'tokenizer_config.json')
    with open(path) as f:
      config = json.load(f)
    config['tokenizer_class'] = tokenizer_class
    with open(path, 'w') as f:
      json.dump(config, f, indent=2)


def _save_model(directory: str, config, architecture: str, seed: int) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  model = getattr(transformers, architecture)(config).eval()
  _perturb(model, seed)
  model.tie_weights()
  model.save_pretrained(directory)  # safetensors by default.


def _model_fields(model_kw: dict[str, Any], **defaults) -> dict[str, Any]:
  fields = {**_SMALL, 'hidden_dropout_prob': 0.0, 'attention_probs_dropout_prob': 0.0,
            **defaults}
  fields.update(model_kw)
  return fields


def _bpe_vocab_merges(texts: Sequence[str], vocab_size: int, lowercase: bool = False,
                      special_tokens: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple]]:
  """A byte-level BPE (as GPT-2/RoBERTa's) trained on `texts`: its vocab and merges."""
  model = tk.Tokenizer(tk.models.BPE())
  if lowercase:
    model.normalizer = tk.normalizers.Lowercase()
  model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                   show_progress=False)
  model.train_from_iterator(list(texts), trainer)
  spec = json.loads(model.to_str())['model']
  merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m) for m in spec['merges']]
  return dict(spec['vocab']), merges


def _wordpiece(texts: Sequence[str], vocab_size: int, cased: bool = False) -> dict[str, int]:
  """bert-base-(un)cased's WordPiece vocabulary trained on `texts`: its specials first."""
  trained = tk.Tokenizer(tk.models.WordPiece(unk_token='[UNK]'))
  trained.normalizer = (tk.normalizers.BertNormalizer(lowercase=False, strip_accents=False)
                        if cased else tk.normalizers.BertNormalizer(lowercase=True))
  trained.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
  # The trainer numbers its characters and their '##' continuations in hash order, which
  # changes from process to process, and breaks ties between merges by those numbers
  # (huggingface/tokenizers#1794): given in sorted order, as mlm_jax's own WordPiece training
  # gives them (data/hf_tokenizer.py), the same texts give the same vocabulary every time.
  alphabet = sorted({c for text in texts for c in trained.normalizer.normalize_str(text)
                     if not c.isspace()})
  trainer = tk.trainers.WordPieceTrainer(
      vocab_size=vocab_size, special_tokens=[*BERT_SPECIALS, *(f'##{c}' for c in alphabet)],
      initial_alphabet=alphabet, continuing_subword_prefix='##', show_progress=False)
  trained.train_from_iterator(list(texts), trainer)
  return trained.get_vocab()


def make_bert(directory: str, texts: Sequence[str], vocab_size: int = 400, seed: int = 0,
              cased: bool = False, **model_kw) -> str:
  """bert-base-uncased's layout (bert-base-cased's with `cased`) in `directory` (a small
  BertForMaskedLM); returns it.

  model_kw: BertConfig fields (default 2 layers, width 32, 64 positions).
  """
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  vocab = _wordpiece(texts, vocab_size, cased)
  assert [vocab[t] for t in BERT_SPECIALS] == list(range(len(BERT_SPECIALS)))
  tokenizer = transformers.BertTokenizerFast(vocab=vocab, do_lower_case=not cased,
                                             model_max_length=512)
  _save_tokenizer(tokenizer, directory)
  fields = _model_fields(model_kw, max_position_embeddings=64, type_vocab_size=2,
                         layer_norm_eps=1e-12, hidden_act='gelu')
  config = transformers.BertConfig(vocab_size=len(vocab), pad_token_id=0, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config, 'BertForMaskedLM', seed)
  return directory


def make_roberta(directory: str, texts: Sequence[str], vocab_size: int = 500, seed: int = 0,
                 **model_kw) -> str:
  """roberta-base's layout in `directory` (a small RobertaForMaskedLM); returns it.

  model_kw: RobertaConfig fields; max_position_embeddings counts RoBERTa's
  two offset rows (default 66: 64 usable positions).
  """
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  vocab, merges = _bpe_vocab_merges(texts, vocab_size - 1, special_tokens=ROBERTA_FIRST)
  assert [vocab[t] for t in ROBERTA_FIRST] == [0, 1, 2, 3]
  vocab['<mask>'] = len(vocab)  # roberta-base's vocab.json ends with it (50264).
  tokenizer = transformers.RobertaTokenizerFast(
      vocab=vocab, merges=merges, model_max_length=512,
      mask_token=tk.AddedToken('<mask>', lstrip=True, rstrip=False, special=True,
                               normalized=False))
  _save_tokenizer(tokenizer, directory)
  fields = _model_fields(model_kw, max_position_embeddings=66, type_vocab_size=1,
                         layer_norm_eps=1e-5, hidden_act='gelu')
  config = transformers.RobertaConfig(vocab_size=len(vocab), pad_token_id=1, bos_token_id=0,
                                      eos_token_id=2, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config, 'RobertaForMaskedLM', seed)
  return directory


def make_modernbert(directory: str, texts: Sequence[str], vocab_size: int = 500, seed: int = 0,
                    **model_kw) -> str:
  """ModernBERT's layout in `directory` (a small ModernBertForMaskedLM); returns it.

  model_kw: ModernBertConfig fields (default 2 layers, width 32, 64 positions,
  local window 16, every 2nd layer global).
  """
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  vocab, merges = _bpe_vocab_merges(texts, vocab_size - len(MODERNBERT_ADDED))
  model = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges))
  model.normalizer = tk.normalizers.NFC()
  model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                    use_regex=True)
  model.decoder = tk.decoders.ByteLevel()
  model.add_tokens([tk.AddedToken(MODERNBERT_ADDED[0], normalized=True)])
  model.add_special_tokens([
      tk.AddedToken(t, special=True, normalized=False, lstrip=t == '[MASK]')
      for t in MODERNBERT_SPECIAL_ADDED])
  cls, sep = model.token_to_id('[CLS]'), model.token_to_id('[SEP]')
  model.post_processor = tk.processors.TemplateProcessing(
      single='[CLS]:0 $A:0 [SEP]:0', pair='[CLS]:0 $A:0 [SEP]:0 $B:0 [SEP]:0',
      special_tokens=[('[CLS]', cls), ('[SEP]', sep)])
  n = len(vocab)
  assert [model.token_to_id(t) for t in MODERNBERT_ADDED] == list(range(n, n + 7))
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=model, model_max_length=8192, clean_up_tokenization_spaces=True,
      unk_token='[UNK]', cls_token='[CLS]', sep_token='[SEP]', pad_token='[PAD]',
      mask_token='[MASK]', model_input_names=['input_ids', 'attention_mask'])
  # The hub's ModernBERT tokenizer_config.json names the generic fast class.
  _save_tokenizer(tokenizer, directory, 'PreTrainedTokenizerFast')
  tokens = n + len(MODERNBERT_ADDED)
  fields = {**_SMALL, 'max_position_embeddings': 64, 'local_attention': 16,
            'global_attn_every_n_layers': 2, 'embedding_dropout': 0.0, 'mlp_dropout': 0.0,
            'attention_dropout': 0.0, 'norm_eps': 1e-5, **model_kw}
  config = transformers.ModernBertConfig(
      vocab_size=-(-tokens // 64) * 64, pad_token_id=model.token_to_id('[PAD]'),
      bos_token_id=cls, eos_token_id=sep, cls_token_id=cls, sep_token_id=sep, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config, 'ModernBertForMaskedLM', seed)
  return directory


def _sentencepiece(texts: Sequence[str], vocab_size: int) -> tuple[bytes, list, bytes]:
  """A sentencepiece unigram model trained on `texts` (<unk>=0 <s>=1 </s>=2, no pad, as
  XLM-R's and CamemBERT's): its bytes, its (piece, score) list and its normalizer's
  precompiled charsmap."""
  import io  # pylint: disable=import-outside-toplevel

  import sentencepiece as spm  # pylint: disable=import-outside-toplevel

  from mlm_jax.data import sp_tokenizer  # pylint: disable=import-outside-toplevel
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=out, vocab_size=vocab_size, model_type='unigram',
      character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
  proto = sp_tokenizer._model_proto_module().ModelProto()  # pylint: disable=protected-access
  proto.ParseFromString(out.getvalue())
  pieces = [(p.piece, p.score) for p in proto.pieces]
  assert [p for p, _ in pieces[:3]] == ['<unk>', '<s>', '</s>']
  return out.getvalue(), pieces, proto.normalizer_spec.precompiled_charsmap


def _make_sentencepiece_roberta(directory: str, texts: Sequence[str], vocab_size: int, seed: int,
                                model_kw: dict[str, Any], camembert: bool) -> str:
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  model_bytes, pieces, charsmap = _sentencepiece(texts, vocab_size)
  if camembert:  # fairseq's 4 tokens, then every sentencepiece id (its <unk> unused).
    vocab = [('<s>NOTUSED', 0.0), ('<pad>', 0.0), ('</s>NOTUSED', 0.0), ('<unk>', 0.0),
             ('<unk>NOTUSED', -100.0), *pieces[1:], ('<mask>', 0.0)]
    cls = transformers.CamembertTokenizerFast
  else:  # <s> <pad> </s> <unk>, then sentencepiece's ids from 3 (offset 1).
    vocab = [('<s>', 0.0), ('<pad>', 0.0), ('</s>', 0.0), ('<unk>', 0.0), *pieces[3:],
             ('<mask>', 0.0)]
    cls = transformers.XLMRobertaTokenizerFast
  tokenizer = cls(vocab=vocab, _spm_precompiled_charsmap=charsmap, model_max_length=512)
  tokenizer.save_pretrained(directory)
  with open(os.path.join(directory, 'sentencepiece.bpe.model'), 'wb') as f:
    f.write(model_bytes)  # The hub's copies carry the sentencepiece model beside tokenizer.json.
  fields = _model_fields(model_kw, max_position_embeddings=66, type_vocab_size=1,
                         layer_norm_eps=1e-5, hidden_act='gelu')
  ids = {'bos_token_id': tokenizer.bos_token_id, 'eos_token_id': tokenizer.eos_token_id}
  config_cls = transformers.CamembertConfig if camembert else transformers.XLMRobertaConfig
  config = config_cls(vocab_size=len(vocab), pad_token_id=1, **ids, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config,
              'CamembertForMaskedLM' if camembert else 'XLMRobertaForMaskedLM', seed)
  return directory


def make_xlm_roberta(directory: str, texts: Sequence[str], vocab_size: int = 400, seed: int = 0,
                     **model_kw) -> str:
  """xlm-roberta-base's layout in `directory` (a small XLMRobertaForMaskedLM); returns it.

  vocab_size: the sentencepiece model's pieces (the tokenizer has 2 more: <pad>, <mask>).
  """
  return _make_sentencepiece_roberta(directory, texts, vocab_size, seed, model_kw, False)


def make_camembert(directory: str, texts: Sequence[str], vocab_size: int = 400, seed: int = 0,
                   **model_kw) -> str:
  """camembert-base's layout in `directory` (a small CamembertForMaskedLM); returns it."""
  return _make_sentencepiece_roberta(directory, texts, vocab_size, seed, model_kw, True)


def make_bert_cased(directory: str, texts: Sequence[str], vocab_size: int = 400, seed: int = 0,
                    **model_kw) -> str:
  """bert-base-cased's layout in `directory` (a small BertForMaskedLM); returns it."""
  return make_bert(directory, texts, vocab_size, seed, cased=True, **model_kw)


def make_distilbert(directory: str, texts: Sequence[str], vocab_size: int = 400, seed: int = 0,
                    **model_kw) -> str:
  """distilbert-base-uncased's layout in `directory` (a small DistilBertForMaskedLM).

  model_kw: DistilBertConfig fields (default 2 layers, width 32, 64 positions).
  """
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  vocab = _wordpiece(texts, vocab_size)
  tokenizer = transformers.DistilBertTokenizerFast(vocab=vocab, do_lower_case=True,
                                                   model_max_length=512)
  _save_tokenizer(tokenizer, directory)
  fields = {'dim': 32, 'n_layers': 2, 'n_heads': 2, 'hidden_dim': 64,
            'max_position_embeddings': 64, 'dropout': 0.0, 'attention_dropout': 0.0, **model_kw}
  config = transformers.DistilBertConfig(vocab_size=len(vocab), pad_token_id=0, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config, 'DistilBertForMaskedLM', seed)
  return directory


# Gemma's first ids (mmBERT keeps them: pad 0, eos/sep 1, bos/cls 2, mask 4), then its
# 256 byte-fallback pieces (Gemma has them after its unused tokens, not at 5..260).
GEMMA_SPECIALS = ('<pad>', '<eos>', '<bos>', '<unk>', '<mask>')
GEMMA_BYTES = tuple(f'<0x{b:02X}>' for b in range(256))


def make_mmbert(directory: str, texts: Sequence[str], vocab_size: int = 600, seed: int = 0,
                **model_kw) -> str:
  """mmBERT's layout in `directory` (a small ModernBertForMaskedLM over a Gemma-style
  tokenizer); returns it.

  vocab_size: the tokenizer's ids, specials and byte pieces included (at least 262).
  model_kw: ModernBertConfig fields, as make_modernbert.
  """
  import transformers  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  # Trained with words split at '▁' (as sentencepiece's BPE that Gemma's pieces come from);
  # the saved tokenizer is Gemma's pipeline: spaces to '▁', no word split, byte fallback.
  trained = tk.Tokenizer(tk.models.BPE(unk_token='<unk>', byte_fallback=True, fuse_unk=True))
  trained.normalizer = tk.normalizers.Replace(' ', '\u2581')
  trained.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme='never', split=True)
  trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size,
                                   special_tokens=[*GEMMA_SPECIALS, *GEMMA_BYTES],
                                   limit_alphabet=100, show_progress=False)
  trained.train_from_iterator(list(texts), trainer)
  spec = json.loads(trained.to_str())['model']
  vocab = dict(spec['vocab'])
  merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m) for m in spec['merges']]
  assert [vocab[t] for t in (*GEMMA_SPECIALS, *GEMMA_BYTES)] == list(range(261))
  tokenizer = transformers.GemmaTokenizer(
      vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=True, model_max_length=8192,
      mask_token=tk.AddedToken('<mask>', lstrip=True, rstrip=False, special=True,
                               normalized=False))
  _save_tokenizer(tokenizer, directory)
  fields = {**_SMALL, 'max_position_embeddings': 64, 'local_attention': 16,
            'global_attn_every_n_layers': 2, 'embedding_dropout': 0.0, 'mlp_dropout': 0.0,
            'attention_dropout': 0.0, 'norm_eps': 1e-5, **model_kw}
  config = transformers.ModernBertConfig(
      vocab_size=len(vocab), pad_token_id=0, bos_token_id=2, eos_token_id=1, cls_token_id=2,
      sep_token_id=1, **fields)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _save_model(directory, config, 'ModernBertForMaskedLM', seed)
  return directory


MAKERS = {'bert': make_bert, 'roberta': make_roberta, 'modern': make_modernbert}
# More published layouts, each exported as its own class and tokenizer (tests/test_layouts.py).
MORE_MAKERS = {'bert-cased': make_bert_cased, 'xlm-roberta': make_xlm_roberta,
               'camembert': make_camembert, 'distilbert': make_distilbert,
               'mmbert': make_mmbert}


def sample_texts(num_docs: int = 300) -> list[str]:
  """Training text for the tokenizers above: stdlib docstrings and some non-ASCII lines."""
  return [*itertools.islice(corpus.stdlib_docstrings(), num_docs),
          'café naïve Straße — 日本語 😀 Ωµ ﬁ ①', 'Ünïcödé façade, coöperate, 東京 and 🤖 robots']
