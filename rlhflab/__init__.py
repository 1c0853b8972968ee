"""rlhflab: the RLHF pipeline for causal language models, end to end, readable and tested."""

__version__ = "0.1.0"
