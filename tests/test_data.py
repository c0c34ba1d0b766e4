"""Each device reads its own exclusive shard every epoch (paper Eq. 1), reshuffled per epoch."""

import numpy as np

from layup_jax.data import digits
from layup_jax.data.sharding import ShardIterator, eval_batches, shard_indices


def test_shards_of_one_epoch_are_disjoint_and_cover_the_split():
  shards = [shard_indices(1437, 8, i, seed=0, epoch=3) for i in range(8)]
  joined = np.concatenate(shards)
  assert len(joined) == len(set(joined.tolist())) == 8 * (1437 // 8)
  assert set(joined.tolist()) <= set(range(1437))


def test_epochs_are_reshuffled_and_the_seed_fixes_the_order():
  first = shard_indices(1437, 8, 0, seed=0, epoch=0)
  assert not np.array_equal(first, shard_indices(1437, 8, 0, seed=0, epoch=1))
  assert not np.array_equal(first, shard_indices(1437, 8, 0, seed=1, epoch=0))
  np.testing.assert_array_equal(first, shard_indices(1437, 8, 0, seed=0, epoch=0))


def test_a_device_iterator_walks_its_shard_then_moves_to_the_next_epoch():
  train, test = digits.load_digits(0.2)
  assert (len(train), len(test)) == (1438, 359)
  assert train.inputs.shape[1:] == (8, 8, 1) and 0 <= train.inputs.min() <= train.inputs.max() <= 1
  iterator = ShardIterator(train, 8, 5, batch_size=16, seed=0)
  assert iterator.batches_per_epoch() == 179 // 16
  seen = np.concatenate([next(iterator).targets for _ in range(iterator.batches_per_epoch())])
  want = train.targets[shard_indices(1438, 8, 5, 0, 0)][: len(seen)]
  np.testing.assert_array_equal(seen, want)
  next(iterator)
  assert (iterator.epoch, iterator.position) == (1, 16)


def test_eval_batches_pad_and_mask_the_last_batch():
  _, test = digits.load_digits(0.2)
  batches = eval_batches(test, 128)
  assert [len(b.targets) for b in batches] == [128, 128, 128]
  assert sum(float(b.mask.sum()) for b in batches) == 359
  np.testing.assert_array_equal(np.concatenate([b.targets for b in batches])[:359], test.targets)
