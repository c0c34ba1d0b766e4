"""Command line: `python -m layup_jax.train --config configs/<name>.py [--config.key=value] --workdir DIR`."""

import os
import sys

# Eight fake CPU devices unless the user chose a number; this must precede the first JAX import.
# It only shapes the host platform: GPUs are listed first when present.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from layup_jax import runner  # noqa: E402
from layup_jax.config_validation import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Where metrics and summaries go.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    summary = runner.run(_CONFIG.value, _WORKDIR.value)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  print(
      f"{summary['algorithm']} on {summary['num_devices']} devices: final consensus test accuracy "
      f"{summary['final_eval_accuracy']:.4f}, loss {summary['final_eval_loss']:.4f}, "
      f"{summary['wall_time_s']:.1f} s training, {summary['train_samples_per_s']:.0f} samples/s "
      f"(summary in {_WORKDIR.value}/summary.json)"
  )


if __name__ == "__main__":
  app.run(main)
