"""Processes: the only module that knows about ranks.

One process is the default and the case every other module is written for: `Dist()`
with world size 1 makes every reduction the identity, and nothing here imports
accelerate. Under `accelerate launch` or `torchrun` (WORLD_SIZE > 1 in the environment)
`init_dist` builds an `accelerate.Accelerator`, which wraps the trained module for the
strategy the launcher's config names (DDP, FSDP, DeepSpeed ZeRO); this module adds only
what the algorithms need on top:

- global statistics: sums over every rank (`sum`), from which the trainers take the
  token-mean normaliser, whitening means and variances, and metric averages; the ops
  receive them as arguments and never communicate;
- sharding: each rank takes a contiguous, equal share of the step's prompts or rows;
- the backward pass under gradient accumulation (`no_sync` on every micro-batch but the
  last of a group) and the gradient-norm clip of the whole, possibly sharded, model;
- the main process (`is_main`), which alone writes to disk.

Data-parallel gradients are averaged over ranks by DDP/FSDP. A loss divided by a global
count must be summed over ranks, so the engine multiplies it by the world size before
`backward` (`scale`): N processes then compute the gradient one process would.
"""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from rlhflab.errors import UserError


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
    def prepare(self, module: torch.nn.Module, optimizer=None):
        """The module wrapped for the strategy (DDP, FSDP, DeepSpeed), and the optimizer."""
        if not self.distributed:
            return module, optimizer
        if optimizer is None:
            return self.accelerator.prepare(module), None
        return self.accelerator.prepare(module, optimizer)

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(module) if self.distributed else module

    @property
    def scale(self) -> float:
        """What a loss divided by a global count is multiplied by before backward (DDP averages)."""
        return float(self.world_size)

    @contextmanager
    def accumulating(self, module: torch.nn.Module, last: bool) -> Iterator[None]:
        """No gradient all-reduce on a micro-batch that is not the last of its group."""
        ctx = self.accelerator.no_sync(module) if (self.distributed and not last) else nullcontext()
        with ctx:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.distributed:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def clip_grad_norm_(self, params: list, max_norm: float) -> float:
        """Clip the global gradient norm; returns the norm before clipping."""
        if self.distributed:
            return float(self.accelerator.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


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
    world = launched_world_size()
    if world <= 1:
        return Dist()
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - accelerate is a dependency
        raise UserError("several processes need accelerate (pip install accelerate)") from None
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    try:
        acc = Accelerator(cpu=cpu)
    except (ImportError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"the launcher's accelerate config cannot start here ({first}); check the "
                        f"--config_file you gave `accelerate launch` (configs/accelerate/ has working ones)") from None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
    atexit.register(_close_process_group)
    return Dist(acc.process_index, acc.num_processes, local, acc)


def _close_process_group() -> None:
    """Destroy the process group before the interpreter exits: a rank that leaves with
    it alive can abort in the collective library's threads ("terminate called without an
    active exception", SIGABRT) after its work is done, which fails the launch."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
