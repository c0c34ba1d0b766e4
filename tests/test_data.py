"""Each device reads its own exclusive shard every epoch (paper Eq. 1), reshuffled per epoch,
through a prefetching pipeline that is deterministic and resumes from a saved state."""

import numpy as np
import pytest

from layup_jax.data import EvalSet, TrainIterator, digits, shard_indices
from layup_jax.data.pipeline import ArraySplit, Batch


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
  iterator = TrainIterator(train, 8, 5, batch_size=16, seed=0)
  assert iterator.batches_per_epoch() == 179 // 16
  seen = np.concatenate([next(iterator).targets for _ in range(iterator.batches_per_epoch())])
  want = train.targets[shard_indices(1438, 8, 5, 0, 0)][: len(seen)]
  np.testing.assert_array_equal(seen, want)
  second_epoch = next(iterator).targets
  np.testing.assert_array_equal(second_epoch, train.targets[shard_indices(1438, 8, 5, 0, 1)[:16]])


class _Noisy:
  """A split whose reads use the augmentation rng, to check it is fixed by the seed."""

  def __len__(self):
    return 100

  def read(self, indices, rng):
    return Batch(indices + rng.random(len(indices)), indices)


def _take(iterator, n):
  return [next(iterator).inputs for _ in range(n)]


def test_the_same_seed_gives_the_same_augmented_batches_whatever_the_threads():
  one = _take(TrainIterator(_Noisy(), 4, 1, 5, seed=3, read_threads=1, prefetch=1), 12)
  many = _take(TrainIterator(_Noisy(), 4, 1, 5, seed=3, read_threads=4, prefetch=8), 12)
  other = _take(TrainIterator(_Noisy(), 4, 1, 5, seed=4, read_threads=1), 12)
  np.testing.assert_array_equal(np.stack(one), np.stack(many))
  assert not np.array_equal(np.stack(one), np.stack(other))


def test_a_saved_iterator_state_resumes_at_the_same_next_batch():
  iterator = TrainIterator(_Noisy(), 4, 2, 5, seed=0, read_threads=2)
  _take(iterator, 7)  # into the second epoch (5 batches per epoch)
  state = iterator.get_state()
  expected = _take(iterator, 6)
  resumed = TrainIterator(_Noisy(), 4, 2, 5, seed=0, read_threads=2)
  resumed.set_state(state)
  assert resumed.next_batch == 7
  np.testing.assert_array_equal(np.stack(_take(resumed, 6)), np.stack(expected))


def test_a_shard_without_a_full_batch_is_refused():
  with pytest.raises(ValueError, match="no full batch of 30"):
    TrainIterator(ArraySplit(np.zeros((100, 2)), np.zeros(100)), 4, 0, 30, seed=0)


def test_the_eval_set_pads_and_masks_the_last_batch_and_can_be_read_again():
  _, test = digits.load_digits(0.2)
  eval_set = EvalSet(test, 128)
  for _ in range(2):
    batches = list(eval_set)
    assert [len(b.targets) for b in batches] == [128, 128, 128]
    assert sum(float(b.mask.sum()) for b in batches) == 359
    np.testing.assert_array_equal(np.concatenate([b.targets for b in batches])[:359],
                                  test.targets)
  assert len(list(EvalSet(test, 128, max_batches=2))) == 2


def test_a_limited_eval_set_reads_samples_spread_over_the_whole_split():
  split = ArraySplit(np.arange(1000)[:, None], np.arange(1000))
  batches = list(EvalSet(split, 10, max_batches=4))
  seen = np.concatenate([b.targets for b in batches])
  assert len(seen) == 40 and len(set(seen.tolist())) == 40
  assert seen.min() == 0 and seen.max() >= 975  # the first batches alone would end at 39
  np.testing.assert_array_equal(np.diff(seen), 25)
