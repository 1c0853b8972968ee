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
collective; its traceback is in its .err file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


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
    sys.exit(main(sys.argv[1]))
