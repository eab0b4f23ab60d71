"""Issue 32's scripts 3-5, per rank, in one launch: DeepSpeed-Chat step-1 SFT (ds_chat_sft_script), HelloDeepSpeed
(ds_hello_script) and the DCGAN example (ds_gan_script), each with ``deepspeed`` given (default: ours;
bench/record_ds_more_scripts.py passes real DeepSpeed 0.19.8).  Each script's header lists its changed lines."""

from __future__ import annotations

import os

import torch

import deepshard.compat.deepspeed as ours


def run_more(root: str, deepspeed=ours, hello_load_dir: str | None = None) -> dict:
    """``root``: a directory every rank sees.  Returns this rank's losses (and rank 0's saved SFT model path).
    ``hello_load_dir``: HelloDeepSpeed's second invocation resumes from there (DeepSpeed's checkpoint, imported)."""
    from tests.compat import ds_chat_sft_script as sft
    from tests.compat import ds_gan_script as gan
    from tests.compat import ds_hello_script as hello

    deepspeed.init_distributed()  # the scripts' own first call (the recorder's DeepSpeed already has the group)
    rank = torch.distributed.get_rank()
    out = {}
    model_dir = os.path.join(root, "tiny_opt")
    if rank == 0:
        sft.write_tiny_opt(model_dir)
    torch.distributed.barrier()
    sft_out = os.path.join(root, "sft_output")
    out["sft"] = sft.main(sft.sft_argv(model_dir, sft_out), deepspeed)
    out["sft"]["saved"] = os.path.join(sft_out, "pytorch_model.bin")
    torch.distributed.barrier()
    out["hello"] = hello.hello_run(os.path.join(root, "hello"), deepspeed)
    if hello_load_dir is not None:  # DeepSpeed's own checkpoint after step 6, resumed by this body
        torch.distributed.barrier()
        _, resumed = hello.main({"load_checkpoint_dir": hello_load_dir, "num_iterations": 11}, deepspeed)
        out["hello_from_ds"] = {"resumed": resumed}
    torch.distributed.barrier()
    config_dir = os.path.join(root, "gan")
    os.makedirs(config_dir, exist_ok=True)
    out["gan"] = gan.gan_main(gan.gan_argv(config_dir), deepspeed)
    return out

