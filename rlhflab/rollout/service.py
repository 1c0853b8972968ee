"""The rollout service: the one thing the training loop asks for a step's episodes and
tells of new weights (`get(step)`, `push(policy, version)`), whoever samples.

Staleness (`generation.max_staleness: s`) is exact. Version v is the policy after v
updates (v = 0: the weights the run starts from). Step k (counted from 1) samples from

    version(k) = max(0, k - 1 - s)

so s = 0 is the synchronous run (step k from the weights after update k-1) and at s = 1
step k+1 is sampled from the weights after update k-1 while update k runs. Seeded
sampling keys every token by (seed, step, row), so the episodes of a step depend on its
version and nothing else: a run reproduces whatever the timing, and a resume is exact.
The service never drops an episode: it paces the producer, which is at most s + 1 steps
ahead of the update.

Two shapes:
- `InProcessService` (s = 0, the default): the run's backend in the trainer's process,
  exactly as before (`backend.generate`, `backend.sync`, the vLLM canary on the next
  rollout's log-prob gap).
- `ProducerService` (s >= 1, or `generation.producer: process`): a producer process
  (torch.multiprocessing, 'spawn') that holds its own engine: for `hf` a copy of the
  policy, for `vllm` the engine of `rlhflab.rollout.vllm` on that copy. After each update
  the trainer sends the full weights (a LoRA adapter merged, `rollout.weights`) tagged
  with their version; the producer loads them, answers with the log-probs of a fixed
  probe batch under them, and samples the steps that version is for. The weight-sync
  canary compares those with the trainer's own log-probs of the probe under the weights
  it sent (`SyncCanary`): every push is judged, whatever the staleness.

Faults end the run, never hang it: every wait on the producer polls whether it is still
alive and gives up after `generation.producer_timeout_s`, with one line naming what
stopped. `close()` (the run context's on_close) always stops the producer: a word, a join,
then terminate and kill.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlhflab.errors import UserError
from rlhflab.rollout import Rollout

POLL_S = 0.2      # how often a wait on the producer checks that it is alive
CLOSE_S = 3.0     # how long close() waits for the producer to end before terminating it
START_S = 120.0   # the producer's start (imports, the model built) may take this long whatever the timeout


def version_for(step: int, staleness: int) -> int:
    """The weight version step `step` (from 1) samples from: max(0, step - 1 - staleness)."""
    return max(0, step - 1 - staleness)


def probe_logprobs(model: torch.nn.Module, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L-1) log-probs of each probe token after its prefix under `model` (eval mode, no
    gradient), 0 where the token is padding: the weight-sync canary's fingerprint."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**probe).logits[:, :-1].float()                            # (B, L-1, V)
    finally:
        model.train(was_training)
    ids, mask = probe["input_ids"][:, 1:], probe["attention_mask"][:, 1:]
    lp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)            # (B, L-1)
    return (lp * mask).cpu()


def engine_gap(model: torch.nn.Module, roll: Rollout, temperature: float) -> float:
    """mean |log pi - log pi_engine| over the rollout's action tokens, with pi the
    producer's copy of the weights that sampled it (teacher-forced at the sampling
    temperature): the in-process vLLM canary's gap, taken where both hold the same version."""
    ids = torch.cat([roll.prompt_ids, roll.response_ids], 1)                            # (B, P+T)
    am = torch.cat([roll.prompt_mask, roll.attend_mask.to(roll.prompt_mask.dtype)], 1)
    p = roll.prompt_ids.shape[1]
    with torch.no_grad():
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # positions that skip the left padding
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, p - 1 : -1].float()
    lp = (logits / temperature).log_softmax(-1).gather(-1, roll.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    mask = roll.response_mask.float()
    return float(((lp - roll.sample_logprobs.float()).abs() * mask).sum() / mask.sum().clamp(min=1.0))


def probe_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """mean |a - b| over the probe's real tokens, in nats."""
    m = mask[:, 1:].float()
    return float(((a.float() - b.float()).abs() * m).sum() / m.sum().clamp(min=1.0))


# --------------------------------------------------------------------------------------
# s = 0 in the trainer's process: today's run
# --------------------------------------------------------------------------------------
class InProcessService:
    """The run's backend in this process (see the module docstring)."""

    staleness = 0

    def __init__(self, backend):
        self.backend = backend

    def start(self, start_step: int, examples_of: Callable[[int], list], n: int, policy=None,
              saved: dict | None = None, last: int | None = None) -> None:
        self.examples_of, self.n = examples_of, n

    def get(self, step: int) -> Rollout:
        examples = self.examples_of(step)
        roll = self.backend.generate([e.prompt for e in examples], n=self.n, examples=[e.row for e in examples],
                                     step=step)
        roll.version = version_for(step, 0)
        return roll

    def push(self, policy, version: int, updates: int = 1) -> None:
        self.backend.sync(policy, updates=updates)  # the sampler follows the update

    def metrics(self) -> dict[str, float]:
        return {}

    def judge(self, metrics: dict, step: int) -> None:
        check_sync = getattr(self.backend, "check_sync", None)  # vllm: the weight-sync canary, before a save
        if check_sync is not None:
            check_sync(metrics.get("rollout/logprob_gap"), step)

    def held_weights(self, step: int) -> dict[int, dict]:
        return {}

    def close(self) -> None:
        self.backend.close()


# --------------------------------------------------------------------------------------
# A producer process
# --------------------------------------------------------------------------------------
@dataclass
class ProducerSpec:
    """What the producer process builds its engine from (all of it picklable)."""

    build: Callable                 # build(model, tokenizer) -> a RolloutBackend (the trainer's builder)
    model_config: object            # the policy's (base model's) transformers config
    generation_config: object | None
    dtype: torch.dtype
    tokenizer: object
    device: str
    threads: int
    probe: dict                     # the canary's probe batch (CPU tensors)
    setup: Callable | None = None   # setup(model): the CPU settings the trainer's policy got (cpu.apply)
    extra: dict = field(default_factory=dict)


def _tensors_to(roll: Rollout, device) -> Rollout:
    for name, value in vars(roll).items():
        if isinstance(value, torch.Tensor):
            setattr(roll, name, value.to(device))
    return roll


def producer_main(spec: ProducerSpec, inbox, outbox) -> None:
    """The producer process: build the engine, then serve the trainer's messages in order:
    ("weights", version, state) loads a version (answered with ("loaded", version, probe
    log-probs)); ("request", step, prompts, rows, n) samples a step (answered with
    ("rollout", step, roll)); ("stop",) ends, and so does the trainer's death (it is
    polled between messages). Any failure is sent as ("error", one line)."""
    try:
        torch.set_num_threads(max(1, spec.threads))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(spec.model_config, dtype=spec.dtype)
        if spec.generation_config is not None:
            model.generation_config = spec.generation_config
        model.to(spec.device).eval()
        if spec.setup is not None:
            spec.setup(model)
        backend = None
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        outbox.put(("ready", os.getpid()))
        parent = multiprocessing.parent_process()
        while True:
            try:
                msg = inbox.get(timeout=POLL_S * 5)
            except queue.Empty:  # a trainer killed outright (SIGKILL) leaves no word: end with it
                if parent is not None and not parent.is_alive():
                    break
                continue
            if msg[0] == "stop":
                break
            if msg[0] == "weights":
                _, version, state = msg
                missing = names - set(state)
                if missing:
                    raise RuntimeError(f"the weights of version {version} lack {len(missing)} tensors "
                                       f"(e.g. {sorted(missing)[0]})")
                with torch.no_grad():
                    model.load_state_dict(state, strict=False)
                del state
                if backend is None:
                    backend = spec.build(model, spec.tokenizer)
                else:
                    backend.sync(model, updates=1)
                probe = {k: v.to(spec.device) for k, v in spec.probe.items()}
                outbox.put(("loaded", version, probe_logprobs(model, probe)))
            elif msg[0] == "request":
                _, step, prompts, rows, n = msg
                roll = backend.generate(list(prompts), n=n, examples=list(rows), step=step)
                gap = None  # vLLM: its log-probs against this copy of the same weights (the engine's push judged)
                if spec.extra.get("engine_gap") and roll.sample_logprobs is not None:
                    gap = engine_gap(model, roll, spec.extra["temperature"])
                outbox.put(("rollout", step, _tensors_to(roll, "cpu"), gap))
        if backend is not None:
            backend.close()
    except BaseException as exc:  # noqa: BLE001 - whatever stopped it, said in one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            outbox.put(("error", f"{type(exc).__name__}: {text}"))
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(1) from None


PROBE_KEY = "rlhflab.probe_logprobs"  # in a checkpoint's held version: its push's probe, not yet judged

PRODUCER_MAIN = producer_main  # the process target (a test may put a wrapped one here)


class ProducerService:
    """Samples in a producer process, `staleness` steps ahead (see the module docstring)."""

    def __init__(self, spec: ProducerSpec, *, staleness: int, timeout_s: float, device, sync_check: bool = True,
                 factor: float = 10.0, floor: float = 1e-3, weights_of: Callable | None = None):
        self.spec, self.staleness, self.timeout_s, self.device = spec, staleness, timeout_s, device
        self.weights_of = weights_of
        self.canary = self.engine_canary = None
        if sync_check:
            from rlhflab.rollout.canary import SyncCanary
            self.canary = SyncCanary(factor, floor, what="the rollout producer")
            self.engine_canary = SyncCanary(factor, floor, what="generation.backend=vllm in the rollout producer")
        self.engine_gaps: dict[int, float] = {}
        self.engine_gap: tuple[int, float] | None = None  # (step, gap) of the last rollout, not yet judged
        self.proc = None
        self.inbox = self.outbox = None
        self.sent: dict[int, torch.Tensor] = {}    # version -> the trainer's probe log-probs, not yet judged
        self.loaded: dict[int, torch.Tensor] = {}  # version -> the producer's, not yet judged
        self.rollouts: dict[int, Rollout] = {}
        self.held: dict[int, dict] = {}            # version -> the weights sent (kept for a checkpoint)
        self.requested = 0                         # the last step requested
        self.pushed = -1                           # the last version sent

    # ---------------------------------------------------------------- start and stop
    def start(self, start_step: int, examples_of: Callable[[int], list], n: int, policy=None,
              saved: dict | None = None, last: int | None = None) -> None:
        """Spawn the producer and send what steps start_step+1 ... start_step+1+s need (none
        past `last`, the run's last step):
        the versions before `start_step` from `saved` (a resumed checkpoint's), the rest
        from `policy` (the weights now, version start_step)."""
        import torch.multiprocessing as mp

        self.examples_of, self.n, self.start_step = examples_of, n, start_step
        self.last = last if last is not None else 1 << 62
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=PRODUCER_MAIN, args=(self.spec, self.inbox, self.outbox), daemon=True,
                                name="rlhflab-rollout-producer")
        self.proc.start()
        self._wait(lambda m: m[0] == "ready", "to start", at_least=START_S)
        self.policy = policy
        for step in range(start_step + 1, min(start_step + 2 + self.staleness, self.last + 1)):
            v = version_for(step, self.staleness)
            if v > self.pushed:
                if v < start_step:
                    if saved is None or v not in saved:
                        raise UserError(f"--resume: the checkpoint holds no sampler weights of version {v}, which "
                                        f"step {step} samples from at generation.max_staleness="
                                        f"{self.staleness}; resume with the max_staleness it was saved with")
                    state = dict(saved[v])
                    self._send_weights(v, state, probe=state.pop(PROBE_KEY, None))
                else:
                    self._send_weights(v, self._state(policy), probe=self._probe(policy))
            self._request(step)

    def close(self) -> None:
        """End the producer, whatever state it is in: a word, a join, then terminate, kill."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.is_alive():
                self.inbox.put(("stop",))
                proc.join(CLOSE_S)
        except Exception:  # noqa: BLE001 - a broken queue: end it below
            pass
        if proc.is_alive():
            proc.terminate()
            proc.join(CLOSE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(CLOSE_S)
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()
            q.close()

    # ---------------------------------------------------------------- the loop's calls
    def get(self, step: int) -> Rollout:
        """Step `step`'s episodes (waits for the producer; at most producer_timeout_s)."""
        while step not in self.rollouts:
            self._wait(lambda m: m[0] == "rollout" and m[1] == step, f"to send the episodes of step {step}")
        roll = _tensors_to(self.rollouts.pop(step), self.device)
        roll.version = version_for(step, self.staleness)
        self.version = roll.version
        gap = self.engine_gaps.pop(step, None)
        self.engine_gap = None if gap is None else (step, gap)
        return roll

    def push(self, policy, version: int, updates: int = 1) -> None:
        """The policy after update `version`: send it, then the request it is the first for
        (nothing when that step is past the run's last)."""
        self.policy = policy
        if version + 1 + self.staleness > self.last:
            return
        self._send_weights(version, self._state(policy), probe=self._probe(policy))
        self._request(version + 1 + self.staleness)

    def metrics(self) -> dict[str, float]:
        """The probe gap of every push not yet judged up to the version this step sampled from
        (the largest as rollout/push_gap); they are judged by `judge`, after the step is logged.
        The producer acknowledges version v before it samples from it, so those pushes are
        acknowledged by now: which step reports a push does not depend on the timing (a push
        acknowledged early waits for the step that samples from it)."""
        self._drain()
        upto = getattr(self, "version", -1)
        self.gaps = [(v, probe_gap(self.sent.pop(v), self.loaded.pop(v), self.spec.probe["attention_mask"]))
                     for v in sorted(set(self.sent) & set(self.loaded)) if v <= upto]
        out = {"rollout/push_gap": max(g for _, g in self.gaps)} if self.gaps else {}
        if self.engine_gap is not None:
            out["rollout/engine_gap"] = self.engine_gap[1]
        return out

    def judge(self, metrics: dict, step: int) -> None:
        """The canary on those gaps (the weights sent against the weights loaded); a
        UserError on a jump, before the step is saved."""
        gaps, self.gaps = getattr(self, "gaps", []), []
        for v, gap in gaps:
            if self.canary is not None:
                self.canary.check(gap, step, version=v)
        engine, self.engine_gap = self.engine_gap, None
        if engine is not None and self.engine_canary is not None:
            self.engine_canary.check(engine[1], step)

    def held_weights(self, step: int) -> dict[int, dict]:
        """The versions steps step+1 ... step+s sample from that are older than step: what a
        checkpoint of step `step` must keep for an exact resume."""
        want = {version_for(k, self.staleness) for k in range(step + 1, step + 1 + self.staleness)}
        held = {v: self.held[v] for v in sorted(want) if v < step and v in self.held}
        # a push not judged yet is judged after the resume as it would have been (`metrics`):
        # the trainer's probe log-probs of it ride along
        return {v: {**state, PROBE_KEY: self.sent[v]} if v in self.sent else state for v, state in held.items()}

    # ---------------------------------------------------------------- inside
    def _state(self, policy) -> dict[str, torch.Tensor]:
        from rlhflab.rollout import weights

        fn = self.weights_of or weights.policy_weights
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in fn(policy)}

    def _probe(self, policy) -> torch.Tensor:
        device = next(policy.parameters()).device
        return probe_logprobs(policy, {k: v.to(device) for k, v in self.spec.probe.items()})

    def _send_weights(self, version: int, state: dict, probe: torch.Tensor | None) -> None:
        self._alive(f"to receive the weights of version {version}")
        self.inbox.put(("weights", version, state))
        if probe is not None:
            self.sent[version] = probe
        self.held[version] = state
        self.pushed = version
        for v in [v for v in self.held if v < version - self.staleness]:  # no later checkpoint needs it
            del self.held[v]
        self.sent_at = time.monotonic()
        self.waiting_version = version

    def _request(self, step: int) -> None:
        examples = self.examples_of(step)
        self.inbox.put(("request", step, [e.prompt for e in examples], [e.row for e in examples], self.n))
        self.requested = step

    def _alive(self, what: str) -> None:
        if self.proc is None or not self.proc.is_alive():
            code = None if self.proc is None else self.proc.exitcode
            error = self._error()
            raise UserError(f"the rollout producer stopped (exit code {code}) before it was ready {what}"
                            + (f": {error}" if error else "") + "; the last complete checkpoint is intact")

    def _error(self) -> str | None:
        try:
            while True:
                m = self.outbox.get_nowait()
                if m[0] == "error":
                    return m[1]
                self._keep(m)
        except (queue.Empty, OSError, ValueError):
            return None

    def _keep(self, m) -> None:
        if m[0] == "rollout":
            self.rollouts[m[1]] = m[2]
            if len(m) > 3 and m[3] is not None:
                self.engine_gaps[m[1]] = m[3]
        elif m[0] == "loaded":
            self.loaded[m[1]] = m[2]

    def _drain(self) -> None:
        try:
            while True:
                m = self.outbox.get_nowait()
                if m[0] == "error":
                    raise UserError(f"the rollout producer failed: {m[1]}; the last complete checkpoint is intact")
                self._keep(m)
        except queue.Empty:
            pass
        except (EOFError, ConnectionError) as exc:
            self._lost("with its messages", exc)

    def _lost(self, what: str, exc: BaseException) -> None:
        """A message that could not be read whole: the producer died while handing it over
        (its shared tensors went with it). One line either way."""
        if self.proc is not None:
            self.proc.join(timeout=POLL_S)
        self._alive(what)  # raises: the producer stopped
        raise UserError(f"the rollout producer's message {what} could not be read ({type(exc).__name__}); "
                        f"stopped (the last complete checkpoint is intact)")

    def _wait(self, done: Callable, what: str, at_least: float = 0.0) -> None:
        """Read the producer's messages until `done(message)`; a UserError when it dies,
        reports an error or takes longer than producer_timeout_s (or `at_least`)."""
        deadline = time.monotonic() + max(self.timeout_s, at_least)
        while True:
            try:
                m = self.outbox.get(timeout=POLL_S)
            except (EOFError, ConnectionError) as exc:  # its tensors are passed by file descriptor:
                self._lost(what, exc)                    # a producer killed after sending takes them along
                continue
            except queue.Empty:
                if self.proc is None or not self.proc.is_alive():
                    self._alive(what)
                if time.monotonic() > deadline:
                    pending = (f" (the weights of version {self.waiting_version} were sent "
                               f"{time.monotonic() - self.sent_at:.0f} s ago and are not loaded)"
                               if getattr(self, "waiting_version", None) is not None
                               and self.waiting_version not in self.loaded else "")
                    raise UserError(f"the rollout producer did not answer {what} within "
                                    f"generation.producer_timeout_s={self.timeout_s:g} s{pending}; stopped (the last "
                                    f"complete checkpoint is intact); raise the timeout if its steps are that slow")
                continue
            if m[0] == "error":
                raise UserError(f"the rollout producer failed: {m[1]}; the last complete checkpoint is intact")
            self._keep(m)
            if done(m):
                return


__all__ = ["InProcessService", "ProducerService", "ProducerSpec", "version_for", "probe_logprobs"]
