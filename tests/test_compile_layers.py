"""`model.compile_layers`: the teacher-forced passes through compiled decoder layers give the
eager layers' log-probs, the model's own modules stay what state dicts and optimizers see,
and the settings it cannot serve are refused with the fix."""

from __future__ import annotations

import pytest
import torch

from rlhflab.errors import UserError
from rlhflab.models.actor_critic import decoder_and_head, response_hidden
from rlhflab.models.compiled import compile_layers, compiled_layers
from rlhflab.models.load import load_model


def _batch(vocab: int, rows: int = 4, p: int = 6, t: int = 5):
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (rows, p), generator=gen)
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # a left-padded prompt
    response_ids = torch.randint(3, vocab, (rows, t), generator=gen)
    response_mask = torch.ones(rows, t, dtype=torch.long)
    response_mask[1, 3:] = 0  # a short response
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_compiled_passes_equal_the_eager_ones_and_leave_the_model_its_own_layers(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    decoder, head = decoder_and_head(model)
    batch = _batch(model.config.vocab_size)
    keys = list(model.state_dict())
    own = decoder.layers

    def logprobs():
        hidden = response_hidden(model, *batch)
        return torch.log_softmax(head(hidden), -1).gather(-1, batch[2][..., None])[..., 0]

    eager = logprobs()
    assert compile_layers(model) == len(own) - 1
    compiled = logprobs()  # response_hidden enters compiled_layers itself
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    compiled.sum().backward()  # the backward runs through the compiled graphs too
    assert all(p.grad is not None for p in own.parameters())
    assert decoder.layers is own and list(model.state_dict()) == keys  # nothing of the wrappers is kept in it
    with compiled_layers(decoder):
        inside = decoder.layers
    assert inside is not own and inside[-1] is own[-1]  # the last layer stays eager (last_layer_rows' hooks)
    assert all(w._orig_mod is layer for w, layer in zip(inside[:-1], own[:-1]))  # the same weights


def test_compile_layers_refuses_what_it_cannot_serve(tiny_model_dir, ppo_cfg, monkeypatch):
    from rlhflab.config.schema import ModelConfig

    errs = ModelConfig(compile_layers=True, gradient_checkpointing=True).check()
    assert any(e.startswith("compile_layers: gradient_checkpointing is on too") for e in errs)
    assert not ModelConfig(compile_layers=True).check()

    class NoLayers(torch.nn.Module):  # a decoder keeping its blocks under another name (GPT-2: .h)
        base_model_prefix = "transformer"

        def __init__(self):
            super().__init__()
            self.transformer, self.lm_head = torch.nn.Module(), torch.nn.Linear(2, 3)

        def get_output_embeddings(self):
            return self.lm_head

    with pytest.raises(UserError, match=r"compile_layers: Module keeps no list of decoder layers .* set "
                                        r"model.compile_layers: false"):
        compile_layers(NoLayers())

    from rlhflab.trainers import ppo
    from rlhflab.trainers.loop import build_run

    from rlhflab.ops.matmul import onednn_available

    if onednn_available():  # a torch without oneDNN's linear op cannot be asked for it at all
        with pytest.raises(UserError, match=r"compile_layers: the oneDNN linear layers that cpu.matmul "
                                            r"puts on this CPU do not compile; set cpu.matmul: torch"):
            build_run(ppo_cfg("model.compile_layers=true", "cpu.matmul=onednn"), ppo.method(ppo_cfg()))
    from rlhflab.models.setup import build_models

    cfg = ppo_cfg("model.compile_layers=true", "cpu.matmul=torch")  # DPO builds its models the same way
    with pytest.raises(UserError, match=r"compile_layers: not measured with several processes \(2 launched"):
        build_models(cfg.model, cfg.lora, "cpu", need_reference=True, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"compile_layers: not measured with several processes \(2 launched"):
        build_run(ppo_cfg("model.compile_layers=true", "cpu.matmul=torch"), ppo.method(ppo_cfg()))
