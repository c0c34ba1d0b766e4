"""The offline language-model demo: byte-level GPT-2 tiny on Python's own standard library.

Trains on the `.py` files at the top of this interpreter's standard library (about 200 files,
the last 10% held out), 128-byte contexts, 4 devices. Needs nothing prepared or downloaded;
on a 2-core CPU the test loss falls far below ln 256 = 5.55 nats (uniform bytes) in minutes.
Any folder of text works the same way: --config.data.text_dir=DIR --config.data.text_glob=GLOB.
"""

import sysconfig

from layup_jax import defaults

PAPER = {"layup": {}, "ddp": {}}  # not a paper experiment: the same values for every algorithm


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 4,
      "model.name": "gpt2", "model.size": "tiny", "model.vocab_size": 257, "model.max_len": 128,
      "data.name": "text_files", "data.text_dir": sysconfig.get_paths()["stdlib"],
      "data.text_glob": "*.py", "data.test_fraction": 0.1, "data.seq_len": 128,
      "data.batch_size": 32, "data.eval_batch_size": 128, "data.max_eval_batches": 8,
      "optimizer.name": "adamw", "optimizer.learning_rate": 3e-3, "optimizer.weight_decay": 0.01,
      "optimizer.schedule": "cosine", "optimizer.warmup_steps": 30,
      "num_steps": 300, "eval_every": 100,
  })
  return defaults.paper_config(config, PAPER, algorithm)
