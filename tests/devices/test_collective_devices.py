"""Every tensor that reaches a collective lives on the compute device, path by path.

Each path runs with ``local_device()`` set to ``meta`` (not the host) over torch's fake process
group; the recorder (device_recorder.py) lists every c10d op with its tensors' devices and the call
site in our code.  On a CPU host the compute device is the CPU, so gloo hides a host tensor; nccl
rejects it ("No backend type associated with device type cpu").  Meta stands in for the GPU here.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from deepshard.core.mesh import ParallelDims, build_mesh, use_local_device
from deepshard.core.optim import ZeroOptimizer, global_grad_sq_norm
from deepshard.core.zero import CpuParamOffload
from tests.core.zero_harness import MICRO, build_model, engine_config
from tests.devices.device_recorder import CollectiveRecorder, fake_world

META = torch.device("meta")


def _check(rec: CollectiveRecorder, expect: int | None = None) -> None:
    ours = rec.ours()
    assert ours, f"no collective recorded: {rec.calls}"
    if expect is not None:
        assert len(ours) == expect, [str(c) for c in ours]
    bad = rec.off_device(META)
    assert not bad, "collectives given tensors off the compute device (meta):\n" + "\n".join(bad)


def test_preemption_flag_is_reduced_on_the_compute_device() -> None:
    from deepshard.finetune.recipe.checkpointing import Preemption

    with fake_world(), use_local_device(META):  # built as the app builds it: once the device is set
        pre = Preemption()
        try:
            with CollectiveRecorder() as rec:
                pre.agreed()
        finally:
            pre.restore()
    _check(rec, expect=1)


def test_clipping_norm_total_on_compute_device_with_host_grads() -> None:
    """offload.params=cpu: FSDP2's gradient shards are host tensors, the norm's all-reduce is not."""
    host_grads = [torch.randn(3, 5), torch.randn(7, dtype=torch.bfloat16), torch.zeros(0)]
    with fake_world(), use_local_device(META), CollectiveRecorder() as rec:
        total = global_grad_sq_norm(host_grads, [1, 2, 1])
    assert total.device == META
    _check(rec, expect=1)


def test_optimizer_step_clip_reduction_on_compute_device() -> None:
    """The same through ZeroOptimizer.step, with a stage whose grads rest on the host."""
    from deepshard.core import PrecisionConfig
    from deepshard.core.precision import LossScaler

    stage = mock.MagicMock()
    stage.grad_handoffs.return_value = []
    stage.handed_over.return_value = set()
    stage.local_grads.return_value = [torch.randn(4, 4), torch.randn(4)]
    stage.replication.return_value = [1, 1]
    opt = ZeroOptimizer(stage, mock.MagicMock(defers_update=False), lambda step: 1e-3, LossScaler(PrecisionConfig()),
                        grad_clip=1.0)
    with fake_world(), use_local_device(META), CollectiveRecorder() as rec:
        opt.step()
    _check(rec)


class _Engine:
    """What EngineStepper / evaluate use of an Engine; its model computes on the compute device."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.model = torch.nn.Linear(2, 2)
        self.stepped = 0
        self.optimizer = mock.MagicMock(comm_wait_s={"backward": 0.0, "optimizer": 0.0})  # what the profiler reads

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, **_) -> torch.Tensor:
        assert input_ids.device == META, f"batch not moved to the compute device: {input_ids.device}"
        return torch.zeros((), device=input_ids.device, requires_grad=True) * 1.0

    from deepshard.core.engine import Engine

    global_num_items = Engine.global_num_items  # the real one: its all-reduce is one of the checked

    def backward(self, loss: torch.Tensor, **_) -> None:
        pass

    def step(self):
        self.stepped += 1

    def memory(self):
        from deepshard.core.memory import ModelStateBytes

        return {"measured": ModelStateBytes(params=10, grads=20, optimizer=30)}


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(n)]


def test_step_loss_reduction_on_compute_device() -> None:
    from deepshard.finetune.recipe.profiling import StepProfiler
    from deepshard.finetune.recipe.steppers import EngineStepper

    with fake_world(), use_local_device(META) as device:
        engine = _Engine(build_mesh(ParallelDims()))
        stepper = EngineStepper(engine, grad_accum=2, device=device)
        stepper.prof = StepProfiler(enabled=False, engine=engine)
        with CollectiveRecorder() as rec:
            stepper(iter({k: v[None] for k, v in row.items()} for row in _rows(2)))
    _check(rec, expect=2)  # the step's token count and its loss sum


def test_eval_reduction_on_compute_device() -> None:
    from deepshard.finetune.recipe.evaluate import evaluate
    from deepshard.finetune.recipe.steppers import EngineStepper

    with fake_world(), use_local_device(META) as device:
        mesh = build_mesh(ParallelDims())
        dp = mesh["dp"]
        stepper = EngineStepper(_Engine(mesh), grad_accum=1, device=device, micro_batch_size=2)
        with CollectiveRecorder() as rec:
            evaluate(stepper, _rows(5), dp_rank=dp.get_local_rank(), dp_size=dp.size(), group=dp.get_group(),
                     device=device)
    _check(rec, expect=1)


def test_memory_figures_gathered_on_compute_device() -> None:
    from deepshard.core.memory import ModelStateBytes
    from deepshard.finetune.recipe.metrics import memory_scalars

    with fake_world(), use_local_device(META) as device, CollectiveRecorder() as rec:
        out = memory_scalars(ModelStateBytes(params=1, grads=2, optimizer=3), world=2, device=device)
    assert {"memory/model_state_bytes_rank0", "memory/model_state_bytes_rank1"} <= set(out)
    _check(rec, expect=1)


def test_greedy_sample_broadcast_on_compute_device() -> None:
    from deepshard.finetune.recipe.sample import greedy_sample

    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3, 4]}

        def decode(self, ids, skip_special_tokens=True):
            return ""

    class Model(torch.nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            assert ids.device == META
            return torch.zeros(1, ids.shape[1], 10, device=ids.device)

    from deepshard.finetune.recipe.steppers import EngineStepper

    with fake_world(), use_local_device(META) as device, CollectiveRecorder() as rec:
        engine = _Engine(build_mesh(ParallelDims()))
        engine.model = Model()
        greedy_sample(EngineStepper(engine, grad_accum=1, device=device), Tok(), "x", num_tokens=2, max_seq_len=8)
    _check(rec)


def test_checkpoint_agreement_uses_only_backend_placed_collectives(tmp_path: Path) -> None:
    """Save and load agree through object collectives and barriers, whose tensors torch places on
    the backend's device (nccl: the current GPU); none of ours may be a host tensor."""
    from deepshard.core import initialize
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint

    with fake_world(world_size=1):
        mesh = build_mesh(ParallelDims())
        engine = initialize(build_model(MICRO), engine_config(0, 1, 0.5), mesh=mesh)
        with use_local_device(META), CollectiveRecorder() as rec:
            path = save_checkpoint(tmp_path, 1, engine.optimizer, mesh["dp"], model=engine.model,
                                   app_state={"step": 1})
            load_checkpoint(path, engine.optimizer, mesh["dp"], model=engine.model)
    assert rec.calls, "checkpointing issued no collective at all"
    bad = rec.off_device(META)
    assert not bad, "checkpoint collectives given host tensors:\n" + "\n".join(bad)


@pytest.mark.parametrize("offload_params", [False, True], ids=["on_device", "offload_params"])
def test_sharded_init_buffers_live_on_compute_device(offload_params: bool) -> None:
    """Defect 3: with offload.params=cpu the model was to_empty(cpu) whole, RoPE tables included;
    FSDP2 moves offloaded params to the device per all-gather but never buffers."""
    from deepshard.core import initialize
    from deepshard.finetune.models.llama import Llama

    with fake_world(world_size=1), use_local_device(META):
        with torch.device("meta"):
            model = Llama(MICRO)
        initialize(model, engine_config(3), mesh=build_mesh(ParallelDims()),
                   offload_params=CpuParamOffload() if offload_params else None,
                   materialize=lambda m: m.init_weights(0))
    buffers = {name: b.device for name, b in model.named_buffers()}
    assert buffers, "the model has no buffers: nothing checked"
    off = {n: d for n, d in buffers.items() if d != META}
    assert not off, f"buffers not on the compute device (meta): {off}"
    if offload_params:
        devices = {p.to_local().device.type for p in model.parameters()}
        assert devices == {"cpu"}, f"offloaded params must rest on the host: {devices}"


def test_run_dir_and_shared_dir_agreement_on_backend_placed_collectives(tmp_path: Path) -> None:
    """Every rank takes rank 0's run dir and looks for its probe file: object collectives only."""
    from deepshard.finetune.recipe.checkpointing import agree_run_dir, check_shared_dir

    with fake_world(world_size=2), use_local_device(META), CollectiveRecorder() as rec:
        assert agree_run_dir(str(tmp_path)) == str(tmp_path)
        check_shared_dir(tmp_path / "checkpoints")
    assert len(rec.calls) >= 3, [str(c) for c in rec.calls]
    bad = rec.off_device(META)
    assert not bad, "run-dir agreement given host tensors:\n" + "\n".join(bad)
