"""Float32 linear layers through oneDNN (`ops.matmul`, pure: the caller passes `onednn`;
the library chosen behind the CPU seam, `rlhflab.cpu`, from `cpu.matmul`): the same
function and gradients as `F.linear` to float32 rounding, double-differentiable, the rule
that picks the library, the fallbacks, and a PPO model's gradients under each mode.

The tests ask for oneDNN or force the process's choice (`force`), so they check the oneDNN
path on any CPU, also one where `auto` picks torch's own matmul."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from rlhflab.config import load_config
from rlhflab.errors import UserError
from rlhflab.cpu import matmul as cm
from rlhflab.ops import matmul
from rlhflab import cpu

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(), reason="this torch build has no oneDNN linear op")

AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
AMD_AVX2 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2\n"
INTEL = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse avx2 avx512f avx512bw amx_bf16\n"


def force(monkeypatch, mode: str) -> None:
    """This process's library for the test (the CPU seam's choice; restored after it)."""
    monkeypatch.setattr(cpu, "_matmul", mode)


@pytest.fixture
def onednn(monkeypatch):
    force(monkeypatch, "onednn")


@pytest.fixture
def torchmm(monkeypatch):
    force(monkeypatch, "torch")


def _rel(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


# --------------------------------------------------------------------------------------
# Which library
# --------------------------------------------------------------------------------------
def test_cpu_info_reads_the_first_cpu():
    vendor, flags = cm.cpu_info(AMD + "\n" + INTEL)
    assert vendor == "AuthenticAMD" and {"avx512f", "avx2"} <= flags and "amx_bf16" not in flags


@needs_onednn
@pytest.mark.parametrize("mode,cpuinfo,want", [
    ("auto", AMD, "onednn"),          # MKL runs AVX2 kernels on a non-Intel AVX-512 CPU
    ("auto", INTEL, "torch"),         # MKL's own AVX-512 kernels
    ("auto", AMD_AVX2, "torch"),      # no AVX-512: nothing to win
    ("auto", "", "torch"),            # unknown CPU
    ("onednn", INTEL, "onednn"),
    ("torch", AMD, "torch"),
])
def test_resolve_rule(mode, cpuinfo, want):
    assert cm.resolve(mode, cpuinfo) == want


@needs_onednn
def test_the_default_picks_onednn_only_where_it_paid():
    """cpu.matmul's default follows the measurements on SmolLM2: oneDNN on an AMD EPYC
    with AVX-512 (a third off a step), MKL on an Intel Xeon (where oneDNN was slower)."""
    from dataclasses import fields

    from rlhflab.config.schema import CpuConfig

    default = next(f.default for f in fields(CpuConfig) if f.name == "matmul")
    assert (cm.resolve(default, AMD), cm.resolve(default, INTEL)) == ("onednn", "torch")


def test_bad_mode_names_the_key():
    with pytest.raises(ValueError, match=r"cpu\.matmul: 'fast' is not one of auto, onednn, torch"):
        cm.resolve("fast")


def test_onednn_asked_for_without_the_op_is_a_user_error(monkeypatch):
    monkeypatch.setattr(matmul, "onednn_available", lambda: False)
    monkeypatch.setattr(cpu, "_matmul", None)
    with pytest.raises(UserError, match=r"cpu\.matmul: onednn .* set cpu\.matmul=torch"):
        cpu.setup_process(torch.device("cpu"), types.SimpleNamespace(matmul="onednn"))
    assert cm.resolve("auto", AMD) == "torch"   # auto falls back quietly


def test_config_rejects_an_unknown_mode(tmp_path):
    from rlhflab.trainers.ppo import PPORunConfig

    with pytest.raises(UserError, match=r"cpu\.matmul"):
        load_config(None, PPORunConfig, ["cpu.matmul=mkl"])


# --------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------
@needs_onednn
@pytest.mark.parametrize("shape", [(4, 50, 64), (3, 64)])
def test_linear_values_and_gradients_match_float64(onednn, shape):
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(*shape, generator=g, dtype=torch.float64)
    w64 = torch.randn(96, 64, generator=g, dtype=torch.float64) / 8
    b64 = torch.randn(96, generator=g, dtype=torch.float64)
    up = torch.randn(*shape[:-1], 96, generator=g, dtype=torch.float64)
    x, w, b = (t.float().requires_grad_() for t in (x64, w64, b64))
    assert matmul.applies(x, w, b, onednn=True)
    y = matmul.linear(x, w, b, onednn=True)
    xd, wd, bd = (t.clone().requires_grad_() for t in (x64, w64, b64))
    yd = F.linear(xd, wd, bd)
    grads = torch.autograd.grad(y, (x, w, b), up.float())
    grads_d = torch.autograd.grad(yd, (xd, wd, bd), up)
    # float32 rounding, the size F.linear's own float32 result has (about 1e-7 relative)
    assert y.dtype == torch.float32 and y.shape == yd.shape
    assert _rel(y, yd) < 2e-6
    for got, want in zip(grads, grads_d):
        assert got.shape == want.shape and _rel(got, want) < 2e-6


@needs_onednn
def test_linear_is_differentiable_twice():
    """TRPO differentiates a backward pass (create_graph): second derivatives equal float64's."""
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(40, 32, generator=g, dtype=torch.float64)
    w64 = torch.randn(48, 32, generator=g, dtype=torch.float64) / 6
    up = torch.randn(40, 48, generator=g, dtype=torch.float64)

    def second(x, w, u, fn):
        y = fn(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), u, create_graph=True)
        return torch.autograd.grad(gx.square().sum() + gw.square().sum(), (x, w))

    got = second(x64.float().requires_grad_(), w64.float().requires_grad_(), up.float(),
                 lambda x, w: matmul.linear(x, w, onednn=True))
    want = second(x64.clone().requires_grad_(), w64.clone().requires_grad_(), up, F.linear)
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-6


@needs_onednn
@pytest.mark.parametrize("rows,out_features", [(300, 16), (300, 200), (8, 200)])  # both branches of weight_grad
def test_weight_grad_is_g_transpose_x(rows, out_features):
    g = torch.randn(rows, out_features, dtype=torch.float64)
    x = torch.randn(rows, 64, dtype=torch.float64)
    got = matmul.weight_grad(g.float(), x.float(), onednn=True)
    assert got.shape == (out_features, 64)
    assert _rel(got, g.t() @ x) < 2e-6


@needs_onednn
def test_fallbacks_are_exactly_f_linear():
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    cases = [(x.bfloat16(), w.bfloat16(), None), (x.double(), w.double(), b.double()),
             (torch.randn(0, 8), w, b)]
    for xi, wi, bi in cases:
        assert not matmul.applies(xi, wi, bi, onednn=True)
        assert torch.equal(matmul.linear(xi, wi, bi, onednn=True), F.linear(xi, wi, bi))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not matmul.applies(x, w, b, onednn=True)
        got = matmul.linear(x, w, b, onednn=True)
        assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(x, w, b))


def test_not_asked_is_f_linear():
    x, w, b = torch.randn(5, 8, requires_grad=True), torch.randn(6, 8), torch.randn(6)
    assert not matmul.applies(x, w, b)  # onednn=False by default: no process switch decides
    assert torch.equal(matmul.linear(x, w, b), F.linear(x, w, b))


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
@needs_onednn
def test_fast_linears_keep_the_model_and_its_checkpoint(onednn, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhflab.models.load import load_model

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    fast, tok = load_model(str(tiny_model_dir))
    cm.use_fast_linears(fast)                             # what rlhflab.cpu.apply does under onednn
    assert sum(type(m) is cm.FastLinear for m in fast.modules()) == n_linear > 0
    assert all(isinstance(m, torch.nn.Linear) for m in fast.modules() if type(m) is cm.FastLinear)
    assert list(fast.state_dict()) == list(plain.state_dict())
    ids = tok(["12 + 7 =", "3 * 4 ="], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = plain(**ids).logits
        b = fast(**ids).logits
    assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item() + 1e-6
    fast.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (n1, p1), (n2, p2) in zip(plain.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


@needs_onednn
def test_a_fast_linear_head_keeps_the_chunked_log_probs(onednn, tiny_model_dir, monkeypatch):
    """The LM head switched to FastLinear is still a plain linear map: the log-probs take
    the chunked op, never the (B, T, V) logits. (It once read as 'not nn.Linear', and every
    run on oneDNN materialised the full logits: 1.16 GiB more at Qwen2.5-0.5B's vocabulary
    in bench/real_scale.py's scoring pass.)"""
    from rlhflab import ops
    from rlhflab.models import actor_critic
    from rlhflab.models.head import linear_lm_head
    from rlhflab.models.load import load_model

    model, _ = load_model(str(tiny_model_dir))
    cm.use_fast_linears(model)                            # what rlhflab.cpu.apply does under onednn
    head = model.get_output_embeddings()
    assert type(head) is cm.FastLinear
    lin = linear_lm_head(model)
    assert lin is not None and lin.weight is head.weight
    calls = []
    real = ops.chunked_logprobs
    monkeypatch.setattr(ops, "chunked_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(actor_critic, "head_logits", lambda *a, **k: pytest.fail("full logits made"))
    hidden = torch.randn(2, 3, head.in_features)
    logprobs, _ = actor_critic.token_stats(hidden, head, torch.randint(0, head.out_features, (2, 3)), model=model)
    assert calls == [1] and logprobs.shape == (2, 3)


def test_no_switch_under_torch_mode(torchmm, tiny_model_dir):
    from rlhflab.models.load import load_model

    model, _ = load_model(str(tiny_model_dir))
    assert cpu.apply(model, None, torch.device("cpu")).linears == 0
    assert not any(type(m) is cm.FastLinear for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("lora", [False, True])
def test_ppo_model_gradients_equal_under_both_libraries(monkeypatch, tiny_model_dir, lora):
    """The policy + separate critic (lean MLP, chunked log-probs, LoRA layers): values,
    log-probs, entropy and every gradient of one loss agree between oneDNN and torch's
    own matmul to float32 rounding."""
    from rlhflab.config.schema import LoRAConfig, ModelConfig
    from rlhflab.models.setup import build_models

    results = {}
    for mode in ("torch", "onednn"):
        force(monkeypatch, mode)
        torch.manual_seed(0)
        model_cfg = ModelConfig(name_or_path=str(tiny_model_dir), critic="separate")
        models = build_models(model_cfg, LoRAConfig(enabled=lora, r=4), "cpu", need_reference=False,
                              critic="separate")
        cpu.apply_to_models(models, model_cfg)  # what the run context does on a CPU
        actor, tok = models.actor, models.tokenizer
        fast = sum(type(m) is cm.FastLinear for m in actor.modules())
        assert (fast > 0) == (mode == "onednn")
        if lora:  # a non-zero B, so the adapter changes the function
            for name, p in actor.named_parameters():
                if "lora_B" in name:
                    p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 2**31))
        prompts = tok(["12 + 7 =", "3 * 4 = ?"], return_tensors="pt", padding=True, padding_side="left")
        response = torch.tensor([[5, 9, 11, 4], [7, 3, 2, 8]])
        mask = torch.ones_like(response, dtype=torch.float32)
        out = actor(prompts["input_ids"], prompts["attention_mask"], response, mask,
                    with_values=True, with_entropy=True)
        loss = out.logprobs.sum() + out.values.square().sum() + out.entropy.sum()
        loss.backward()
        results[mode] = (out.logprobs.detach(), out.values.detach(), out.entropy.detach(),
                         {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None})
    (lp_t, v_t, h_t, g_t), (lp_o, v_o, h_o, g_o) = results["torch"], results["onednn"]
    for a, b in ((lp_o, lp_t), (v_o, v_t), (h_o, h_t)):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    assert g_t.keys() == g_o.keys() and len(g_t) > 0
    for name in g_t:
        scale = g_t[name].abs().max().item()
        assert (g_o[name] - g_t[name]).abs().max().item() <= 1e-4 * scale + 1e-7, name


@needs_onednn
@pytest.mark.parametrize("mode", ["onednn", "torch"])
def test_a_run_says_when_its_linears_run_on_onednn(ppo_cfg, mode, monkeypatch, capsys):
    """A run that computes with oneDNN (other float32 rounding than torch's own) says so in
    its first lines; one on torch's own library prints nothing about it."""
    from rlhflab.trainers.ppo import train

    monkeypatch.setattr(cpu, "_matmul", None)  # the run chooses (restored after the test)
    res = train(ppo_cfg(f"cpu.matmul={mode}", "training.total_steps=1"))
    assert res.history and cpu.matmul_library() == mode
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("float32 linear layers")]
    assert said == ([f"float32 linear layers: oneDNN (cpu.matmul: onednn; cpu.matmul=torch for "
                     "torch's own; docs/cpu_matmul.md)"] if mode == "onednn" else [])
