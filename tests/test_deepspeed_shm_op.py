"""DeepSpeed on a CPU starts its process group without building its shared-memory op
(rlhflab/thirdparty.py: only DeepSpeed's inference all-reduce uses it; the build is
about 20 s of g++ on each new venv)."""

from __future__ import annotations

import os

import pytest


def test_marked_op_is_neither_built_nor_loaded(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # a build would land here
    from rlhflab.thirdparty import SHM_OP, skip_deepspeed_shm_op

    skip_deepspeed_shm_op()
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    assert ShareMemCommBuilder.NAME == SHM_OP  # the name DeepSpeed looks the op up by
    assert deepspeed.ops.__compatible_ops__[SHM_OP] is False
    assert build_shm_op() is None  # what TorchBackend keeps: inference_all_reduce falls back to gloo
    assert not os.path.exists(tmp_path / "ext")
