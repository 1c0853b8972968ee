"""Learner mode: write PPO's five core pieces yourself, graded against the library.

`rlhflab learn init DIR` writes the exercises, `rlhflab learn check` grades them (plain
Python, no test framework needed, against `rlhflab.ops` and the PPO trainer, with a diagnosis of what
differs), `rlhflab learn run` trains the debug PPO config with them plugged in, and
`rlhflab learn solution N` prints the library's code. See docs/learner_mode.md.
"""
