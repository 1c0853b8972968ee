from rlhflab.cli import entry

# Guarded: a process started with the "spawn" method (vLLM's workers when its engine runs
# out of process) imports this module again as __mp_main__, and must not rerun the command.
if __name__ == "__main__":
    entry()
