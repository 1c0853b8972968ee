"""The one registry of training methods: every list that names the methods reads it.

    rlhflab <command>            cli.COMMANDS          (command, module, help)
    rlhflab config show <cmd>    config.cli.SCHEMAS    (command -> "module:RunConfig")
    rlhflab doctor               doctor's method guess (the config section)
    scripts/compare_methods.py   the policy methods it runs (`compare=True`)

A method is one module under rlhflab/trainers/ with `add_parser`, `run`, `train` and its
run config; adding one is a line here (docs/adding_a_method.md). Standard library only:
`rlhflab --help` reads this without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One training method, as the command line, the config and the doctor know it."""

    command: str           # `rlhflab <command>`, e.g. "reinforce-pp"
    module: str            # its trainer module, e.g. "rlhflab.trainers.reinforce_pp"
    schema: str            # its run config class in that module, e.g. "ReinforcePPRunConfig"
    help: str              # the one line `rlhflab --help` shows
    policy: bool = False   # a policy-optimisation method (its loop is trainers.loop)
    doctor: bool = True    # the doctor knows its metrics (its section names the method)
    compare: bool = False  # scripts/compare_methods.py runs it (configs/<section>_quickstart.yaml)

    @property
    def section(self) -> str:
        """Its config section (and the name on its checkpoints): the command with '_'."""
        return self.command.replace("-", "_")

    @property
    def schema_path(self) -> str:
        return f"{self.module}:{self.schema}"


# The order is the pipeline's: supervised stages, then the policy methods, then DPO.
METHODS: tuple[Method, ...] = (
    Method("sft", "rlhflab.trainers.sft", "SFTRunConfig",
           "supervised fine-tuning (LoRA or full) on instruction data"),
    Method("rm", "rlhflab.trainers.rm", "RMRunConfig", "train a Bradley-Terry reward model on preference pairs"),
    Method("classifier", "rlhflab.trainers.classifier", "ClassifierRunConfig",
           "train a sequence classifier on labelled texts (for type: classifier rewards)", doctor=False),
    Method("ppo", "rlhflab.trainers.ppo", "PPORunConfig",
           "PPO with a value head or separate critic, KL to a reference", policy=True, compare=True),
    Method("grpo", "rlhflab.trainers.grpo", "GRPORunConfig", "GRPO: group-relative advantages, no critic",
           policy=True, compare=True),
    Method("rloo", "rlhflab.trainers.rloo", "RLOORunConfig", "RLOO: leave-one-out baseline, no critic",
           policy=True, compare=True),
    Method("reinforce-pp", "rlhflab.trainers.reinforce_pp", "ReinforcePPRunConfig",
           "REINFORCE++: KL-shaped returns whitened over the batch, no critic", policy=True, compare=True),
    Method("dr-grpo", "rlhflab.trainers.dr_grpo", "DrGRPORunConfig",
           "Dr. GRPO: GRPO without the std and length normalisations", policy=True, compare=True),
    Method("gspo", "rlhflab.trainers.gspo", "GSPORunConfig",
           "GSPO: GRPO with one clipped importance ratio per response", policy=True),
    Method("trpo", "rlhflab.trainers.trpo", "TRPORunConfig",
           "TRPO (teaching): natural-gradient step by conjugate gradient, KL line search", policy=True),
    Method("dpo", "rlhflab.trainers.dpo", "DPORunConfig", "DPO/IPO/hinge on offline preference pairs"),
)

BY_COMMAND: dict[str, Method] = {m.command: m for m in METHODS}


def method_sections() -> tuple[str, ...]:
    """The config sections that name a method the doctor knows, in registry order."""
    return tuple(m.section for m in METHODS if m.doctor)
