"""Input pipeline throughput: batches per second of one device's pipeline, against the step rate
it must feed.

Each case runs the project's real pipeline (`TrainIterator`: shard indices, host threads,
augmentation, batching) over records shaped like the prepared TFDS dataset's: images are
encoded PNG (CIFAR) or JPEG (ImageNet, 500x375, the dataset's typical size) and decoded with
PIL on every read, as reading a prepared split does; text is real (this interpreter's standard
library) or generated reviews of IMDb's mean length. No dataset needs to be prepared.

"Needed" is one device's step rate from a reference: the paper's forward+backward timings
(A100, CIFAR-100 batch 128, its appendix), the H100 GPT-2 step measured with
scripts/bench_step.py, or a stated estimate. A pipeline keeps up when its rate is above it.

    python scripts/bench_input.py --repeats 3 --out runs/bench_input.json
"""

import argparse
import io
import json
import pathlib
import platform
import statistics
import sys
import sysconfig
import time

import numpy as np
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from layup_jax.data import TrainIterator, digits, text, vision
from layup_jax.data.sources import RecordSource


class EncodedImages:
  """Records like a prepared TFDS image split: each read decodes an encoded image."""

  def __init__(self, num: int, height: int, width: int, fmt: str, classes: int):
    rng = np.random.default_rng(0)
    self._labels = rng.integers(0, classes, num)
    self._encoded = []
    for _ in range(min(num, 64)):  # 64 distinct images, cycled
      # Smooth noise compresses like a photograph rather than like white noise.
      small = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
      image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
      buffer = io.BytesIO()
      image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
      self._encoded.append(buffer.getvalue())
    self._num = num

  def __len__(self) -> int:
    return self._num

  def __getitem__(self, index: int) -> dict:
    data = self._encoded[index % len(self._encoded)]
    return {"image": np.asarray(Image.open(io.BytesIO(data)).convert("RGB")),
            "label": self._labels[index]}


class Reviews:
  def __init__(self, num: int, length: int = 1300):
    rng = np.random.default_rng(0)
    words = ["the", "film", "was", "not", "good", "great", "plot", "acting", "a", "and", "bad"]
    self._texts = [" ".join(rng.choice(words, length // 5)) for _ in range(64)]
    self._labels = rng.integers(0, 2, num)
    self._num = num

  def __len__(self) -> int:
    return self._num

  def __getitem__(self, index: int) -> dict:
    return {"text": self._texts[index % 64], "label": self._labels[index]}


def _stdlib_stream():
  return text.file_streams(sysconfig.get_paths()["stdlib"], "*.py", text.ByteTokenizer(), 0.1,
                           "")[0]


# name: (build split, batch size, needed batches/s per device, where "needed" comes from)
CASES = {
    "digits": (lambda: digits.load_digits(0.2)[0], 16, 1000 / 5.3,
               "this machine: staged LayUp step 5.3 ms (scripts/bench_step.py)"),
    "cifar100": (lambda: vision.Cifar100Split(RecordSource(
        EncodedImages(50_000, 32, 32, "PNG", 100), "cifar100")), 128, 1 / (0.0049 + 0.0102),
                 "paper appendix: ResNet-18 fwd+bwd 15.1 ms, A100, batch 128"),
    "cifar100 (ResNet-50)": (None, 128, 1 / (0.0166 + 0.0299),
                             "paper appendix: ResNet-50 fwd+bwd 46.5 ms, A100, batch 128"),
    "imagenet2012": (lambda: vision.ImageNetSplit(RecordSource(
        EncodedImages(1_281_167, 375, 500, "JPEG", 1000), "imagenet2012"), 224, 256), 256,
                     2500 / 256, "estimate: ResNet-50 at 2,500 images/s on one A100"),
    "imdb_reviews": (lambda: text.ReviewSplit(RecordSource(Reviews(25_000), "imdb"),
                                              text.ByteTokenizer(), 512), 75, 100.0,
                     "estimate: 2-layer LSTM-256 step of 10 ms on one GPU"),
    "lm (text_files, seq 1024)": (lambda: text.PackedWindows(_stdlib_stream(), 1024), 8,
                                  1000 / 48.8,
                                  "H100: GPT-2 124M bf16 batch 8x1024 staged step 48.8 ms"),
}


def measure(split, batch_size: int, batches: int, read_threads: int, prefetch: int) -> float:
  iterator = TrainIterator(split, 8, 0, batch_size, seed=0, read_threads=read_threads,
                           prefetch=prefetch)
  for _ in range(2):
    next(iterator)  # threads started, first reads done
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return batches / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="*", default=list(CASES))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seconds", type=float, default=3.0, help="rough time per repeat")
  parser.add_argument("--read-threads", type=int, default=2)
  parser.add_argument("--prefetch", type=int, default=4)
  parser.add_argument("--out", default="runs/bench_input.json")
  args = parser.parse_args()

  rows, splits = [], {}
  for name in args.cases:
    build, batch_size, needed, reference = CASES[name]
    key = name.split(" (")[0]
    if key not in splits:
      splits[key] = (build or CASES[key][0])()
    split = splits[key]
    probe = measure(split, batch_size, 2, args.read_threads, args.prefetch)
    batches = max(3, int(args.seconds * probe))
    rates = [measure(split, batch_size, batches, args.read_threads, args.prefetch)
             for _ in range(args.repeats)]
    rate = statistics.median(rates)
    rows.append({"pipeline": name, "batch_size": batch_size, "batches_per_s": rate,
                 "samples_per_s": rate * batch_size, "needed_batches_per_s": needed,
                 "ratio": rate / needed, "reference": reference, "repeats": rates})

  print(f"\nOne device's pipeline, {args.read_threads} read threads, prefetch {args.prefetch}, "
        f"median of {args.repeats}; {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores")
  print("| pipeline | batch | batches/s | samples/s | needed batches/s | ratio | needed from |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['pipeline']} | {r['batch_size']} | {r['batches_per_s']:.1f} | "
          f"{r['samples_per_s']:.0f} | {r['needed_batches_per_s']:.1f} | {r['ratio']:.2f} | "
          f"{r['reference']} |")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"read_threads": args.read_threads, "prefetch": args.prefetch,
                             "cpu_count": __import__("os").cpu_count(), "rows": rows}, indent=2))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
