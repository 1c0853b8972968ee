"""Draw the figures of the concepts guide into docs/figures/ with rlhflab's own math.

    python docs/make_figures.py          # from the repository root; needs torch and matplotlib

Every curve comes from a function in `rlhflab.ops` (or `rlhflab.doctor`), so a figure
shows what the library computes, not a re-derivation. Deterministic (fixed seeds).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlhflab.ops import entropy_from_logits, gae, kl_estimate, ppo_policy_loss  # noqa: E402

OUT = ROOT / "docs" / "figures"
DPI = 80


def save(fig, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KB)")
    return path


def clipped_surrogate() -> Path:
    """The PPO objective of one token as a function of the ratio π/π_old, for A = +1 and
    A = -1, from `ppo_policy_loss` (objective = -loss) and its gradient by autograd."""
    eps = 0.2
    ratios = torch.linspace(0.4, 1.6, 241)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=False)
    for ax, adv in zip(axes, (1.0, -1.0)):
        objective, grads = [], []
        for r in ratios:
            logp = torch.log(r).reshape(1, 1).clone().requires_grad_(True)
            out = ppo_policy_loss(logp, torch.zeros(1, 1), torch.full((1, 1), adv), torch.ones(1, 1),
                                  clip_eps=eps)
            out.loss.backward()
            objective.append(-out.loss.item())
            grads.append(-logp.grad.item())      # d objective / d log π
        ax.plot(ratios, [adv * r for r in ratios], ls="--", color="grey", lw=1, label="unclipped  r·A")
        ax.plot(ratios, objective, color="tab:blue", lw=2, label="PPO  min(r·A, clip(r)·A)")
        flat = [r.item() for r, g in zip(ratios, grads) if abs(g) < 1e-9]
        if flat:
            lo, hi = (min(flat), ratios[-1].item()) if adv > 0 else (ratios[0].item(), max(flat))
            ax.axvspan(lo, hi, color="tab:red", alpha=0.08, label="gradient 0 (clipped)")
        for x in (1 - eps, 1 + eps):
            ax.axvline(x, color="k", lw=0.6, ls=":")
        ax.axvline(1.0, color="k", lw=0.6)
        ax.set_title(f"A = {adv:+.0f}: " + ("good token, push its probability up" if adv > 0
                                              else "bad token, push its probability down"), fontsize=9)
        ax.set_xlabel("ratio r = π(token) / π_old(token)")
        ax.set_ylabel("objective (to maximise)")
        ax.legend(fontsize=7, loc="upper left" if adv > 0 else "upper right")
        ax.grid(alpha=0.3)
    return save(fig, "clipped_surrogate.png")


def gae_lambdas() -> Path:
    """Left: advantages of one toy episode for several λ. Right: bias and spread of the
    first token's advantage over many noisy episodes with a slightly wrong critic."""
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    # Toy episode: 8 tokens, a small KL cost per token, the score 1.0 on the last token;
    # the critic expects about 0.6 everywhere.
    t = 8
    rewards = torch.full((1, t), -0.02)
    rewards[0, -1] += 1.0
    values = torch.tensor([[0.55, 0.6, 0.58, 0.62, 0.6, 0.65, 0.7, 0.75]])
    mask = torch.ones(1, t)
    ax = axes[0]
    for lam in (0.0, 0.5, 0.9, 1.0):
        adv = gae(rewards, values, mask, gamma=1.0, lam=lam).advantages[0]
        ax.plot(range(t), adv, marker="o", ms=3, label=f"λ = {lam:g}")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("response token t")
    ax.set_ylabel("advantage A_t")
    ax.set_title("one episode: reward 1.0 at the end, −0.02 KL per token", fontsize=9)
    ax.set_ylim(-0.08, 0.45)
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    ax.grid(alpha=0.3)

    # Bias/variance: 20 steps, each reward ~ N(0, 1), so the true value of every state is
    # 0. The critic overestimates every state by about 1 (1 + 0.3·noise per position). Over 4000
    # episodes, A_0's std is its noise; its mean minus the Monte Carlo (λ = 1) mean is the
    # bias that bootstrapping from the wrong later values brings in.
    g = torch.Generator().manual_seed(0)
    n, t = 4000, 20
    rewards = torch.randn(n, t, generator=g)
    critic_error = 1.0 + 0.3 * torch.randn(1, t, generator=g)   # optimistic by about 1
    values = critic_error.expand(n, t).contiguous()
    mask = torch.ones(n, t)
    lams = [i / 20 for i in range(21)]
    mc = gae(rewards, values, mask, gamma=1.0, lam=1.0).advantages[:, 0]   # G_0 − V_0
    bias, std = [], []
    for lam in lams:
        a0 = gae(rewards, values, mask, gamma=1.0, lam=lam).advantages[:, 0]
        # the part of the error that comes from trusting the critic at later states;
        # V(s_0) itself is a baseline and does not bias the policy gradient
        bias.append((a0.mean() - mc.mean()).abs().item())
        std.append(a0.std().item())
    ax = axes[1]
    ax.plot(lams, std, marker=".", label="noise: std of A_0")
    ax.plot(lams, bias, marker=".", label="bias from the critic's later values")
    ax.set_xlabel("λ  (0 = one-step TD, 1 = Monte Carlo)")
    ax.set_title("20 noisy rewards, a critic that overestimates by ~1", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save(fig, "gae_lambdas.png")


def kl_estimators() -> Path:
    """Left: k1, k2, k3 of one sampled token against d = log π − log π_ref. Middle and
    right: the mean and the std of each estimator (exact, by enumerating a 6-token
    vocabulary) against the true KL as π moves away from π_ref; the inverted-ratio k3
    (a bug seen in the wild) dashed."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    d = torch.linspace(-2, 2, 201).unsqueeze(0)
    zero = torch.zeros_like(d)
    ax = axes[0]
    for kind, label in (("k1", "k1 = d"), ("k2", "k2 = d²/2"), ("k3", "k3 = (r−1) − log r, r = e^(−d)")):
        ax.plot(d[0], kl_estimate(d, zero, kind)[0], label=label)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylim(-2.2, 3.2)
    ax.set_xlabel("d = log π(x) − log π_ref(x) of the sampled token")
    ax.set_title("per-token estimators", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    g = torch.Generator().manual_seed(1)
    ref_logits = torch.randn(6, generator=g)
    direction = torch.randn(6, generator=g)
    ref_lp = torch.log_softmax(ref_logits, -1)
    scales = torch.linspace(0, 3.0, 31)
    kinds = ("k1", "k2", "k3", "k3 inverted")
    means = {k: [] for k in kinds}
    stds = {k: [] for k in kinds}
    true_kl = []
    for s in scales:
        lp = torch.log_softmax(ref_logits + s * direction, -1)
        p = lp.exp()                           # tokens are sampled from π
        true_kl.append((p * (lp - ref_lp)).sum().item())
        for kind in kinds:
            if kind == "k3 inverted":          # the bug: r = π/π_ref (arguments swapped)
                k = kl_estimate(ref_lp.unsqueeze(0), lp.unsqueeze(0), "k3")[0]
            else:
                k = kl_estimate(lp.unsqueeze(0), ref_lp.unsqueeze(0), kind)[0]
            mean = (p * k).sum()
            means[kind].append(mean.item())
            stds[kind].append((p * (k - mean) ** 2).sum().sqrt().item())
    ax = axes[1]
    ax.plot(true_kl, true_kl, color="k", lw=3, alpha=0.25, label="true KL(π‖π_ref)")
    for kind in kinds:
        ax.plot(true_kl, means[kind], ls="--" if kind == "k3 inverted" else "-",
                label=f"E[{kind}]" + ("  (bug)" if kind == "k3 inverted" else ""))
    ax.set_xlabel("true KL(π‖π_ref) in nats")
    ax.set_title("expectation: k1 and k3 unbiased", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    ax = axes[2]
    for kind in kinds[:3]:
        ax.plot(true_kl, stds[kind], label=f"std of {kind}")
    ax.set_xlabel("true KL(π‖π_ref) in nats")
    ax.set_title("spread per sampled token: k3 lowest near 0", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return save(fig, "kl_estimators.png")


def entropy_temperature() -> Path:
    """Entropy of one next-token distribution as the logits sharpen, from
    `entropy_from_logits`: what `loss/entropy` measures, and what 'collapse' looks like."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 1, 50, generator=g) * 2
    sharpen = torch.logspace(-1, 1.5, 60)
    ent = [entropy_from_logits(logits * s)[0, 0].item() for s in sharpen]
    fig, ax = plt.subplots(figsize=(4.8, 3.0))
    ax.semilogx(sharpen, ent)
    ax.axhline(math.log(50), color="grey", ls=":", lw=1, label="uniform over 50 tokens: log 50 = 3.91")
    ax.axhline(0.05, color="tab:red", ls=":", lw=1, label="doctor's entropy floor (0.05)")
    ax.set_xlabel("logit scale (1 / temperature)")
    ax.set_ylabel("entropy (nats)")
    ax.set_title("entropy of one next-token distribution", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save(fig, "entropy.png")


def doctor_example() -> Path:
    """`rlhflab doctor`'s trend plot of a synthetic run that goes wrong at step 25: the
    learning rate is raised, the clip fraction and grad norm jump, KL runs away."""
    import random

    from rlhflab.doctor import DoctorConfig, diagnose, plot_trends

    rng = random.Random(0)
    rows = []
    for t in range(60):
        u = t / 59
        bad = t >= 25
        rows.append({
            "step": t,
            "rollout/reward_mean": 0.1 + 0.4 * min(u, 0.42) + (0.15 * (u - 0.42) if bad else 0) + rng.uniform(-0.03, 0.03),
            "rollout/reward_std": 0.3 + rng.uniform(-0.03, 0.03),
            "loss/value": math.exp(-3 * u) * 0.8 + rng.uniform(0, 0.05),
            "loss/entropy": (1.1 - 0.3 * u if not bad else 0.97 * 0.93 ** (t - 25)) + rng.uniform(-0.02, 0.02),
            "params/policy_clip_frac": (0.05 if not bad else 0.38 + 0.004 * (t - 25)) + rng.uniform(-0.02, 0.02),
            "params/value_clip_frac": 0.1 + rng.uniform(-0.02, 0.02),
            "params/approx_kl": (0.01 if not bad else 0.08) + rng.uniform(0, 0.005),
            "params/kl_to_ref": 0.1 * (1 - math.exp(-4 * u)) + (0.3 * 1.12 ** (t - 25) - 0.3 if bad else 0),
            "params/grad_norm": (3.0 if not bad else 14 + 0.4 * (t - 25)) + rng.uniform(-1, 1),
        })
    doctor = diagnose(rows)
    path = plot_trends(rows, OUT / "doctor_example.png", doctor.findings, DoctorConfig(),
                       title="rlhflab doctor: learning rate raised 10x at step 25")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KB); findings: "
          + ", ".join(f"{f.rule}@{f.step}" for f in doctor.findings))
    return path


FIGURES = (clipped_surrogate, gae_lambdas, kl_estimators, entropy_temperature, doctor_example)

if __name__ == "__main__":
    torch.set_num_threads(1)
    for make in FIGURES:
        make()
