"""Hugging Face `tokenizers`: a published tokenizer.json or vocab.txt, or one trained here.

The only module that imports `tokenizers` (also for exporting a
sentencepiece tokenizer as a tokenizer.json: `from_sentencepiece`). A
tokenizer read from a directory
keeps that directory's tokenizer files byte for byte (`files`) and writes
them back unchanged, so an export carries the source's tokenizer rather than
a re-derived one; only tokens added here (`add_tokens`) rewrite
tokenizer.json and tokenizer_config.json.

Special tokens are found by role in tokenizer_config.json (or
special_tokens_map.json): `pad_token`, `unk_token`, `cls_token` (else
`bos_token`), `sep_token` (else `eos_token`), `mask_token`; a file without
them falls back to the usual spellings ([PAD] / <pad>, ...).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tokenizers as tk

from mlm_jax.data import paths
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer_base as tok_lib

# The files of a Hugging Face tokenizer directory that are carried along (an export
# writes them back: XLM-R's and CamemBERT's slow tokenizers read sentencepiece.bpe.model).
FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'vocab.txt',
         'vocab.json', 'merges.txt', 'added_tokens.json', 'sentencepiece.bpe.model')
_FALLBACK_NAMES = {
    'pad': ('[PAD]', '<pad>'), 'unk': ('[UNK]', '<unk>'), 'cls': ('[CLS]', '<s>'),
    'sep': ('[SEP]', '</s>'), 'mask': ('[MASK]', '<mask>'),
}
_ALTERNATIVE_KEYS = {'cls': 'bos_token', 'sep': 'eos_token'}
_KINDS = {'WordPiece': 'wordpiece', 'BPE': 'bpe', 'Unigram': 'unigram', 'WordLevel': 'wordlevel'}


def _content(value: Any) -> str | None:
  """A special token's string in tokenizer_config.json: a string or {'content': ...}."""
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


class HFTokenizer(tok_lib.Tokenizer):
  """A `tokenizers.Tokenizer` with its special ids by role and its directory's files."""

  def __init__(self, tokenizer: tk.Tokenizer, files: dict[str, bytes], source: str):
    self._tk = tokenizer
    self.files = dict(files)  # name -> bytes, written back by save().
    self.source = source
    spec = json.loads(tokenizer.to_str())
    self.kind = _KINDS.get(spec['model']['type'], spec['model']['type'].lower())
    self._spec = spec
    # Ids may leave gaps (a vocabulary with holes): the table must reach the largest.
    self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    self.specials = self._find_specials()

  # ------------------------------------------------------------------ loading

  @classmethod
  def from_path(cls, path: str) -> HFTokenizer:
    """A tokenizer.json or a WordPiece vocab.txt (a local path or a bucket URL), with the
    tokenizer files beside it; all are read into memory, where `tokenizers` loads them from."""
    directory, files = directory_of(path), {}
    for name in FILES:
      p = paths.join(directory, name)
      if paths.isfile(p):
        with paths.open_binary(p) as f:
          files[name] = f.read()
    if os.path.basename(path) == 'tokenizer.json':
      try:
        tokenizer = tk.Tokenizer.from_str(files['tokenizer.json'].decode())
      except Exception as e:  # tokenizers raises a plain Exception for a malformed file.
        raise ValueError(f'{path} is not a tokenizers tokenizer.json: {e}') from e
    elif os.path.basename(path) == 'vocab.txt':
      config = json.loads(files.get('tokenizer_config.json', b'{}'))
      tokenizer = _wordpiece_from_vocab(files['vocab.txt'], config.get('do_lower_case', True))
    else:
      raise ValueError(f'{path}: not a tokenizer.json or vocab.txt.')
    return cls(tokenizer, files, source=path)

  def _config(self) -> dict[str, Any]:
    out = {}
    for name in ('special_tokens_map.json', 'tokenizer_config.json'):  # The latter wins.
      if name in self.files:
        out.update(json.loads(self.files[name]))
    return out

  def _find_specials(self) -> tok_lib.Specials:
    config, ids, tokens = self._config(), {}, []
    for role in tok_lib.ROLES:
      names = [_content(config.get(f'{role}_token'))]
      if role in _ALTERNATIVE_KEYS:
        names.append(_content(config.get(_ALTERNATIVE_KEYS[role])))
      names += list(_FALLBACK_NAMES[role])
      found = [(n, self._tk.token_to_id(n)) for n in names if n]
      found = [(n, i) for n, i in found if i is not None]
      if not found:
        raise ValueError(
            f'{self.source}: the tokenizer has no {role} token '
            f'({role}_token in tokenizer_config.json, or one of '
            f'{", ".join(_FALLBACK_NAMES[role])} in its vocabulary). '
            + ('Masked language modelling needs one: add it (e.g. '
               "tokenizer.add_special_tokens({'mask_token': '[MASK]'}) in transformers) and "
               'grow the model\'s embeddings to match.' if role == 'mask' else
               'Add it to tokenizer_config.json.'))
      tokens.append(found[0][0])
      ids[role] = found[0][1]
    return tok_lib.Specials(**ids, tokens=tuple(tokens))

  # ---------------------------------------------------------------- interface

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  def encode(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    del num_threads  # tokenizers sizes its own thread pool (RAYON_NUM_THREADS).
    return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

  def encode_documents(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    self._tk.encode_special_tokens = True  # '<mask>' in a document is text, not the token.
    try:
      return self.encode(texts, num_threads)
    finally:
      self._tk.encode_special_tokens = False

  def decode(self, ids: Iterable[int]) -> str:
    return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

  def id_to_piece(self, i: int) -> str:
    return self._tk.id_to_token(int(i)) or ''

  def special_ids(self) -> np.ndarray:
    added = [i for i, t in self._tk.get_added_tokens_decoder().items() if t.special]
    return np.unique(np.asarray([*self.specials.ids, *added], np.int64))

  def word_start_mask(self) -> np.ndarray:
    """[vocab] bool. WordPiece: pieces without the continuation prefix ('##'); byte-level BPE:
    pieces that begin with 'Ġ' (a space); sentencepiece-style (Metaspace, or a normalizer that
    spells spaces '▁', as Gemma's): with '▁'. Added and
    special tokens are whole words."""
    pieces = self.pieces()
    model, pre = self._spec['model'], json.dumps(self._spec.get('pre_tokenizer'))
    if model['type'] == 'WordPiece':
      prefix = model.get('continuing_subword_prefix') or '##'
      starts = np.array([not p.startswith(prefix) for p in pieces], bool)
    elif '"ByteLevel"' in pre:
      starts = np.array([p.startswith('\u0120') for p in pieces], bool)
    elif '"Metaspace"' in pre or '\u2581' in json.dumps(self._spec.get('normalizer'),
                                                     ensure_ascii=False):
      # Metaspace, or spaces spelled '▁' by the normalizer (Gemma's, mmBERT's).
      starts = np.array([p.startswith('\u2581') for p in pieces], bool)
    else:  # Words split by the pre-tokenizer alone: every piece is one.
      starts = np.ones(len(pieces), bool)
    added = list(self._tk.get_added_tokens_decoder())
    starts[[i for i in added if i < len(starts)]] = True
    return starts

  def save(self, directory: str) -> str:
    for name, data in self.files.items():
      with paths.open_write(paths.join(directory, name)) as f:
        f.write(data)
    return paths.join(directory, 'tokenizer.json' if 'tokenizer.json' in self.files
                      else 'vocab.txt')

  def digest(self) -> str:
    h = hashlib.sha256()
    for name in sorted(self.files):
      h.update(name.encode() + b'\0' + hashlib.sha256(self.files[name]).digest())
    return h.hexdigest()

  # ------------------------------------------------------- vocabulary extension

  def add_tokens(self, words: Sequence[str]) -> tuple[HFTokenizer, dict[int, list[int]]]:
    """A copy with `words` added as whole tokens, and each new id's pieces in this tokenizer.

    Words the tokenizer already holds as one token are skipped. A byte-level
    tokenizer's new tokens absorb the space before them (lstrip), as its
    mask token does, so 'the Word' becomes 'the', 'Word' as 'the', 'ĠWord'
    would. tokenizer.json and tokenizer_config.json are rewritten to hold them.
    """
    new = tk.Tokenizer.from_str(self._tk.to_str())
    byte_level = '"ByteLevel"' in json.dumps(self._spec.get('pre_tokenizer'))
    spelled: dict[int, list[int]] = {}
    for word in dict.fromkeys(w.strip() for w in words if w.strip()):
      before = self.encode([word if not byte_level else ' ' + word])[0]
      if len(before) == 1 and self.id_to_piece(before[0]).lstrip('\u0120\u2581') == word:
        continue  # Already one token.
      new.add_tokens([tk.AddedToken(word, single_word=True, lstrip=byte_level, normalized=True)])
      spelled[new.token_to_id(word)] = before
    files = dict(self.files, **{'tokenizer.json': new.to_str(pretty=True).encode()})
    config = json.loads(files.get('tokenizer_config.json', b'{}'))
    if 'added_tokens_decoder' in config:
      decoder = config['added_tokens_decoder']
      for i in spelled:
        token = new.id_to_token(i)
        decoder[str(i)] = {'content': token, 'lstrip': byte_level, 'normalized': True,
                           'rstrip': False, 'single_word': True, 'special': False}
      files['tokenizer_config.json'] = json.dumps(config, indent=2).encode()
    files.pop('added_tokens.json', None)  # Superseded by tokenizer.json's added tokens.
    return HFTokenizer(new, files, self.source), spelled


def directory_of(path: str) -> str:
  """The directory of a tokenizer file (a local path or a bucket URL): its other files' home."""
  return os.path.dirname(paths.absolute(path))


def _wordpiece_from_vocab(vocab_txt: bytes, lowercase: bool) -> tk.Tokenizer:
  """BERT's tokenizer from its vocab.txt's bytes, as transformers' BertTokenizerFast builds it."""
  # Read as a text file reads (universal newlines), so ids are those of the file's lines.
  lines = io.TextIOWrapper(io.BytesIO(vocab_txt), encoding='utf-8')
  vocab = {line.rstrip('\n'): i for i, line in enumerate(lines)}
  out = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token='[UNK]', max_input_chars_per_word=100))
  _bert_pipeline(out, lowercase)
  specials = [t for t in tok_lib.SPECIAL_TOKENS if t in vocab]
  out.add_special_tokens(specials)
  return out


def _bert_pipeline(out: tk.Tokenizer, lowercase: bool) -> None:
  out.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                 strip_accents=None, lowercase=lowercase)
  out.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
  out.decoder = tk.decoders.WordPiece(prefix='##')


def train(kind: str, lines: Iterable[str], directory: str, *, vocab_size: int,
          lowercase: bool) -> HFTokenizer:
  """A WordPiece ('wordpiece') or byte-level BPE ('bpe') tokenizer trained on `lines`.

  Its special tokens are [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4 (the
  byte-level [MASK] absorbs the space before it, as RoBERTa's and
  ModernBERT's do). Writes tokenizer.json and tokenizer_config.json into
  `directory`, which AutoTokenizer loads.
  """
  specials = [tk.AddedToken(t, special=True, normalized=False,
                            lstrip=kind == 'bpe' and t == '[MASK]')
              for t in tok_lib.SPECIAL_TOKENS]
  continuing: list[str] = []
  if kind == 'wordpiece':
    out = tk.Tokenizer(tk.models.WordPiece(unk_token='[UNK]', max_input_chars_per_word=100))
    _bert_pipeline(out, lowercase)
    # The trainer orders its alphabet (and '##' + each character) by hash
    # order, which changes from process to process; given in sorted order
    # (the continuations as tokens it must keep), the same lines give the
    # same ids every time.
    lines = list(lines)
    raw: set[str] = set()
    for line in lines:
      raw.update(line)
    alphabet = sorted({c for ch in raw for c in out.normalizer.normalize_str(ch)
                       if not c.isspace()})
    continuing = [f'##{c}' for c in alphabet]
    trainer = tk.trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=specials + continuing, initial_alphabet=alphabet,
        continuing_subword_prefix='##', show_progress=False)
  elif kind == 'bpe':
    out = tk.Tokenizer(tk.models.BPE())
    if lowercase:
      out.normalizer = tk.normalizers.Lowercase()
    out.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    out.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
  else:
    raise ValueError(f'no tokenizers trainer for kind {kind!r}')
  out.train_from_iterator(lines, trainer)
  if continuing:  # Ordinary pieces, not added tokens.
    spec = json.loads(out.to_str())
    spec['added_tokens'] = [t for t in spec['added_tokens'] if not t['content'].startswith('##')]
    out = tk.Tokenizer.from_str(json.dumps(spec))
  cls, sep = tok_lib.SPECIAL_TOKENS[2], tok_lib.SPECIAL_TOKENS[3]
  out.post_processor = tk.processors.TemplateProcessing(
      single=f'{cls} $A {sep}', pair=f'{cls} $A {sep} $B:1 {sep}:1',
      special_tokens=[(cls, out.token_to_id(cls)), (sep, out.token_to_id(sep))])
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      **{f'{role}_token': token for role, token in zip(tok_lib.ROLES, tok_lib.SPECIAL_TOKENS)},
      'clean_up_tokenization_spaces': False,
  }
  files = {'tokenizer.json': out.to_str(pretty=True).encode(),
           'tokenizer_config.json': json.dumps(config, indent=2).encode()}
  result = HFTokenizer(out, files, source=directory)
  result.save(directory)
  return result


def from_sentencepiece(tokenizer: sp_tokenizer.SentencePieceTokenizer) -> tk.Tokenizer:
  """Our sentencepiece unigram model (a SentencePieceTokenizer) as a `tokenizers.Tokenizer`
  giving the same ids, its special tokens those of `tokenizer.specials`.

  Sentencepiece normalises the whole text (charsmap, then whitespace: strip,
  collapse runs, a leading '▁', spaces as '▁') and runs one Viterbi over it in
  which [CLS]/[SEP]/[MASK] (user-defined symbols) score -0.1 and control,
  unknown and byte pieces are not matched at all. The same here: everything
  is in the normalizer, there is no pre-tokenizer, and unmatchable pieces
  score so low that no path takes them. Special tokens must therefore not be
  split out before normalisation: the transformers side sets
  `split_special_tokens`, and the Viterbi finds them as sentencepiece does.

  Known differences, all rare: (1) tokenizers applies the charsmap per
  grapheme cluster, sentencepiece by longest match, so a few clusters of a
  base character and combining marks (e.g. halfwidth katakana + voiced mark,
  conjoining Hangul jamo) normalise differently; (2) between segmentations of
  exactly equal score (e.g. '9'+'999' vs '999'+'9' in a run of digits)
  sentencepiece's float32 sums pick one, tokenizers' exact sums the other;
  (3) literal text spelling a control/unknown/byte piece ('[UNK]', '<0x41>')
  that contains a character missing from the vocabulary becomes that piece.
  """
  spec = tokenizer.spec()
  expected = {'model_type': 'unigram', 'add_dummy_prefix': True, 'remove_extra_whitespaces': True,
              'escape_whitespaces': True, 'treat_whitespace_as_suffix': False}
  for key, value in expected.items():
    if spec[key] != value:
      raise ValueError(f'{tokenizer.model_path}: sentencepiece {key}={spec[key]!r} has no '
                       f'Hugging Face equivalent here (only {value!r}).')
  normal = [score for _, score, kind in spec['pieces'] if kind == 'normal']
  never = min(normal) - 1e6
  user_defined = float(np.float32(-0.1))  # Sentencepiece: length * FLT_MIN - 0.1f.
  vocab = [(piece, score if kind == 'normal' else user_defined if kind == 'user_defined' else never)
           for piece, score, kind in spec['pieces']]
  unk_id = next(i for i, (_, _, kind) in enumerate(spec['pieces']) if kind == 'unknown')
  out = tk.Tokenizer(tk.models.Unigram(vocab, unk_id=unk_id, byte_fallback=spec['byte_fallback']))
  n = tk.normalizers
  # After the charsmap: collapse runs of spaces, strip both ends, then the
  # dummy prefix and '▁' for every space (Prepend leaves an empty text empty).
  steps = [n.Replace(tk.Regex(' {2,}'), ' '), n.Replace(tk.Regex(r'\A | \z'), ''),
           n.Prepend('\u2581'), n.Replace(' ', '\u2581')]
  if spec['precompiled_charsmap']:
    steps.insert(0, n.Precompiled(spec['precompiled_charsmap']))
  out.normalizer = n.Sequence(steps)
  d = tk.decoders
  out.decoder = d.Sequence(
      [d.Replace('\u2581', ' '), d.ByteFallback(), d.Fuse(), d.Strip(' ', 1, 0)])
  specials = tokenizer.specials
  cls, sep = specials.token('cls'), specials.token('sep')
  out.post_processor = tk.processors.TemplateProcessing(
      single=f'{cls}:0 $A:0 {sep}:0', pair=f'{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1',
      special_tokens=[(cls, specials.cls), (sep, specials.sep)])
  out.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                          for t in specials.tokens])
  out.encode_special_tokens = True
  return out
