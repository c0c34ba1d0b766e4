"""IMDb sentiment, 2-layer LSTM of 256 (paper appendix on IMDb), 8 devices (the paper does not
say which of its machines ran it; 8 is the default here), float32.

Batch 75 per worker, Adam, cosine schedule (T_max 150 in the paper's table, read here as
epochs), no weight decay. Reviews are byte-level tokens (data.tokenizer for GPT-2 BPE), the
first 512 kept (the paper does not give a length). Needs `imdb_reviews` prepared in the TFDS
data dir. `:ddp` takes DDP's column.
"""

from layup_jax import defaults

PAPER = {
    "layup": {"optimizer.learning_rate": 0.0015},
    "ddp": {"optimizer.learning_rate": 0.001},
}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": 8, "model.dtype": "float32",
      "model.name": "lstm", "model.num_classes": 2, "model.vocab_size": 257,
      "model.hidden_size": 256, "model.num_layers": 2,
      "data.name": "imdb_reviews", "data.batch_size": 75, "data.seq_len": 512,
      "data.eval_batch_size": 500,
      "optimizer.name": "adam", "optimizer.weight_decay": 0.0, "optimizer.schedule": "cosine",
      "num_epochs": 150, "eval_every": 200,
  })
  return defaults.paper_config(config, PAPER, algorithm)
