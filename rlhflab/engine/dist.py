"""Processes: the only module that knows about ranks.

One process is the default and the case every other module is written for: `Dist()`
with world size 1 makes every reduction the identity, and nothing here imports
accelerate. Under `accelerate launch` or `torchrun` (WORLD_SIZE > 1 in the environment)
`init_dist` builds an `accelerate.Accelerator`, which wraps the trained module for the
strategy the launcher's config names (DDP, FSDP, DeepSpeed ZeRO); this module adds only
what the algorithms need on top:

- global statistics: sums over every rank (`sum`, `max`), from which come the token-mean
  normaliser and metric averages, and the batch statistics written once below
  (`batch_moments`, `whiten`, `group_advantages`); the ops receive them as arguments
  and never communicate;
- sharding: each rank takes a contiguous, equal share of the step's prompts or rows;
- the backward pass under gradient accumulation (`no_sync` on every micro-batch but the
  last of a group) and the gradient-norm clip of the whole, possibly sharded, model;
- the main process (`is_main`), which alone writes to disk;
- under FSDP2, the moves between sharded and whole weights (below).

FSDP2. Under a launcher config with `distributed_type: FSDP` accelerate shards the trained
module itself on GPUs; on a CPU (gloo) accelerate runs plain DDP instead, so `prepare`
calls torch's own `fully_shard` (one unit per decoder layer, then the root), the layout
accelerate gives it on GPUs. Either way the trained module's parameters, gradients and
Adam state are 1/N per rank during the update. Everything else an RL step does
(generation, the scoring passes, evaluation, the finite-weights probe) runs with
the root unit gathered (embeddings, LM head, value head) and the decoder layers sharded,
each gathered for its own forward: every rank runs the same passes (HF generation in
lockstep), and a rank never holds more than one layer's full weights beyond its shards
(`hold(module, "root")`). The evaluation SFT, DPO and the reward model run on rank 0
alone, and the probe before their saves, gather the whole module for a moment
(`holding(module, "whole")`). Checkpoints gather a full state dict to rank 0
(`full_state`), which writes the same folders as one process.

Data-parallel gradients are averaged over ranks by DDP/FSDP. A loss divided by a global
count must be summed over ranks, so the engine multiplies it by the world size before
`backward` (`scale`): N processes then compute the gradient one process would.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from rlhflab import ops
from rlhflab.errors import UserError
from rlhflab.rollout import LOCKSTEP_ATTR

ENGINE_DIR = "deepspeed"  # a DeepSpeed run's checkpoint keeps the engine's own state here
ENGINE_TAG = "state"


class Forward(torch.nn.Module):
    """`fn(model, *args)` as a module's forward: a data-parallel wrapper (DDP, FSDP) hooks
    a module's forward, so a loss computed from a model's parts (its decoder and head,
    as SFT's chunked NLL or DPO's sequence log-probs do) goes through one of these."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def even_share(rows: Sequence, world_size: int, rank: int) -> list:
    """This rank's contiguous share of a batch's rows; a remainder that does not divide
    is dropped (at most world_size − 1 rows, only in the last batch of an epoch)."""
    size = len(rows) // world_size
    return list(rows[rank * size : (rank + 1) * size])


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun / accelerate launch set it (1 without a launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@dataclass
class Dist:
    """This process's place among the processes of a run (one process by default)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    accelerator: Any = None  # an accelerate.Accelerator when launched with several processes
    fsdp_here: bool = False  # FSDP asked for on a CPU: `prepare` shards with torch's fully_shard
    reshard_after_forward: bool = True  # the config's fsdp_reshard_after_forward
    _boundary: bool = True  # DeepSpeed: whether the micro-batch in `accumulating` ends its group
    trained: list | None = None  # under FSDP: the optimizer's (sharded) parameters, which `prepare` made
    held: str = "sharded"  # under FSDP: which units of the trained module are kept gathered (`hold`)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def strategy(self) -> str:
        """no, ddp, fsdp or deepspeed."""
        if self.accelerator is None:
            return "no"
        if self.fsdp_here:
            return "fsdp"
        kind = str(self.accelerator.distributed_type).rsplit(".", 1)[-1].lower()
        return {"fsdp": "fsdp", "deepspeed": "deepspeed"}.get(kind, "ddp")

    # ---------------------------------------------------------------- reductions
    def sum(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """The sum over ranks (float64 on the wire); a float in, a float out."""
        if not self.distributed:
            return value
        import torch.distributed as tdist
        t = torch.as_tensor(value, dtype=torch.float64).clone().to(self._device())
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return float(t) if not isinstance(value, torch.Tensor) else t.to(value.dtype).to(value.device)

    def mean(self, value: float) -> float:
        return self.sum(value) / self.world_size if self.distributed else value

    def max(self, value: float) -> float:
        """The largest of every rank's `value` (exact in any order; the pivot of the
        batch statistics, `batch_moments`)."""
        if not self.distributed:
            return value
        import torch.distributed as tdist
        t = torch.tensor(float(value), dtype=torch.float64, device=self._device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as tdist
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The main process's `obj`, on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as tdist
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn, default: Any = None) -> Any:
        """`fn()` on the main process, its result on every rank; a `UserError` it raises
        is raised on every rank (the others would otherwise wait for it forever)."""
        if not self.distributed:
            return fn()
        out, err = default, None
        if self.is_main:
            try:
                out = fn()
            except UserError as exc:
                err = str(exc)
        err = self.broadcast(err)
        if err is not None:
            raise UserError(err)
        return out if self.is_main else default

    def everywhere(self, fn, where: str = "") -> Any:
        """`fn()` on every rank; a `UserError` raised on any rank is raised on every rank (the
        lowest rank's, naming that rank when it is not 0, with `where` after it), so that no
        rank goes on alone into a collective the others never reach (two machines can see
        different files at one path)."""
        if not self.distributed:
            return fn()
        out, err = None, None
        try:
            out = fn()
        except UserError as exc:
            err = str(exc)
        errs = self.gather(err)
        for rank, e in enumerate(errs):
            if e is not None:
                raise UserError(e if rank == 0 else f"{e} (on rank {rank}{where})")
        return out

    def barrier(self) -> None:
        if self.distributed:
            self.accelerator.wait_for_everyone()

    @property
    def device(self) -> torch.device | None:
        """The accelerator's device for this rank (None in one process: the config decides)."""
        return self.accelerator.device if self.accelerator is not None else None

    def _device(self) -> torch.device:
        return self.accelerator.device if self.accelerator is not None else torch.device("cpu")

    # ---------------------------------------------------------------- data
    def shard(self, items: Sequence, what: str) -> list:
        """This rank's contiguous share of `items` (equal shares; `what` names it in the error)."""
        n = len(items)
        if n % self.world_size:
            raise UserError(f"{what}: {n} does not divide among {self.world_size} processes; "
                            f"make it a multiple of {self.world_size}")
        size = n // self.world_size
        return list(items[self.rank * size : (self.rank + 1) * size])

    def local(self, n: int, key: str) -> int:
        """A global count (a config value) as this rank's share; one-line error when it does not divide."""
        if n % self.world_size:
            raise UserError(f"{key}: {n} does not divide among {self.world_size} processes; "
                            f"set it to a multiple of {self.world_size}")
        return n // self.world_size

    # ---------------------------------------------------------------- training
    def prepare(self, module: torch.nn.Module, optimizer=None, max_grad_norm: float | None = None):
        """The module wrapped for the strategy (DDP, FSDP, DeepSpeed), and the optimizer.
        `max_grad_norm`: DeepSpeed clips inside its own step, so it is told the method's."""
        if not self.distributed:
            return module, optimizer
        if self.strategy == "deepspeed":
            return self._prepare_deepspeed(module, optimizer, max_grad_norm)
        if self.fsdp_here:
            _fully_shard(module, self.world_size, self.reshard_after_forward, optimizer)
        elif optimizer is None:
            return self.accelerator.prepare(module), None
        else:
            module, optimizer = self.accelerator.prepare(module, optimizer)
        if self.strategy == "fsdp" and optimizer is not None:  # the parameters sharding made replace the old
            self.trained = [p for group in optimizer.param_groups for p in group["params"]]
        return module, optimizer

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(module) if self.distributed else module

    @property
    def scale(self) -> float:
        """What a loss divided by a global count is multiplied by before backward (DDP averages)."""
        return float(self.world_size)

    def _prepare_deepspeed(self, module, optimizer, max_grad_norm):
        """The DeepSpeed engine around `module`. rlhflab makes its own micro-batches and
        accumulation groups, so DeepSpeed counts one micro-batch of one row per step
        (bookkeeping only) and is told each group's end by `accumulating`; it clips at the
        method's max_grad_norm inside its step. Under ZeRO-3 the LM head's weight, which the
        chunked log-prob ops read outside the head's own forward, is gathered with the
        module's forward, and so are the projections a lean MLP reads (`register_external_parameter`)."""
        plugin = self.accelerator.state.deepspeed_plugin
        plugin.deepspeed_config.update({
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": self.world_size,
            "gradient_clipping": float(max_grad_norm) if max_grad_norm not in (None, float("inf")) else 0.0})
        module, optimizer = self.accelerator.prepare(module, optimizer)
        if self.zero3:
            from deepspeed.runtime.zero import register_external_parameter

            from rlhflab.models.lean import read_past_forward
            root = module.module
            for sub in root.modules():
                head = sub.get_output_embeddings() if hasattr(sub, "get_output_embeddings") else None
                if isinstance(head, torch.nn.Linear):
                    for param in (head.weight, head.bias):
                        if param is not None:
                            register_external_parameter(root, param)
            for owner, param in read_past_forward(root):  # the lean MLPs' projections
                register_external_parameter(owner, param)
            mark_lockstep(root, True)
        return module, optimizer

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO stage 3 (parameters partitioned: forward passes gather them)."""
        if self.strategy != "deepspeed":
            return False
        return int(self.accelerator.state.deepspeed_plugin.zero_stage) == 3

    @property
    def lockstep(self) -> bool:
        """Whether forward passes outside the update communicate, so every rank must run the
        same ones (FSDP, ZeRO-3): an evaluation pads a rank's batches to the others' count."""
        return self.strategy == "fsdp" or self.zero3

    @contextmanager
    def accumulating(self, module: torch.nn.Module, last: bool) -> Iterator[None]:
        """No gradient all-reduce on a micro-batch that is not the last of its group
        (FSDP2: no reduce-scatter; the unsharded gradients accumulate until the last;
        DeepSpeed: the group's end is its accumulation boundary, where it steps)."""
        if self.strategy == "deepspeed":
            self._boundary = last
            yield
            return
        units = fsdp_units(module) if self.strategy == "fsdp" else []
        if units:
            units[0].set_requires_gradient_sync(last)  # recursive: every unit
            yield
            return
        ctx = self.accelerator.no_sync(module) if (self.distributed and not last) else nullcontext()
        with ctx:
            yield

    # ---------------------------------------------------------------- FSDP2: what is gathered when
    def hold(self, module: torch.nn.Module, what: str) -> None:
        """Put `module`'s FSDP2 units in one of three states (no-op without FSDP):

        - "sharded": every unit sharded, gathered layer by layer inside a forward through
          the root and freed after it (the update);
        - "root": the root unit (embeddings, LM head, final norm, value head) gathered and
          kept, the decoder layers sharded and gathered one at a time in their forward:
          any submodule's forward (generation, the scoring pass) works without the root's
          forward, and every rank must run the same forward passes (decoding in lockstep);
        - "whole": every unit gathered and kept: forward passes run no collective, so one
          rank may run them alone (rank 0's evaluation, the probe before a save).
        """
        units = fsdp_units(module) if self.strategy == "fsdp" else []
        if not units:
            return
        root = units[0]
        root._get_fsdp_state()._lazy_init()  # FSDP2's set-up from the root, as its first forward does
        if hasattr(root, "reset_iter_state"):
            # Forward passes record their order per rank for the next backward's prefetch;
            # after passes one rank ran alone, the ranks would prefetch different units.
            root.reset_iter_state()
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
        root.set_reshard_after_forward(False, recurse=False)  # FSDP2's own default for the root
        keep = {"sharded": [], "root": [root], "whole": units}[what]
        for unit in keep:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        mark_lockstep(module, what != "whole")
        self.held = what

    @contextmanager
    def holding(self, module: torch.nn.Module, what: str) -> Iterator[None]:
        """`hold(module, what)` inside, the previous state after (every rank enters it)."""
        before = self.held
        self.hold(module, what)
        try:
            yield
        finally:
            self.hold(module, before)

    def full_state(self, module: torch.nn.Module, optimizer=None) -> tuple[dict | None, dict | None]:
        """What rank 0 saves beside (or instead of) the module's own state, as (model state,
        optimizer state); (None, None) on the other ranks. A collective every rank calls.
        FSDP2: the full state dicts, the optimizer's keyed by parameter name. DeepSpeed: the
        gathered weights under ZeRO-3 (None under ZeRO-2, whose weights are whole) and, for
        the optimizer, a pointer to DeepSpeed's own checkpoint (`stage_engine_state`).
        DDP and one process: (None, None), the module's own state is whole."""
        if self.strategy == "deepspeed":
            # The weights: ZeRO-3 gathers its partitions (zero3_save_16bit_model) to rank 0;
            # under ZeRO-2 they are whole on every rank. The optimizer state is DeepSpeed's
            # own checkpoint (`stage_engine_state`); the trainer state only points at it.
            model_state = self.accelerator.get_state_dict(module) if self.zero3 else None
            return (model_state, {"deepspeed": ENGINE_DIR}) if self.is_main else (None, None)
        if not fsdp_units(module):
            return None, None
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with self.holding(module, "sharded"):
            model_state = get_model_state_dict(module, options=opts)
            optim_state = get_optimizer_state_dict(module, optimizer, options=opts) if optimizer is not None else None
        return (model_state, optim_state) if self.is_main else (None, None)

    def stage_engine_state(self, module, folder: Path) -> Path | None:
        """DeepSpeed: every rank writes its partitions of the engine's state (weights and
        optimizer, DeepSpeed's own checkpoint format) to a staging folder beside `folder`,
        which the main process moves into the checkpoint (`save_checkpoint(engine_state=)`).
        None under any other strategy."""
        if self.strategy != "deepspeed":
            return None
        stage = folder.parent / f".{folder.name}.{ENGINE_DIR}"
        if self.is_main and stage.exists():
            shutil.rmtree(stage)
        self.barrier()
        module.save_checkpoint(str(stage), tag=ENGINE_TAG)
        self.barrier()
        return stage

    def load_optimizer(self, module: torch.nn.Module, optimizer, state: dict, folder: Path | None = None) -> None:
        """A saved optimizer state into `optimizer`: the full, name-keyed state an FSDP2 run
        saved (each rank keeps its shard), DeepSpeed's own checkpoint in `folder`/deepspeed
        (each rank loads its partitions), or the plain state dict of any other run."""
        if self.strategy == "deepspeed":
            module.load_checkpoint(str(Path(folder) / ENGINE_DIR), tag=ENGINE_TAG, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
            return
        if not fsdp_units(module):
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        with self.holding(module, "sharded"):
            set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def backward(self, loss: torch.Tensor) -> None:
        if self.strategy == "deepspeed":
            # DeepSpeed's engine runs the optimizer step itself at the boundary (with its
            # clipping and zeroing of the gradients); the optimizer's own step is a no-op.
            engine = self.accelerator.deepspeed_engine_wrapped.engine
            engine.set_gradient_accumulation_boundary(is_boundary=self._boundary)
            engine.backward(loss)
            if self._boundary:
                engine.step()
            return
        if self.distributed:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def clip_grad_norm_(self, params: list, max_norm: float) -> float:
        """Clip the global gradient norm; returns the norm before clipping. Under FSDP the
        parameters are the sharded ones `prepare` made (a list taken before it is stale)."""
        if self.trained is not None:
            params = self.trained
        if self.strategy == "deepspeed":  # clipped in DeepSpeed's step already; its norm before clipping
            norm = self.accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        if self.fsdp_here:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if self.distributed:
            return float(self.accelerator.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


# ---------------------------------------------------------------- statistics over every rank
# One variance convention for every statistic of the whole batch (every rank's tokens or
# responses): the population variance, Σ(x − mean)² / n (docs/conventions.md, 1). It is
# what token whitening always used; GRPO's `advantage_scale: batch` std and RLOO's
# `normalize_advantages` used n − 1 before and now divide by n too (a factor
# sqrt((n − 1)/n): 0.992 at n = 64 responses). A group's own std (GRPO's default scale,
# inside one prompt's k responses, which never straddle ranks) is not a batch statistic
# and keeps n − 1, as every tool computes it (ops.group_advantages). Leave-one-out
# baselines (RLOO) are per prompt, so they need no reduction either.
class BatchMoments(NamedTuple):
    """The statistics of a batch's real elements over every rank."""

    count: float  # n: real elements over every rank
    mean: float   # their mean
    var: float    # Σ (x − mean)² / n, the population variance (the one convention above)


def batch_moments(x: torch.Tensor, mask: torch.Tensor | None, dist: Dist) -> BatchMoments:
    """n, mean and variance of `x` where `mask` is 1 (None: every element), over every
    rank, computed as one process computes them (`ops.masked_whiten`): first shifted by the
    pivot, the largest real value of any rank (`ops.masked_pivot`, then `max`), which is
    one of the values, so a constant batch is exactly 0 before any sum and its variance
    exactly 0; then the mean of the shifted values, then the squares around it (two
    passes, float64 sums on the wire). One process: the same arithmetic, no reduction."""
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    count = max(dist.sum(float(m.sum())), 1.0)
    pivot = dist.max(float(ops.masked_pivot(x, m)) if bool(m.bool().any()) else -math.inf)
    pivot = 0.0 if pivot == -math.inf else pivot   # no real element on any rank
    d = x - pivot                                  # the pivot is one of the values: exact 0 where equal
    mean_d = dist.sum(float((d * m).sum())) / count
    var = dist.sum(float(((d - mean_d).square() * m).sum())) / count
    return BatchMoments(count, pivot + mean_d, var)


def whiten(x: torch.Tensor, mask: torch.Tensor, dist: Dist, shift_mean: bool = True) -> torch.Tensor:
    """`ops.masked_whiten` over every rank's real tokens (`batch_moments`): on one process
    the op's own statistics, under several the reduced ones passed into it."""
    if not dist.distributed:
        return ops.masked_whiten(x, mask, shift_mean=shift_mean)
    mom = batch_moments(x, mask, dist)
    return ops.masked_whiten(x, mask, shift_mean=shift_mean, mean=mom.mean, var=mom.var)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, dist: Dist) -> float:
    """`ops.explained_variance` over every rank's real tokens (`batch_moments` of the returns
    and of returns − values, passed into the op); NaN when the returns do not vary."""
    if not dist.distributed:
        return float(ops.explained_variance(values, returns, mask))
    var_returns = batch_moments(returns.double(), mask, dist).var
    var_residual = batch_moments((returns - values).double(), mask, dist).var
    return float(ops.explained_variance(values, returns, mask, var_returns=var_returns, var_residual=var_residual))


def group_advantages(scores: torch.Tensor, group_size: int, scale: str, dist: Dist) -> torch.Tensor:
    """`ops.group_advantages`; with scale "batch" the std is that of every rank's scores
    (`batch_moments` in float64, the population convention), passed into the op."""
    batch_std = None
    if scale == "batch":
        batch_std = batch_moments(scores.double(), None, dist).var ** 0.5
    return ops.group_advantages(scores, group_size, scale, batch_std=batch_std)


def default_threads(dist: Dist, device: str) -> int | None:
    """Torch CPU threads per rank when the config leaves them unset: the cores shared
    equally among this machine's ranks (None: torch's own default, one process)."""
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not (dist.distributed and cpu):
        return None
    return max(1, (os.cpu_count() or 1) // dist.local_world_size)


def init_dist(device: str = "auto") -> Dist:
    """The run's `Dist`: one process, or the launcher's processes through accelerate.

    On CPU each rank gets an equal share of the cores as torch threads (2 ranks on 2
    cores: one thread each), unless training.num_threads says otherwise.
    """
    # deepspeed is imported only where a DeepSpeed strategy runs, for trainers called from
    # Python too (the CLI does this before any import): rlhflab/thirdparty.py says why.
    from rlhflab.thirdparty import defer_deepspeed
    defer_deepspeed()
    world = launched_world_size()
    if world <= 1:
        return Dist()
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - accelerate is a dependency
        raise UserError("several processes need accelerate (pip install accelerate)") from None
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    fsdp_here, reshard = cpu and _env_flag("ACCELERATE_USE_FSDP"), _env_flag("FSDP_RESHARD_AFTER_FORWARD", True)
    if fsdp_here:
        check_fsdp_on_cpu()
    kwargs: dict[str, Any] = {"cpu": cpu}
    deepspeed = _env_flag("ACCELERATE_USE_DEEPSPEED")
    if deepspeed:
        check_deepspeed_installed()
    if cpu and deepspeed:
        # DeepSpeed on a CPU: accelerate turns `cpu=True` into plain DDP, and without CUDA it
        # finds no process-group backend (each rank then believes it is alone); gloo, named
        # here, gives DeepSpeed's CPU accelerator its process group.
        from accelerate.utils import InitProcessGroupKwargs
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from rlhflab.thirdparty import skip_deepspeed_shm_op
        skip_deepspeed_shm_op()  # an inference-only op that DeepSpeed would compile first (thirdparty.py)
        kwargs = {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    try:
        acc = Accelerator(**kwargs)
    except (ImportError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"the launcher's accelerate config cannot start here ({first}); check the "
                        f"--config_file you gave `accelerate launch` (configs/accelerate/ has working ones)") from None
    if str(acc.distributed_type).endswith("DEEPSPEED"):
        # accelerate announces ZeRO-3 to transformers, whose from_pretrained would then load
        # every model already partitioned; rlhflab loads them whole (the frozen reference and
        # reward models stay whole on each rank) and DeepSpeed partitions the trained module
        # when it wraps it (as zero3_init_flag: false says).
        from transformers.integrations import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
    atexit.register(_close_process_group)
    return Dist(acc.process_index, acc.num_processes, local, acc, fsdp_here, reshard)


def _env_flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in ("1", "true", "yes")


def check_deepspeed_installed() -> None:
    """A DeepSpeed launcher config without DeepSpeed: one line, before anything loads."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("distributed_type: DEEPSPEED in the accelerate config, but DeepSpeed is not installed; "
                        "pip install -e '.[deepspeed]' (make venv installs it), or launch with "
                        "configs/accelerate/fsdp.yaml (fsdp_cpu.yaml on a CPU)")


def check_fsdp_on_cpu() -> None:
    """What an FSDP launcher config may ask for on a CPU (gloo): FSDP2, no offload."""
    if os.environ.get("FSDP_VERSION", "1").strip() != "2":
        raise UserError("fsdp_config.fsdp_version: FSDP on a CPU runs FSDP2 (torch's fully_shard); set "
                        "fsdp_version: 2 in the accelerate config (configs/accelerate/fsdp_cpu.yaml has it)")
    if _env_flag("FSDP_OFFLOAD_PARAMS"):
        raise UserError("fsdp_config.fsdp_offload_params: the parameters already live on the CPU; set it to false")


def fsdp_units(module: torch.nn.Module) -> list:
    """The FSDP2 units in `module`, the outermost first ([] when it is not sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def mark_lockstep(module: torch.nn.Module, lockstep: bool) -> None:
    """Record on every submodule whether its forward passes communicate (FSDP2 layers held
    sharded, ZeRO-3), so that generation runs in step with the other ranks (generation
    reads it: `rlhflab.rollout.hf.lockstep_of`)."""
    for sub in module.modules():
        setattr(sub, LOCKSTEP_ATTR, lockstep)


def _layer_classes(module: torch.nn.Module) -> set[str]:
    """The decoder-layer classes of the transformers models inside `module` (their
    `_no_split_modules`): one FSDP unit each, as accelerate's TRANSFORMER_BASED_WRAP does."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _fully_shard(module: torch.nn.Module, world_size: int, reshard_after_forward: bool, optimizer=None) -> None:
    """torch's FSDP2 on `module` over every rank (a unit per decoder layer, then the root),
    then the optimizer pointed at the sharded parameters, which replace the old ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = {id(p): n for n, p in module.named_parameters()}
    order = ([[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
             if optimizer is not None else [])
    layers = _layer_classes(module)
    if not layers:
        raise UserError(f"FSDP: {type(module).__name__} holds no transformers model whose decoder layers "
                        f"FSDP can shard one by one; use configs/accelerate/cpu_2proc.yaml (DDP)")
    mesh = init_device_mesh("cpu", (world_size,))
    for sub in list(module.modules()):
        if type(sub).__name__ in layers:
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    now = dict(module.named_parameters())
    for group, group_names in zip(optimizer.param_groups if optimizer is not None else [], order):
        group["params"] = [now[n] for n in group_names]


def _close_process_group() -> None:
    """Destroy the process group at exit, as torch asks of every process that made one
    (an exit handler, so that a run that raises does it too). Not enough on its own
    against the abort in the interpreter's teardown: `leave` says why."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave(rc: int) -> None:
    """End the process with exit status `rc`. One process: `sys.exit(rc)`. A rank of a
    launch (WORLD_SIZE > 1, as init_dist decides) runs every exit handler (the process
    group's destruction among them, logging's and trackers' flushes), flushes stdout and
    stderr, and ends with `os._exit(rc)`,
    skipping the interpreter's teardown. After DDP on gloo a rank can abort in that
    teardown with its work done, the group destroyed first or not (SIGABRT, "terminate
    called without an active exception"; a probe since removed from bench/ counted how often), and the
    launcher then fails the whole launch.
    Threads still running are not waited for; rlhflab leaves none that write."""
    if launched_world_size() <= 1:
        sys.exit(rc)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to keep
            pass
    os._exit(rc)


def check_strategy(dist: Dist, lora: bool, method: str, backend: str = "hf", rl: bool = True) -> None:
    """What the launcher's strategy does not run, refused in one line before any model loads.
    `rl`: an RL trainer (its evaluation runs on every rank; SFT, DPO and RM evaluate on rank 0)."""
    if method == "trpo" and dist.distributed:
        raise UserError("trpo: the teaching TRPO runs in one process; use ppo or grpo under accelerate launch")
    check_deepspeed(dist, lora, method, backend, rl)
    if dist.strategy != "fsdp":
        return
    if backend != "hf":
        raise UserError(f"generation.backend={backend} under FSDP: the engine's weight push is not written for "
                        f"sharded weights yet; set generation.backend=hf, or launch with configs/accelerate/ddp.yaml")


def check_deepspeed(dist: Dist, lora: bool, method: str, backend: str = "hf", rl: bool = True) -> None:
    """What rlhflab does not run under DeepSpeed, refused in one line before any model loads."""
    if dist.strategy != "deepspeed":
        return
    if dist.zero3 and (lora or backend != "hf" or not rl):
        what = ("lora.enabled" if lora else f"generation.backend={backend}" if backend != "hf" else
                f"{method} (its evaluation runs on rank 0 alone)")
        raise UserError(f"{what} under ZeRO-3 is not supported; launch with configs/accelerate/zero2.yaml or "
                        f"fsdp.yaml")
