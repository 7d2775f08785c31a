"""Recall pilot: train softmax GPT on a recall format, log train accuracy vs step."""
import argparse, json, math, sys, time
import numpy as np, torch, torch.nn.functional as F
sys.path.insert(0, "/work/main")
from lssar.model import GPT, GPTConfig

ap = argparse.ArgumentParser()
for k, v in dict(L=32, n=6, m=4, keys=16, vals=16, fill=8, marker=1, layers=2, embd=64, heads=2,
                 lr=1e-3, wd=0.0, steps=8000, bs=64, warmup=100, cos=0, log=250, seed=0,
                 attn="softmax", p=0.0, mlp=4.0, name="x", evalmult=0, task="mqar", noans=0, rep=0, evalm=0, shift=0, rope=10000.0).items():
    ap.add_argument("--" + k, type=type(v), default=v)
a = ap.parse_args()
torch.set_num_threads(1)
BOS, SEP = 0, 1
K0, V0, F0 = 2, 2 + a.keys, 2 + a.keys + a.vals
VOCAB = F0 + a.fill
qlen = 3 if a.marker else 2


def batch(rng, T, B):
    if a.task == "copy":
        h = (T - 1) // 2
        x = K0 + rng.integers(0, a.keys + a.vals, (B, h))
        tok = np.concatenate([np.zeros((B, 1), int), x, x], 1)
        tgt = np.full(tok.shape, -100)
        tgt[:, h + 1 : 2 * h] = tok[:, h + 2 :]
        return torch.from_numpy(tok), torch.from_numpy(tgt)
    if a.noans:
        return batch_noans(rng, T, B)
    return batch_ans(rng, T, B)


def batch_noans(rng, T, B):
    """BOS, filler with n pairs, SEP, m distinct query keys (no answers shown)."""
    ctx_end = T - a.m - 1
    tok = F0 + rng.integers(0, a.fill, (B, T))
    tok[:, 0] = BOS
    tgt = np.full((B, T), -100)
    for b in range(B):
        keys = K0 + rng.choice(a.keys, a.n, replace=False)
        vals = V0 + rng.choice(a.vals, a.n, replace=False)
        free = ctx_end - 1 - 2 * a.n
        gaps = np.sort(rng.choice(free + a.n, a.n, replace=False)) - np.arange(a.n)
        starts = 1 + gaps + 2 * np.arange(a.n)
        for s, i in zip(starts, rng.permutation(a.n)):
            tok[b, s], tok[b, s + 1] = keys[i], vals[i]
        q = rng.choice(a.n, a.m, replace=False)
        tok[b, ctx_end] = SEP
        tok[b, ctx_end + 1 :] = keys[q]
        tgt[b, ctx_end + 1 :] = vals[q]
    return torch.from_numpy(tok), torch.from_numpy(tgt)


def batch_ans(rng, T, B):
    """context: BOS + filler with n pairs (k v) at random non-overlapping slots; then m queries
    (QUERY k v) or (k v) after a SEP; targets at the query keys."""
    ctx_end = T - qlen * MQ - (0 if a.marker else 1)
    tok = F0 + rng.integers(0, a.fill, (B, T))
    tok[:, 0] = BOS
    tgt = np.full((B, T), -100)
    for b in range(B):
        keys = K0 + rng.choice(a.keys, a.n, replace=False)
        vals = V0 + rng.choice(a.vals, a.n, replace=False)
        # choose n non-overlapping 2-slots in 1..ctx_end-1: stars and bars
        free = ctx_end - 1 - 2 * a.n
        gaps = np.sort(rng.choice(free + a.n, a.n, replace=False)) - np.arange(a.n)
        starts = 1 + gaps + 2 * np.arange(a.n)
        perm = rng.permutation(a.n)
        for s, i in zip(starts, perm):
            tok[b, s], tok[b, s + 1] = keys[i], vals[i]
        q = rng.choice(a.n, MQ, replace=bool(REP))
        pos = ctx_end
        if not a.marker:
            tok[b, pos] = SEP
            pos += 1
        for i in q:
            if a.marker:
                tok[b, pos] = SEP
                pos += 1
            tok[b, pos], tok[b, pos + 1] = keys[i], vals[i]
            tgt[b, pos] = vals[i]
            pos += 2
    return torch.from_numpy(tok), torch.from_numpy(tgt)


torch.manual_seed(a.seed)
MQ, REP = a.m, a.rep
opts = {"p": a.p} if a.p else {}
model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=a.layers, n_head=a.heads, n_embd=a.embd,
                      attn=a.attn, attn_options=opts, mlp_ratio=a.mlp, rope_base=a.rope))
class Shift(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        self.prev = torch.nn.Embedding(VOCAB, a.embd)
        torch.nn.init.normal_(self.prev.weight, 0.0, 0.02)

    def forward(self, x):
        h = self.gpt.wte(x)
        p = self.prev(x)
        h = h + torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], 1)
        return self.gpt.head(self.gpt.body(h)), None


if a.shift:
    model = Shift(model)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=a.wd)
rng = np.random.default_rng(a.seed)
t0 = time.time()
accs, losses = [], []
print(json.dumps(vars(a)), flush=True)
for step in range(a.steps):
    lr = a.lr * min(1, (step + 1) / a.warmup)
    if a.cos and step >= a.warmup:
        lr = a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - a.warmup) / (a.steps - a.warmup))))
    for g in opt.param_groups:
        g["lr"] = lr
    x, y = batch(rng, a.L, a.bs)
    logits, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sel = y != -100
    accs.append((logits.argmax(-1)[sel] == y[sel]).float().mean().item())
    losses.append(loss.item())
    if (step + 1) % a.log == 0:
        print(f"{a.name} step {step+1} t {time.time()-t0:.0f}s loss {np.mean(losses):.3f} acc {np.mean(accs):.3f}", flush=True)
        accs, losses = [], []
model.eval()
if a.evalm:
    MQ, REP = a.evalm, 0
erng = np.random.default_rng(999)
with torch.no_grad():
    for mult in [1] + ([2, 4] if a.evalmult else []):
        c = t = 0
        for _ in range(5):
            x, y = batch(erng, a.L * mult, 50)
            lo, _ = model(x)
            sel = y != -100
            c += (lo.argmax(-1)[sel] == y[sel]).sum().item(); t += sel.sum().item()
        print(f"{a.name} EVAL {mult}x acc {c/t:.3f} over {t} t {time.time()-t0:.0f}s", flush=True)
