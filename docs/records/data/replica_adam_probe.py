"""Exact-average simulation: 8 replicas of the LM benchmark, vmapped in one program.

variants:
  ddp        Adam on the mean gradient (one model)
  avg        per-replica Adam, params averaged after every step (Local SGD tau=1)
  avg_m      as avg, and Adam's first moment averaged too
  avg_m_n8   as avg_m, normalized by the mean gradient's second-moment estimate (adam_mean_of=8)
  avg_n8     as avg, with adam_mean_of=8
  avg_half_n8  as avg, each replica's AdamW (by hand: optax's chain's arithmetic) normalized by
             an estimate of the mean of 8 gradients' second moment, v - (1 - 1/8) s, with s an
             EMA (beta2) of the replica's own gradient noise, (g_a - g_b)^2 / 4 from the two
             halves of its batch (an unbiased estimate of its gradient's variance per
             coordinate), floored at v / 8
  avg_half_n1  the same by-hand AdamW with v itself (the control: it must end where avg does)
  match_half_n8, match_half_n1  as avg_half_n8 / _n1, but instead of the exact average each
             parameter is averaged in pairs, a new random perfect matching of the 8 replicas
             per parameter and step (one peer per step, the mean kept exactly): inexact mixing
             without the runtime's asynchrony; the test loss is the replicas' mean model's
  avg_diagnose  avg, and beside it the second moment of the mean gradient (what DDP divides
             by): at steps 10, 50, 150 and 300 it prints per parameter the quantiles over
             coordinates of sqrt(v_mean / v_used), replica 0's step length against the
             DDP-normalized one for the same first moment (<1: the replica steps shorter), v_used
             the replica's own v ("own") and the adam_mean_of=8 estimate ("n8")
"""
import os, sys, json, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, "/work/main")
import importlib.util
import jax, jax.numpy as jnp, numpy as np, optax
from layup_jax import data, models, optim

variant, lr, warm, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
spec = importlib.util.spec_from_file_location("c", "/work/main/configs/stdlib_gpt2_mini.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
config = mod.get_config("ddp")
config.optimizer.learning_rate, config.optimizer.warmup_fraction = lr, warm
config.num_steps, config.seed = steps, seed
M = 8
if variant.endswith("n8"):
  config.optimizer.adam_mean_of = 8
ds = data.make_dataset(config.data, M, config.seed)
model = models.make_model(config.model)
tx = optim.make_optimizer(config.optimizer, steps, ds.steps_per_epoch)
params, state = model.init(jax.random.key(config.seed), ds.example_batch.inputs)

def loss_fn(p, x, y, key, it):
  return model.loss(p, state, x, y, key, it)[0]

grad_fn = jax.value_and_grad(loss_fn)
key = jax.random.key(1)

def is_adam(s):
  return isinstance(s, optax.ScaleByAdamState)

def average_mu(opt):
  return jax.tree.map(lambda s: s._replace(mu=jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0), a.shape), s.mu)) if is_adam(s) else s, opt, is_leaf=is_adam)

def half_grads(p, x, y, t):
  """The loss, the batch's gradient and its noise estimate (g_a - g_b)^2 / 4 from its halves."""
  n = x.shape[0] // 2
  halves = lambda a: a[:2 * n].reshape((2, n) + a.shape[1:])
  losses, gs = jax.vmap(grad_fn, in_axes=(None, 0, 0, None, None))(p, halves(x), halves(y), key, t)
  g = jax.tree.map(lambda a: a.mean(0), gs)
  noise = jax.tree.map(lambda a: (a[0] - a[1]) ** 2 / 4, gs)
  return losses.mean(), g, noise

def pair_average(a, key):
  """Each replica's copy averaged with one other's, the pairs a random perfect matching."""
  order = jax.random.permutation(key, M)
  partner = jnp.zeros(M, jnp.int32).at[order].set(order.reshape(-1, 2)[:, ::-1].reshape(-1))
  return (a + a[partner]) / 2

if variant.startswith(("avg_half_n", "match_half_n")):
  mean_of = int(variant.rsplit("_n", 1)[1])
  matched = variant.startswith("match")
  schedule = optim.make_schedule(config.optimizer, steps, ds.steps_per_epoch)
  b1, b2, eps, wd = config.optimizer.b1, config.optimizer.b2, config.optimizer.eps, config.optimizer.weight_decay
  P = jax.tree.map(lambda a: jnp.broadcast_to(a, (M,) + a.shape), params)
  zeros = jax.tree.map(jnp.zeros_like, P)
  opt = (zeros, zeros, zeros)  # m, v, s per replica
  @jax.jit
  def step(P, opt, xs, ys, t):
    losses, g, noise = jax.vmap(half_grads, in_axes=(0, 0, 0, None))(P, xs, ys, t)
    m, v, s = opt
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    s = jax.tree.map(lambda s, n: b2 * s + (1 - b2) * n, s, noise)
    c1, c2 = 1 - b1 ** (t + 1.0), 1 - b2 ** (t + 1.0)
    def update(p, m, v, s):
      vh, sh = v / c2, s / c2
      d = jnp.maximum(vh - (1 - 1 / mean_of) * sh, vh / mean_of)
      return p - schedule(t) * ((m / c1) / (jnp.sqrt(d) + eps) + wd * p)
    P = jax.tree.map(update, P, m, v, s)
    if matched:
      leaves, treedef = jax.tree.flatten(P)
      keys = jax.random.split(jax.random.fold_in(jax.random.key(7), t), len(leaves))
      P = treedef.unflatten([pair_average(a, k) for a, k in zip(leaves, keys)])
    else:
      P = jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0), a.shape), P)
    return P, (m, v, s), losses.mean()
elif variant == "ddp":
  opt = tx.init(params)
  @jax.jit
  def step(p, opt, xs, ys, t):
    losses, g = jax.vmap(grad_fn, in_axes=(None, 0, 0, None, None))(p, xs, ys, key, t)
    g = jax.tree.map(lambda a: a.mean(0), g)
    u, opt = tx.update(g, opt, p, step=t)
    return optax.apply_updates(p, u), opt, losses.mean()
  P = params
else:
  P = jax.tree.map(lambda a: jnp.broadcast_to(a, (M,) + a.shape), params)
  opt = jax.vmap(tx.init)(P)
  @jax.jit
  def step(P, opt, xs, ys, t):
    losses, g = jax.vmap(grad_fn, in_axes=(0, 0, 0, None, None))(P, xs, ys, key, t)
    u, opt = jax.vmap(lambda g, o, p: tx.update(g, o, p, step=t))(g, opt, P)
    P = optax.apply_updates(P, u)
    P = jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0), a.shape), P)
    if "avg_m" in variant:
      opt = average_mu(opt)
    return P, opt, losses.mean(), jax.tree.map(lambda a: a.mean(0), g)

@jax.jit
def eval_sums(p, x, y, mask):
  logits, _ = model.apply(p, state, x, key, 0, train=False)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(lp, y[..., None], -1)[..., 0].mean(-1)
  return jnp.sum(nll * mask), jnp.sum(mask)

def test_loss(p):
  tot = n = 0.0
  for b in ds.test:
    a, c = eval_sums(p, b.inputs, b.targets, b.mask); tot += float(a); n += float(c)
  return tot / n

def adam_state(opt):
  return [s for s in jax.tree.leaves(opt, is_leaf=is_adam) if is_adam(s)][0]

def diagnose(t, opt, vbar):
  s = adam_state(opt)
  c1, c2 = 1 - 0.9 ** t, 1 - 0.95 ** t
  rows = {}
  for (path, m), v, vb in zip(jax.tree_util.tree_leaves_with_path(s.mu), jax.tree.leaves(s.nu),
                              jax.tree.leaves(vbar)):
    m, v, vb = np.asarray(m[0]) / c1, np.asarray(v[0]) / c2, np.asarray(vb) / c2
    est = m * m + np.maximum(v - m * m, 0) / 8
    q = lambda r: [round(float(x), 3) for x in np.quantile(r, (0.05, 0.5, 0.95))]
    rows[jax.tree_util.keystr(path)] = {"own": q(np.sqrt(vb / (v + 1e-30))),
                                        "n8": q(np.sqrt(vb / (est + 1e-30)))}
  print(json.dumps({"step": t, "ratio_q05_q50_q95": rows}), flush=True)

vbar = jax.tree.map(jnp.zeros_like, params)
curve = []
t0 = time.time()
for t in range(steps):
  batches = [next(it) for it in ds.train]
  xs = np.stack([b.inputs for b in batches]); ys = np.stack([b.targets for b in batches])
  P, opt, l, *mean_grad = step(P, opt, xs, ys, jnp.int32(t))
  if variant == "avg_diagnose":
    vbar = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, vbar, mean_grad[0])
    if (t + 1) in (10, 50, 150, 300):
      diagnose(t + 1, opt, vbar)
  if (t + 1) % 50 == 0 or t + 1 == steps:
    p0 = P if variant == "ddp" else jax.tree.map(lambda a: a.mean(0), P)
    curve.append((t + 1, round(test_loss(p0), 4)))
ds.close()
print(json.dumps({"variant": variant, "lr": lr, "warmup": warm, "steps": steps, "seed": seed,
                  "final": curve[-1][1], "curve": curve, "s": round(time.time() - t0, 1)}), flush=True)
