"""`python -m layup_jax.models --summary NAME`: per-stage and total parameter counts.

NAME is a model name (`resnet18`, `resnet50`, `lstm`, `digits_resnet`, ...) or a GPT-2 size
(`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`, `tiny`). Shapes come from `jax.eval_shape`, so
nothing is allocated. ResNets default to the ImageNet variant with 1000 classes (the published
counts); tied parameters are counted once, in the stage that owns them.
"""

import argparse
import math

import jax

from layup_jax import defaults, models
from layup_jax.models import gpt2


def parameter_counts(config) -> list[int]:
  """Parameters of each stage of `config.model`, from shapes alone."""
  model = models.make_model(config)
  inputs = models.example_inputs(config, 1)
  params, _ = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs))
  return [sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(stage)) for stage in params]


def summary_config(name: str, variant: str, num_classes: int):
  config = defaults.get_config().model
  if name in gpt2.SIZES:
    config.name, config.size = "gpt2", name
  else:
    config.name = name
  config.variant, config.num_classes = variant, num_classes
  return config


def main() -> None:
  parser = argparse.ArgumentParser(description="Parameter counts of a staged model.")
  parser.add_argument("--summary", required=True, metavar="NAME")
  parser.add_argument("--variant", default="imagenet", choices=models.VARIANTS)
  parser.add_argument("--num-classes", type=int, default=1000)
  parser.add_argument("--granularity", default="per_block", choices=models.GRANULARITIES)
  args = parser.parse_args()
  known = sorted(set(models.names()) | set(gpt2.SIZES))
  if args.summary not in known:
    parser.error(f"unknown model {args.summary!r}; known: {', '.join(known)}")
  config = summary_config(args.summary, args.variant, args.num_classes)
  config.granularity = args.granularity
  counts = parameter_counts(config)
  for stage_idx, count in enumerate(counts):
    print(f"stage {stage_idx:>3}: {count:>14,}")
  print(f"{args.summary}: {len(counts)} stages, {sum(counts):,} parameters "
        f"({sum(counts) / 1e6:.2f}M)")


if __name__ == "__main__":
  main()
