"""GPT-2 XL fine-tuning on Wikitext-103 from imported GPT-2 weights, context 1024 (Section 5).

Batch 4 per worker (Section 5; the table's 16 is the global batch over 4 workers), AdamW,
cosine schedule over 7,286 steps. The paper's LayUp column counts iterations summed over its 4
workers (T_max 29,144, warm-up 7,000 from 0.0002), scaled here to per-device steps (/4). DDP's
learning rate is copied as printed in the table (0.31645): check it before a long run.
Needs `huggingface:wikitext/wikitext-103-raw-v1` prepared in the TFDS data dir, GPT-2 XL's
`model.safetensors` in a local folder (--config.model.pretrained=DIR) and GPT-2's tokenizer.json
(--config.data.tokenizer=DIR; the same folder works).
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from configs import base

PAPER = {
    "layup": {"optimizer.learning_rate": 0.0003, "optimizer.warmup_steps": 1750,
              "optimizer.warmup_init_lr": 0.0002},
    "ddp": {"optimizer.learning_rate": 0.31645, "optimizer.warmup_init_lr": 0.005},
    "gosgd": {"optimizer.learning_rate": 0.0003, "optimizer.warmup_steps": 1750,
              "optimizer.warmup_init_lr": 0.0002},
    "slowmo": {"optimizer.learning_rate": 0.32855, "optimizer.warmup_init_lr": 0.005,
               "baselines.tau": 12, "baselines.out_freq": 48},
    "co2": {"optimizer.learning_rate": 0.38939, "optimizer.warmup_init_lr": 0.005,
            "baselines.tau": 12, "baselines.out_freq": 48},
}


def get_config(algorithm=None):
  config = base.get_config()
  base.set_values(config, {
      "num_devices": 4,
      "model.name": "gpt2", "model.size": "gpt2-xl", "model.vocab_size": 50257,
      "model.max_len": 1024, "model.dtype": "bfloat16", "model.dropout": 0.0,
      "data.name": "wikitext103", "data.batch_size": 4, "data.seq_len": 1024,
      "data.eval_batch_size": 8, "data.max_eval_batches": 0,
      "optimizer.name": "adamw", "optimizer.weight_decay": 0.0, "optimizer.schedule": "cosine",
      "num_steps": 7286, "eval_every": 500,
  })
  return base.paper_config(config, PAPER, algorithm)
