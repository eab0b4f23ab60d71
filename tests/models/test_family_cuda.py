"""The native families on CUDA with the fused kernels (``kernels=triton``: Triton norm, rotary, SwiGLU,
and with ``doc_ids`` flex attention holding the sliding window) against transformers' own model on the
same GPU, fp32.  Skipped without CUDA; bench/gpu_check.sh runs it on a GPU host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepshard.finetune.models import registry
from tests.models.hf_refs import chat_rows, save_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused kernels' path)")


@pytest.mark.parametrize("family", ["phi3"])  # Phi-3: partial rotary through the Triton rotary kernel, longrope, window
def test_family_on_cuda_with_fused_kernels_equals_transformers(tmp_path, family):
    hf = save_hf(family, tmp_path).cuda()
    spec = registry.for_hf(tmp_path)
    cfg = dataclasses.replace(spec.hf.config_from_hf(tmp_path), kernels="triton")
    with torch.device("cuda"):
        ours = spec.build(cfg)
    ours.init_weights(0)
    spec.hf.load_weights(ours, tmp_path)
    ids = chat_rows()[0][0].cuda()
    with torch.no_grad():
        theirs = hf(ids).logits
        assert (ours.eval()(ids) - theirs).abs().max().item() < 1e-4
        one_doc = torch.zeros_like(ids)  # the flex path: a BlockMask holding the window
        assert (ours(ids, doc_ids=one_doc) - theirs).abs().max().item() < 1e-4
