"""The language-model benchmark: a byte-level GPT-2 mini on Python's standard library, 8 devices.

The corpus is every `.py` file of this interpreter's standard library (site-packages left out:
about 1,800 files, 31 MB on Python 3.11), so every machine has it and nothing is downloaded.
A tenth of the files, chosen by a hash of their paths, is the test split (by document). Tokens
are bytes (vocabulary 257: 256 bytes and an end-of-document token), so the test loss is in nats
per byte; 128-byte contexts. GPT-2 mini is 4 blocks of width 64 (4 heads, 0.2 M parameters),
under `per_layer` a stage per attention and per MLP sub-layer (10 stages). AdamW (beta2 0.95,
weight decay 0.1) with a linear warm-up and cosine decay; 300 steps of 8 x 16 x 128 tokens
(4.9 M tokens, a sixth of the training split) is the largest budget.

Each method's peak learning rate and warm-up share were chosen by one rule, as for
Fashion-MNIST: the best final test loss of a grid at this budget, one seed
(`bash scripts/reproduce_results.sh lm_search`; the grid and the pick: docs/results.md,
"stdlib_gpt2_mini_search"). The paper's Algorithm 1 (`layup_paper`) takes LayUp's values, with
the paper's per-device AdamW (`optimizer.adam_mean_of` 1).
"""

import sysconfig

from layup_jax import defaults

PAPER = {}
PAPER["ddp"] = {"optimizer.learning_rate": 0.012, "optimizer.warmup_fraction": 0.2}
# LayUp's AdamW normalizes each device's step as by the mean of its 8 devices' gradients, the
# noise measured from each batch's halves (layup_jax/optim.py `scale_by_adam_of_mean`): the
# paper's per-device AdamW steps up to sqrt(8) times shorter than DDP's where noise dominates
# (docs/records/language_model.md).
PAPER["layup"] = {"optimizer.learning_rate": 0.012, "optimizer.warmup_fraction": 0.2,
                  "optimizer.adam_mean_of": 8}
PAPER["layup_paper"] = {  # not searched on its own: LayUp's values, with AdamW as the paper's
    "optimizer.learning_rate": 0.012, "optimizer.warmup_fraction": 0.2}
PAPER["gosgd"] = {"optimizer.learning_rate": 0.012, "optimizer.warmup_fraction": 0.2}
PAPER["diloco"] = {"optimizer.learning_rate": 0.006, "optimizer.warmup_fraction": 0.2,
                   "optimizer.weight_decay": 0.1,
                   "baselines.out_freq": 12}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 8,
      "model.name": "gpt2", "model.size": "mini", "model.vocab_size": 257, "model.max_len": 128,
      "data.name": "text_files", "data.text_dir": sysconfig.get_paths()["stdlib"],
      "data.text_glob": "**/*.py", "data.text_exclude": ("site-packages/*",),
      "data.test_fraction": 0.1, "data.seq_len": 128, "data.batch_size": 16,
      "data.eval_batch_size": 128, "data.max_eval_batches": 4,
      "optimizer.name": "adamw", "optimizer.b2": 0.95, "optimizer.weight_decay": 0.1,
      "optimizer.schedule": "cosine",
      "num_steps": 300, "eval_every": 15,
      # The target every method reaches at 300 steps at its searched values (DiLoCo's best of
      # the search: 2.40): the tokens and time to it are on the results page.
      "metrics.target_loss": 2.5,
  })
  return defaults.paper_config(config, PAPER, algorithm)
