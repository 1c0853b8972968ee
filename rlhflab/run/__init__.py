"""The run context every trainer enters (`start_run`): ranks, threads, seeds, the output
folder, the effective config, metrics and the doctor, checkpoints, and the finish."""

from rlhflab.run.context import Run, entry_point, log_step, make_doctor, seed_everything, set_threads, start_run
from rlhflab.run.finish import TrainResult, print_before_after, write_train_result

__all__ = ["Run", "TrainResult", "entry_point", "log_step", "make_doctor", "print_before_after", "seed_everything",
           "set_threads", "start_run", "write_train_result"]
