#!/usr/bin/env python3
"""scripts/peers/torch_moe.py — the PyTorch peer: moelab's MoE layer written in plain PyTorch, timed on one GPU.

    python3 scripts/peers/torch_moe.py                                   # every shape, one JSON line each
    python3 scripts/peers/torch_moe.py --out peers/torch-moe.jsonl --commit e25e2a0bc39d
    python3 scripts/peers/torch_moe.py --shape 2048,8192,64,16384,1      # d_model,d_hidden,experts,tokens,top_k
    python3 scripts/peers/torch_moe.py --list                            # the shapes (no torch needed)

The yardstick beside moelab's cuda runs (scripts/gpu.sh run calls it after the suites step;
docs/GPU.md). For each shape, bf16, one GPU, every expert local, forward + backward:

  torch_grouped_mm_ms  the whole layer as a PyTorch user would write it with PyTorch's fastest
                       built-in MoE path: softmax top-k routing (gate in bf16, softmax in fp32,
                       no noise, no renormalisation: the workloads' "noisy_gate": false,
                       "renormalize": false), a capacity-free gather of each token's rows sorted
                       by expert, torch._grouped_mm for both expert GEMMs with GELU (erf form,
                       as moelab's kernels) between them, the gate-weighted rows summed back
                       per token with index_add;
  torch_loop_ms        the same layer with a Python loop over the experts (one weight tensor per
                       expert, as per-expert nn.Linear modules hold them), the usual plain
                       PyTorch MoE;
  floor_ms             the GEMM floor: the experts' FLOPs (2 forward, 4 backward GEMMs) as
                       perfectly balanced torch.bmm over tokens * top_k / experts rows each,
                       nothing else. No MoE layer can beat it on this GPU with these libraries.

Each time is the median of --iters CUDA-event timings of one step (after --warmup steps);
gradients are set to None before every step, as optimizer.zero_grad() does, so no step
accumulates into the last one's. Before timing, both layers are checked against a float64
reference of the same layer on a small problem (output and every gradient); a mismatch exits 1
and times nothing.

Output: one JSON line per shape (stdout, and appended to --out), with the fields
floor_ms, torch_grouped_mm_ms, torch_loop_ms (or *_error when a variant fails, e.g.
torch._grouped_mm on a GPU older than sm_80), M, H, E, tokens, k, expert_tflop (the experts'
forward + backward TFLOP), device, torch, and "peer": "torch", "workload" (the moelab workload
of that shape, null for a shape no workload has), dtype, iters, warmup, grad, commit, date.

The shapes are those of the cuda runs' workloads that route without a capacity limit
(experiments/workloads/: gpt3-xl-e64-16k of the foundation suite, the mpipemoe suite's
mpipemoe-gpu-gpt3-{s,xl}-e8-*; the tf32 workloads share their bf16 twins' shapes), plus
MoE-GPT3-S with 64 experts on 16384 tokens, the many-small-experts case no workload has yet.
"small" (capacity factor 1.0, fp32) is not a peer shape: the peer drops no tokens.

Without torch, or with torch but no CUDA device, it says so and exits 0 (nothing written).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

# (workload, d_model M, d_hidden H, experts E, tokens per rank, top_k); scripts/tests/test_torch_peer.py
# checks each named workload's model and tokens against experiments/workloads/<workload>.json.
SHAPES = (
    ("gpt3-xl-e64-16k", 2048, 8192, 64, 16384, 1),
    ("mpipemoe-gpu-gpt3-xl-e8-bf16", 2048, 8192, 8, 65536, 1),
    ("mpipemoe-gpu-gpt3-s-e8-bf16", 768, 3072, 8, 65536, 1),
    (None, 768, 3072, 64, 16384, 1),
)
CHECK_SHAPE = (64, 128, 5, 300, 2)  # M, H, E, tokens, k: uneven expert counts, top-2
CHECK_TOL = 3e-2  # bf16 against float64, relative to each tensor's norm


def expert_tflop(M, H, tokens, k):
    """Forward + backward FLOPs of the expert GEMMs: 2 GEMMs of 2*T*k*M*H forward, twice that backward."""
    return 3 * 2 * 2 * tokens * k * M * H / 1e12


def parse_shape(text):
    try:
        M, H, E, T, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected d_model,d_hidden,experts,tokens,top_k")
    if min(M, H, E, T, k) < 1 or k > E:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: sizes must be positive and top_k <= experts")
    return (None, M, H, E, T, k)


def skip(why):
    print(f"torch_moe.py: skipped: {why}")
    return 0


class Peer:
    """The layer's parameters and the three timed steps for one shape; torch passed in so that
    this module imports without it."""

    def __init__(self, torch, M, H, E, tokens, k, dtype, seed=0, device="cuda"):
        self.torch, self.F = torch, torch.nn.functional
        self.M, self.H, self.E, self.T, self.k, self.dtype, self.device = M, H, E, tokens, k, dtype, device
        dev = device
        g = torch.Generator(device=dev).manual_seed(seed)
        rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)
        self.x = rnd(tokens, M).requires_grad_()                       # [T, M] the layer's input
        self.wg = rnd(M, E, scale=M ** -0.5).requires_grad_()           # [M, E] gate
        self.w1 = rnd(E, M, H, scale=M ** -0.5).requires_grad_()        # [E, M, H] first expert GEMM
        self.w2 = rnd(E, H, M, scale=H ** -0.5).requires_grad_()        # [E, H, M] second expert GEMM
        # The loop layer's experts: one leaf tensor per expert (indexing the stacked tensor,
        # w1[e], would make every expert's backward produce a gradient of the whole stack).
        self.w1_e = [self.w1[e].detach().clone().requires_grad_() for e in range(E)]   # E x [M, H]
        self.w2_e = [self.w2[e].detach().clone().requires_grad_() for e in range(E)]   # E x [H, M]
        self.gy = rnd(tokens, M)                                        # [T, M] upstream gradient

    # ---- the layer ---------------------------------------------------------------------------

    def route(self, x):
        """Softmax top-k gate; the T*k (token, expert) assignments sorted by expert.
        Returns token [T*k] (source row of each sorted assignment), weight [T*k], counts [E]."""
        torch = self.torch
        probs = torch.softmax((x @ self.wg).float(), dim=-1)            # [T, E] fp32
        gate_w, expert = probs.topk(self.k, dim=-1)                      # [T, k], [T, k]
        flat = expert.reshape(-1)                                        # [T*k]
        order = torch.argsort(flat, stable=True)                         # [T*k] grouped by expert
        # per-expert counts without a host sync (CUDA bincount reads its maximum back to size its
        # output): the grouped layer's step stays on the device, as torchtitan's does
        counts = torch.zeros(self.E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        token = order // self.k                                          # [T*k]
        weight = gate_w.reshape(-1)[order].to(x.dtype)                   # [T*k]
        return token, weight, counts

    def combine(self, x, token, weight, out):
        """y[t] = sum over t's assignments of weight * expert output: [T*k, M] -> [T, M]."""
        return x.new_zeros(x.shape).index_add(0, token, out * weight[:, None])

    def layer_grouped(self, x):
        token, weight, counts = self.route(x)
        xs = x.index_select(0, token)                                    # [T*k, M] gathered rows
        offs = self.torch.cumsum(counts, 0, dtype=self.torch.int32)      # [E] end row of each expert
        h = self.F.gelu(self.torch._grouped_mm(xs, self.w1, offs=offs))  # [T*k, H]
        out = self.torch._grouped_mm(h, self.w2, offs=offs)              # [T*k, M]
        return self.combine(x, token, weight, out)

    def layer_loop(self, x):
        token, weight, counts = self.route(x)
        xs = x.index_select(0, token)                                    # [T*k, M]
        outs, lo = [], 0
        for e, n in enumerate(counts.tolist()):  # the host needs the counts: one sync per step
            if n:
                outs.append(self.F.gelu(xs[lo:lo + n] @ self.w1_e[e]) @ self.w2_e[e])   # [n, M]
            lo += n
        return self.combine(x, token, weight, self.torch.cat(outs))      # [T*k, M] -> [T, M]

    def reference(self):
        """The same layer in float64, assignment by assignment, from the same parameters."""
        torch, F = self.torch, self.F
        x, wg, w1, w2 = (t.detach().double().requires_grad_() for t in (self.x, self.wg, self.w1, self.w2))
        probs = torch.softmax(x @ wg, dim=-1)
        # The bf16 gate's choice, so that a near tie cannot pick another expert in float64.
        _, expert = torch.softmax((self.x.detach() @ self.wg.detach()).float(), -1).topk(self.k, dim=-1)
        y = torch.zeros_like(x)
        for j in range(self.k):
            e = expert[:, j]                                             # [T]
            h = F.gelu(torch.bmm(x[:, None, :], w1[e]))                  # [T, 1, H]
            y = y + probs.gather(1, e[:, None]) * torch.bmm(h, w2[e])[:, 0, :]
        y.backward(self.gy.double())
        return y.detach(), {"x": x.grad, "wg": wg.grad, "w1": w1.grad, "w2": w2.grad}

    # ---- timing ------------------------------------------------------------------------------

    def zero_grad(self):
        for p in [self.x, self.wg, self.w1, self.w2] + self.w1_e + self.w2_e:
            p.grad = None

    def step(self, layer):
        self.zero_grad()
        layer(self.x).backward(self.gy)

    def floor_step_fn(self):
        """Six balanced batched GEMMs with preallocated outputs: forward X W1, H W2; backward
        dY W2^T, H^T dY, dH W1^T, X^T dH (each 2*E*rows*M*H FLOPs)."""
        torch, E, M, H = self.torch, self.E, self.M, self.H
        rows = self.T * self.k // E
        mk = lambda *s: torch.randn(*s, device=self.device).to(self.dtype)
        X, dY = mk(E, rows, M), mk(E, rows, M)                           # [E, rows, M]
        W1, W2 = self.w1.detach(), self.w2.detach()                      # [E, M, H], [E, H, M]
        Hh, dH, Y, dX = mk(E, rows, H), mk(E, rows, H), mk(E, rows, M), mk(E, rows, M)
        dW1, dW2 = mk(E, M, H), mk(E, H, M)

        def step():
            torch.bmm(X, W1, out=Hh)
            torch.bmm(Hh, W2, out=Y)
            torch.bmm(dY, W2.transpose(1, 2), out=dH)
            torch.bmm(Hh.transpose(1, 2), dY, out=dW2)
            torch.bmm(dH, W1.transpose(1, 2), out=dX)
            torch.bmm(X.transpose(1, 2), dH, out=dW1)
        return step

    def time_ms(self, step, iters, warmup):
        torch = self.torch
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def check(torch, device="cuda"):
    """Both layers against the float64 reference on CHECK_SHAPE; returns a list of mismatches."""
    M, H, E, T, k = CHECK_SHAPE
    p = Peer(torch, M, H, E, T, k, torch.bfloat16, seed=1, device=device)
    y_ref, g_ref = p.reference()
    bad = []
    for name, layer in (("grouped_mm", p.layer_grouped), ("loop", p.layer_loop)):
        p.zero_grad()
        y = layer(p.x)
        y.backward(p.gy)
        got = {"y": y.detach(), "x": p.x.grad, "wg": p.wg.grad,
               "w1": p.w1.grad if name == "grouped_mm" else torch.stack([w.grad for w in p.w1_e]),
               "w2": p.w2.grad if name == "grouped_mm" else torch.stack([w.grad for w in p.w2_e])}
        for key, ref in (("y", y_ref), *g_ref.items()):
            if got[key] is None:
                bad.append(f"{name} {key}: no gradient")
                continue
            err = ((got[key].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err <= CHECK_TOL:
                bad.append(f"{name} {key}: relative error {err:.3g} > {CHECK_TOL}")
    return bad


def measure(torch, shape, a):
    workload, M, H, E, T, k = shape
    p = Peer(torch, M, H, E, T, k, torch.bfloat16)
    res = {"peer": "torch", "workload": workload, "floor_ms": p.time_ms(p.floor_step_fn(), a.iters, a.warmup)}
    for name, layer in (("torch_grouped_mm", p.layer_grouped), ("torch_loop", p.layer_loop)):
        try:
            res[name + "_ms"] = p.time_ms(lambda layer=layer: p.step(layer), a.iters, a.warmup)
        except (RuntimeError, NotImplementedError) as ex:  # e.g. _grouped_mm on a GPU it does not support
            res[name + "_error"] = str(ex).strip().splitlines()[0][:200]
    res.update(M=M, H=H, E=E, tokens=T, k=k, expert_tflop=expert_tflop(M, H, T, k),
               device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bf16",
               iters=a.iters, warmup=a.warmup, grad="set to None before each step", commit=a.commit,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help="d_model,d_hidden,experts,tokens,top_k (repeatable; default: every shape above)")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--commit", help="the moelab commit these numbers sit beside (recorded as given)")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args(argv)
    shapes = a.shape or list(SHAPES)
    if a.list:
        for w, M, H, E, T, k in shapes:
            print(f"{w or '-':30} d_model {M:5} d_hidden {H:6} experts {E:3} tokens {T:6} top_k {k}")
        return 0
    if a.iters < 1 or a.warmup < 0:
        ap.error("--iters must be at least 1 and --warmup at least 0")
    try:
        import torch
    except ImportError as ex:
        return skip(f"PyTorch cannot be imported ({ex})")
    if not torch.cuda.is_available():
        return skip(f"PyTorch {getattr(torch, '__version__', '?')} sees no CUDA device")
    if not hasattr(torch, "_grouped_mm"):
        print(f"torch_moe.py: PyTorch {torch.__version__} has no torch._grouped_mm: the grouped variant will fail")
    else:
        try:
            bad = check(torch)
        except (RuntimeError, NotImplementedError) as ex:
            bad = [f"the check could not run: {str(ex).strip().splitlines()[0][:200]}"]
        if bad:
            print("torch_moe.py: the layers do not match the float64 reference; nothing timed:\n  "
                  + "\n  ".join(bad), file=sys.stderr)
            return 1
        print(f"torch_moe.py: both layers match the float64 reference (shape {CHECK_SHAPE}, tolerance {CHECK_TOL})",
              file=sys.stderr)
    for shape in shapes:
        line = json.dumps(measure(torch, shape, a))
        torch.cuda.empty_cache()  # the last shape's tensors are gone: give their memory back before the next
        print(line, flush=True)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
