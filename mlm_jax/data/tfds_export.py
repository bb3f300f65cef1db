"""The opt-in tfds export of a data dir's rows (config.data.tfds_export, `prepare --tfds_export`).

Training reads only the .npy rows (data/packed_rows.py). For tools that read
tfds datasets, the same rows can be exported as a tfds dataset in
array_record format (tf.Example records of {'input_ids': int32[T]}) under
DATA_DIR/tfds/mlm_rows/1.0.0, read with
`tfds.builder_from_directory(dir).as_data_source(split)`. Each array_record
shard is made from the .npy shard of the same index alone, so the export
can be written with the rows or added to a finished data dir later, and is
the same bytes either way (and as earlier versions wrote it, beside every
data dir). Its dataset_info.json is written last: its presence marks a
complete export (prepared.has_tfds_export). Imported only when the rows are
exported, as tensorflow_datasets takes a while to import.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from tensorflow_datasets.proto import tf_example_pb2

from mlm_jax.data import packed_rows
from mlm_jax.data import prepared

FILENAME_TEMPLATE = '{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'


def serialize_row(row: np.ndarray) -> bytes:
  """The tf.Example of one row, byte for byte what features(T).serialize_example gives.

  Built with the protobuf class directly, which costs a fraction of tfds's
  generic feature encoding per row; tests/test_data.py checks the bytes are
  the same.
  """
  example = tf_example_pb2.Example()
  example.features.feature['input_ids'].int64_list.value.extend(row.tolist())
  return example.SerializeToString()


def features(seq_len: int) -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict({
      'input_ids': tfds.features.Tensor(shape=(seq_len,), dtype=np.int32)})


def template(rows_dir: str, split: str) -> tfds.core.ShardedFileTemplate:
  return tfds.core.ShardedFileTemplate(
      data_dir=rows_dir, template=FILENAME_TEMPLATE, dataset_name=prepared.TFDS_NAME, split=split,
      filetype_suffix='array_record')


def shard_path(rows_dir: str, split: str, k: int, num_shards: int) -> str:
  return os.fspath(template(rows_dir, split).sharded_filepath(shard_index=k,
                                                               num_shards=num_shards))


def export_shard(dense_path: str, record_path: str) -> None:
  """One .npy shard [rows, T] as an array_record shard of tf.Example rows (a pool task)."""
  rows = np.load(dense_path, mmap_mode='r')
  tmp = f'{record_path}.tmp-{os.getpid()}'
  # One record per chunk, as tfds writes them, but not compressed: a row of
  # varints barely shrinks on its own, so compressing each one would cost
  # time and save no space. Readers take the options from the file.
  writer = array_record_module.ArrayRecordWriter(tmp, 'group_size:1,uncompressed')
  for row in rows:
    writer.write(serialize_row(np.asarray(row, np.int32)))
  writer.close()
  os.replace(tmp, record_path)


def export(data_dir: str, pool, splits: list[str], tokenizer_kind: str) -> int:
  """Writes the tfds export of the rows of `splits` (stored split names) in `data_dir`, shards
  already there kept; `pool`: a packing.Pool or beam_runner.BeamPool. Returns the shards
  written."""
  rows_dir = prepared.tfds_dir(data_dir)
  os.makedirs(rows_dir, exist_ok=True)
  for name in os.listdir(rows_dir):
    if '.tmp-' in name:  # Left by an interrupted export.
      os.remove(os.path.join(rows_dir, name))
  shards = {s: packed_rows.split_paths(data_dir, s) for s in splits}
  tasks = [(dense, shard_path(rows_dir, s, k, len(paths)))
           for s, paths in shards.items() for k, dense in enumerate(paths)]
  todo = [t for t in tasks if not os.path.exists(t[1])]
  pool.run(export_shard, todo, 'tfds export', len(tasks))
  seq_len = 0
  split_infos = []
  for s, paths in shards.items():
    lengths = []
    for p in paths:
      shape = np.load(p, mmap_mode='r').shape
      lengths.append(shape[0])
      seq_len = shape[1]
    split_infos.append(tfds.core.SplitInfo(
        name=s, shard_lengths=lengths,
        num_bytes=sum(os.path.getsize(shard_path(rows_dir, s, k, len(paths)))
                      for k in range(len(paths))),
        filename_template=template(rows_dir, s)))
  tfds.folder_dataset.write_metadata(
      data_dir=rows_dir, features=features(seq_len), split_infos=split_infos,
      filename_template=FILENAME_TEMPLATE, check_data=False,
      description=f'Packed [CLS] ... [SEP] rows of {tokenizer_kind} ids.')
  return len(todo)


def stored_splits(data: prepared.PreparedData) -> list[str]:
  """A data dir's stored split names in the order prepare writes them ('train', 'validation';
  a mixture's 'train_0', 'train_1', ..., 'validation_0', ...)."""
  return [n for s in prepared.SPLITS for n in prepared.split_names(s, data.num_parts)]
