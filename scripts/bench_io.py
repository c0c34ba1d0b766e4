"""Input and output against training, in two modes (the first argument).

  input       input pipeline throughput: batches per second of one device's pipeline, against
              the step rate it must feed
  checkpoint  training time with checkpoints every N steps against the same run without

    python scripts/bench_io.py input --repeats 3 --out runs/bench_input.json
    python scripts/bench_io.py checkpoint --every 50 --repeats 3 --out bench_checkpoint.json

`python scripts/bench_io.py MODE --help` lists a mode's options.

## input (was scripts/bench_input.py)

Each case runs the project's real pipeline (`TrainIterator`: shard indices, host threads,
augmentation, batching) over records shaped like the prepared TFDS dataset's: images are
encoded PNG (CIFAR) or JPEG (ImageNet, 500x375, the dataset's typical size) and decoded with
PIL on every read, as reading a prepared split does; text is real (this interpreter's standard
library) or generated reviews of IMDb's mean length. No dataset needs to be prepared.

"Needed" is one device's step rate from a reference: the paper's forward+backward timings
(A100, CIFAR-100 batch 128, its appendix), the H100 GPT-2 step measured with
scripts/bench_step.py, or a stated estimate. A pipeline keeps up when its rate is above it.

## checkpoint (was scripts/bench_checkpoint.py)

Each repeat runs both back to back (in alternating order), so each ratio compares runs taken
side by side; the table reports medians over repeats. Time per step is the run's training time
(`wall_time_s`: compilation and evaluation excluded, the time training waits for a checkpoint
save included) over its steps. Evaluation only at the end, so every checkpoint adds its own
pause of the threads. `--allocator` as the other benchmarks' (layup_jax/measure/bench_options.py).
"""

import argparse
import io
import json
import os
import pathlib
import platform
import statistics
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import numpy as np
from PIL import Image

from configs import digits as digits_config
from layup_jax.data import TrainIterator, digits, text, vision
from layup_jax.data.sources import RecordSource
from layup_jax.measure import bench_options
from layup_jax.run import runner

MODES = ("input", "checkpoint")

# --- input --------------------------------------------------------------------------------------


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


def main_input(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_io.py input",
      description="Input pipeline throughput: batches per second of one device's pipeline, "
                  "against the step rate it must feed.")
  parser.add_argument("--cases", nargs="*", default=list(CASES))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seconds", type=float, default=3.0, help="rough time per repeat")
  parser.add_argument("--read-threads", type=int, default=2)
  parser.add_argument("--prefetch", type=int, default=4)
  parser.add_argument("--out", default="runs/bench_input.json")
  args = parser.parse_args(argv)

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
        f"{os.cpu_count()} cores")
  print("| pipeline | batch | batches/s | samples/s | needed batches/s | ratio | needed from |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['pipeline']} | {r['batch_size']} | {r['batches_per_s']:.1f} | "
          f"{r['samples_per_s']:.0f} | {r['needed_batches_per_s']:.1f} | {r['ratio']:.2f} | "
          f"{r['reference']} |")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"read_threads": args.read_threads, "prefetch": args.prefetch,
                             "cpu_count": os.cpu_count(), "rows": rows}, indent=2))
  print(f"wrote {out}")


# --- checkpoint -----------------------------------------------------------------------------------


def main_checkpoint(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog="bench_io.py checkpoint",
      description="Training time with checkpoints every N steps against the same run without "
                  "checkpoints.")
  parser.add_argument("--algorithms", nargs="+", default=["layup", "ddp"])
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--num-devices", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  bench_options.add_option(parser)
  parser.add_argument("--out", default="bench_checkpoint.json")
  args = parser.parse_args(argv)
  host_allocator = bench_options.use(args.allocator)
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="layup_jax_cache_"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  runs = []
  for repeat in range(args.repeats):
    for algorithm in args.algorithms:
      order = ["none", "every"] if repeat % 2 == 0 else ["every", "none"]
      for mode in order:
        config = digits_config.get_config(algorithm)
        config.num_devices, config.eval_every, config.progress_bar = args.num_devices, 0, False
        config.checkpoint.enabled = mode == "every"
        config.checkpoint.every = args.every
        with tempfile.TemporaryDirectory() as workdir:
          summary = runner.run(config, workdir)
        per_step = summary["wall_time_s"] / summary["num_steps"]
        runs.append({"repeat": repeat, "algorithm": algorithm, "mode": mode,
                     "seconds_per_step": per_step, **summary})
        print(f"repeat {repeat} {algorithm:>6} checkpoints {mode:>5}: {1e3 * per_step:.2f} ms/step",
              flush=True)

  def per_step(algorithm, mode, repeat):
    return next(r["seconds_per_step"] for r in runs if r["algorithm"] == algorithm
                and r["mode"] == mode and r["repeat"] == repeat)

  table = []
  print(f"\n{'algorithm':<10}{'none ms/step':>14}{f'every {args.every} ms/step':>20}"
        f"{'ratio':>8}")
  for algorithm in args.algorithms:
    ratios = [per_step(algorithm, "every", r) / per_step(algorithm, "none", r)
              for r in range(args.repeats)]
    row = {"algorithm": algorithm, "every": args.every,
           "none_ms_per_step": 1e3 * statistics.median(
               per_step(algorithm, "none", r) for r in range(args.repeats)),
           "every_ms_per_step": 1e3 * statistics.median(
               per_step(algorithm, "every", r) for r in range(args.repeats)),
           "ratio_median": statistics.median(ratios), "ratios": ratios}
    table.append(row)
    print(f"{algorithm:<10}{row['none_ms_per_step']:>14.2f}{row['every_ms_per_step']:>20.2f}"
          f"{row['ratio_median']:>8.3f}")
  with open(args.out, "w") as f:
    json.dump({"host_allocator": host_allocator, "table": table, "runs": runs,
               "devices": [str(d) for d in jax.devices()]}, f, indent=2)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return
  if not argv or argv[0] not in MODES:  # refused as argparse refuses: one line, status 2
    print(f"error: the first argument is a mode, one of {', '.join(MODES)} "
          f"(got {argv[0] if argv else 'none'}); see --help", file=sys.stderr)
    sys.exit(2)
  {"input": main_input, "checkpoint": main_checkpoint}[argv[0]](argv[1:])


if __name__ == "__main__":
  main()
