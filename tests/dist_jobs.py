"""Run several rlhflab commands one after the other in one process, or in each process of one
`accelerate launch` (tests/test_distributed.py: one launch per strategy instead of one per
case, since starting 2 processes costs more than a tiny model's training step).

    python tests/dist_jobs.py JOBS.json
    accelerate launch --config_file CFG tests/dist_jobs.py JOBS.json

JOBS.json is {"logs": FOLDER, "jobs": [{"name": NAME, "argv": [COMMAND, ...]}, ...]}. Each
job is `rlhflab.cli.main(argv)`, what `python -m rlhflab COMMAND ...` runs; its output
(file descriptors 1 and 2, so every library's too) goes to FOLDER/NAME.rankR.out and .err,
its exit code to FOLDER/NAME.rankR.rc (R: the process's RANK, 0 alone). A job that raises
stops the process, so the launcher ends the others instead of leaving them waiting in a
collective; its traceback is in its .err file. The process ends as `rlhflab` does
(`rlhflab.engine.dist.leave`).

The tests start it with `run_jobs` (which writes JOBS.json) and read what it left with the
`Launch` it returns (tests/test_distributed.py, test_envs_distributed.py, test_envs_training.py,
and test_vllm_commands.py, whose vLLM commands run out of the pytest process).
Standard library only: each launched process imports rlhflab once, in `main`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# RLHFLAB_ACCELERATE_CONFIG=configs/accelerate/ddp.yaml (or fsdp.yaml) runs the "ddp" cases under
# that config on a machine that has it (docs/scaling.md); CI uses the 2-process CPU configs.
CONFIGS = {"ddp": os.environ.get("RLHFLAB_ACCELERATE_CONFIG", str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml")),
           **{name: str(ROOT / "configs" / "accelerate" / f"{name}_cpu.yaml") for name in ("fsdp", "zero2", "zero3")}}


def launch_command(strategy: str) -> list[str]:
    """`accelerate launch` of 2 processes under `strategy`'s config (CONFIGS)."""
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", CONFIGS[strategy]]


class Launch:
    """The jobs of one `tests/dist_jobs.py` process (or launch): each job's folder
    (`<base>/<name>`), exit code, and output per rank."""

    def __init__(self, base: Path, ranks: int):
        self.base, self.ranks = base, ranks

    def folder(self, name: str) -> Path:
        return self.base / name

    def rc(self, name: str) -> list[int]:
        return [int((self.base / "logs" / f"{name}.rank{r}.rc").read_text()) for r in range(self.ranks)]

    def text(self, name: str, stream: str) -> str:
        """`stream` ("out" or "err") of every rank, rank 0 first."""
        return "".join((self.base / "logs" / f"{name}.rank{r}.{stream}").read_text() for r in range(self.ranks))

    def ok(self, name: str) -> Path:
        assert self.rc(name) == [0] * self.ranks, self.text(name, "out")[-3000:] + self.text(name, "err")[-3000:]
        return self.folder(name)


def run_jobs(base: Path, jobs: dict[str, list[str]], env: dict, processes: int, strategy: str = "ddp",
             cwd: Path | None = None, output_dirs: bool = True) -> Launch:
    """Run `jobs` (name -> rlhflab argv, its output folder added unless `output_dirs` is
    False: commands that take no training.output_dir) one after another in one process, or
    in each of the 2 processes of one accelerate launch under `strategy`."""
    def with_output(argv: list[str], folder: Path) -> list[str]:  # an override goes before --resume
        if not output_dirs:
            return argv
        at = argv.index("--resume") if "--resume" in argv else len(argv)
        return [*argv[:at], f"training.output_dir={folder}", *argv[at:]]

    spec = {"logs": str(base / "logs"),
            "jobs": [{"name": n, "argv": with_output(argv, base / n)} for n, argv in jobs.items()]}
    base.mkdir(parents=True, exist_ok=True)
    (base / "jobs.json").write_text(json.dumps(spec, indent=1))
    script = [str(Path(__file__).resolve()), str(base / "jobs.json")]
    cmd = launch_command(strategy) + script if processes == 2 else [sys.executable, *script]
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return Launch(base, processes)


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs_on_two_machines(base: Path, jobs: dict[str, list[str]], env: dict, timeout: float = 600) -> Launch:
    """`run_jobs` on 2 processes as 2 machines of one process each: two `accelerate launch`
    commands (--num_machines 2, machine ranks 0 and 1) started at once on loopback, each its
    own process group. Machine M runs in `base`/machineM with the output folder given as a
    relative path, so the two machines see different folders at that path (as machines
    without a shared disk do); the returned `Launch` is machine 0's. Each is waited for until
    one deadline; when either fails or the deadline passes, both launchers and their ranks
    are killed, so nothing is left waiting in a collective."""
    spec = {"logs": str(base / "machine0" / "logs"),
            "jobs": [{"name": n, "argv": [*argv, f"training.output_dir={n}"]} for n, argv in jobs.items()]}
    for machine in (0, 1):
        (base / f"machine{machine}").mkdir(parents=True, exist_ok=True)
    (base / "jobs.json").write_text(json.dumps(spec, indent=1))
    port = free_port()
    procs = []
    for machine in (0, 1):
        cmd = [*launch_command("ddp"), "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               str(Path(__file__).resolve()), str(base / "jobs.json")]
        with open(base / f"machine{machine}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, cwd=base / f"machine{machine}", stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one machine failed: the other would wait for it in a collective
            if time.monotonic() > deadline:
                raise AssertionError(f"the two machines did not finish within {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and the rank it started
                p.wait(timeout=30)
    logs = [(base / f"machine{m}.log").read_text() for m in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(f"machine {m} ({p.returncode}):\n{log[-3000:]}"
                                                       for m, (p, log) in enumerate(zip(procs, logs)))
    return Launch(base / "machine0", 2)


@contextmanager
def _output_to(out: Path, err: Path):
    """File descriptors 1 and 2 point at `out` and `err` inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    logs = Path(spec["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    from rlhflab.cli import main as rlhflab_main

    for job in spec["jobs"]:
        base = f"{job['name']}.rank{rank}"
        with _output_to(logs / f"{base}.out", logs / f"{base}.err"):
            try:
                rc = rlhflab_main(list(job["argv"]))
            except BaseException:
                traceback.print_exc()
                raise
        (logs / f"{base}.rc").write_text(f"{rc}\n")
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1])
    from rlhflab.engine.dist import leave  # the exit `rlhflab` itself takes (rlhflab.cli.entry)

    leave(rc)
