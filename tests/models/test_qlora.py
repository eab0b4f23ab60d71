"""QLoRA (``peft.base_quant=nf4``): the NF4 base against a quantizer written here, and one world-2
ZeRO-3 launch against plain torch.

- The codes and scales torchao's NF4Tensor holds equal, bit for bit, a reference quantizer written
  below from QLoRA's definition (the 16-value NormalFloat table, absmax blocks of 64, nearest code,
  two codes per byte high nibble first; the scales double-quantized to int8 around their mean in
  blocks of 256, an fp32 factor each), and its dequantization equals the reference's; so do our own
  quantizer and dequantizer (models/qlora.py's fast paths).
- World 1, in process: QLoRA's loss and adapter gradients bit-equal to LoRA on plain fp32 weights that are
  the reference's round trip, and to torchao's own ``F.linear`` path.
- World 2, ZeRO-3 (the family's own recipe): a tiny Llama's and a tiny Qwen3's block weights as NF4 shards, LoRA on
  every projection, 3 AdamW steps on masked chat-like rows.  The oracle: transformers' own model of
  the same weights, its block weights replaced by the reference's dequantization of the reference's
  codes, the adapters added by hand (forward hooks), torch.optim.AdamW on the whole batch; losses and
  adapters within 1e-5.  Each rank's NF4 bytes, by a census of the inner tensors' storages, are the
  codes and scales of its half of the base.  The checkpoint exports an adapter folder that
  ``PeftModel.from_pretrained`` loads onto the dequantized base, and a merged HF folder, both with the
  oracle's logits.  The app's own assembly (``build_stepper``) of a ``peft.base_quant=nf4`` run trains.
- What QLoRA cannot run is refused before start, by key; the estimator counts the base at ~0.5 B/param.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.models.hf_refs import ROWS, VOCAB, chat_rows, hf_model, save_hf
from tests.models.train_harness import ALPHA, BETAS, EPS, LR, RANK, TARGETS, WD, adapter_value, train_steps

STEPS, WORLD = 3, 2
FAMILIES = ("llama", "qwen3")  # Qwen3: q/k norms and its own head_dim around the same NF4 projections
SHAPE = dict(hidden_size=128, intermediate_size=256)  # every block weight's shard: whole 64-blocks at world 2
# torchao's table (bitsandbytes' values rounded to 4 decimals; QLoRA's exact ones are below)
NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]
BLOCK = 64


def ref_scaler_block(rows: int, cols: int, world: int) -> int:
    """Scales per factor: 256, halved until each rank's row shard holds whole factor blocks."""
    blocks, size = rows // world * cols // BLOCK, 256
    while blocks % size:
        size //= 2
    return size


def ref_quantize(w: torch.Tensor, sblock: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scales int8, factors fp32, mean of the scales): QLoRA's NF4 with double quantization."""
    blocks = w.float().flatten().view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    x = (blocks / absmax[:, None]).flatten()
    # the nearest of the 16 values, the lower on a tie (argmin over all 16, which the test below holds torchao
    # to, picks the same: |x - v| grows away from x on both sides); a zero block's NaNs get code 0 as there
    above = torch.bucketize(x, NF4).clamp(max=15)  # the first value >= x
    below = (above - 1).clamp(min=0)
    codes = torch.where((x - NF4[above]).abs() < (x - NF4[below]).abs(), above, below)
    codes = torch.where(x.isnan(), 0, codes).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    mean = absmax.mean()
    centered = (absmax - mean).view(-1, sblock)
    factor = 256 / (2 * centered.abs().amax(dim=1))
    scales = (centered * factor[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()
    return packed, scales, factor, mean


def ref_dequantize(packed: torch.Tensor, scales: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
                   shape: tuple[int, ...], sblock: int) -> torch.Tensor:
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).flatten().long()
    absmax = (scales.view(-1, sblock) / factor[:, None]).flatten() + mean
    return (NF4[codes].view(-1, BLOCK) * absmax[:, None]).view(shape)


def ref_roundtrip(w: torch.Tensor, world: int) -> torch.Tensor:
    sblock = ref_scaler_block(*w.shape, world)
    return ref_dequantize(*ref_quantize(w, sblock), tuple(w.shape), sblock)


def test_nf4_codes_and_scales_equal_the_reference_quantizer():
    from deepshard.finetune.models.qlora import NF4_VALUES, _torchao, dequantize_nf4, quantize_nf4

    assert torch.allclose(NF4, torch.tensor(BNB_NF4), atol=5e-5)  # the same table as bitsandbytes'
    assert torch.equal(NF4, torch.tensor(NF4_VALUES))
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, an outlier, a block of zeros but one: what absmax blocks turn on
    w = torch.randn(96, 256, generator=g) * torch.exp(torch.randn(96, 1, generator=g))
    w[3, 7], w[5, :64], w[5, 9], w[7, 64:128] = 40.0, 0.0, -1e-3, 0.0  # the last: a block of zeros (0/0)
    w[9, :15] = (NF4[1:] + NF4[:-1]) / 2 * w[9].abs().max()  # near the midpoints between two codes
    for world, sblock in ((1, 128), (2, 64), (3, 128)):  # 384 blocks: 256 does not divide, world 2 halves
        assert ref_scaler_block(96, 256, world) == sblock
        from deepshard.finetune.models.qlora import scaler_block_size

        assert scaler_block_size(96, 256, world) == sblock
        packed, scales, factor, mean = ref_quantize(w, sblock)
        want = ref_dequantize(packed, scales, factor, mean, (96, 256), sblock)
        # torchao's to_nf4 (its argmin over all 16 values) and ours (from the two bracketing values)
        for q in (_torchao().to_nf4(w, block_size=BLOCK, scaler_block_size=sblock),
                  quantize_nf4(w, scaler_block_size=sblock)):
            assert isinstance(q, _torchao().NF4Tensor)
            assert torch.equal(q.quantized_data, packed)
            assert torch.equal(q.quantized_scalers, scales)
            assert torch.equal(q.quantization_factor, factor)
            assert torch.equal(q.scaler_mean, mean)
            assert torch.equal(q.get_original_weight(), want)
            assert torch.equal(dequantize_nf4(q), want) and torch.equal(dequantize_nf4(q.t()), want.t())
    assert (ref_roundtrip(w, 1) - w).abs().max() < 0.1 * w.abs().max()  # 4 bits: coarse, not wrong


def test_qlora_loss_and_grads_are_bit_equal_to_lora_on_the_dequantized_base():
    """World 1, no ZeRO: the NF4 layers (our dequantization in forward and backward, adapters or none,
    biases) against the same model on plain fp32 weights, the reference's round trip; torchao's own
    ``F.linear`` path (the one before ``nf4_linear``) gives the same bits too."""
    from torch import nn

    from deepshard.finetune.models.llama.model import Llama, LlamaConfig
    from deepshard.finetune.models.lora import LoraLinear, apply_lora
    from deepshard.finetune.models.qlora import apply_nf4

    cfg = LlamaConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                      qkv_bias=True, loss_chunk_size=0)
    ids, labels = chat_rows(1, seed=3)

    def loss_and_grads(kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = Llama(cfg)
        model.init_weights(0)
        apply_lora(model, r=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj", "down_proj"), seed=None)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n or n.endswith("proj.bias"):  # B too (PEFT's zeros leave A no gradient), biases
                    p.copy_(adapter_value(n.replace(".weight", ""), tuple(p.shape)))
            for n, m in model.layers.named_modules():
                if kind == "plain" and isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in ("lora_A", "lora_B"):
                    m.weight.copy_(ref_roundtrip(m.weight, 1))
        if kind != "plain":
            assert apply_nf4(model) == 2 * (128 * 128 * 2 + 64 * 128 * 2 + 3 * 128 * 256)
            if kind == "torchao":  # back to the plain classes: F.linear dispatches to torchao's LinearNF4
                for m in model.layers.modules():
                    if isinstance(m, nn.Linear) and type(m) not in (nn.Linear, LoraLinear):
                        m.__class__ = LoraLinear if isinstance(m, LoraLinear) else nn.Linear
        loss = model(ids[0], labels[0], reduction="sum")
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    want_loss, want = loss_and_grads("plain")
    assert len(want) == 2 * 2 * 3
    for kind in ("nf4", "torchao"):
        loss, grads = loss_and_grads(kind)
        assert torch.equal(loss, want_loss), kind
        assert grads.keys() == want.keys() and all(torch.equal(grads[n], want[n]) for n in want), kind


def _inner_bytes(p: torch.Tensor) -> int:
    """A census of what an NF4 shard holds: its inner tensors' storages (the subclass shows none itself)."""
    local = p._local_tensor
    return sum(t.untyped_storage().nbytes() for t in (local.quantized_data, local.quantized_scalers,
                                                         local.quantization_factor))


def _app_run() -> dict:
    """The app's own assembly of a QLoRA run (validate -> build_stepper), one step."""
    from deepshard.core import build_mesh
    from deepshard.finetune.config import validate
    from deepshard.finetune.models.qlora import is_nf4
    from deepshard.finetune.recipe.assemble import build_stepper, run_meta
    from deepshard.finetune.tools.estimate import compose

    s = validate(compose(["+peft=lora", "peft.r=4", "peft.base_quant=nf4", "+zero=stage3", "launcher.nproc_per_node=2",
                          "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                          "model.ffn_hidden=256", "train.seed=3"]))
    stepper = build_stepper(s, build_mesh(s.parallel), rank=torch.distributed.get_rank())
    engine = stepper.engine
    ids = torch.randint(0, s.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    num = engine.global_num_items(torch.tensor(ids.numel()))
    loss = engine(ids, ids, reduction="sum")
    engine.backward(loss, num_items=num)
    engine.step()
    return {"nf4": sorted(n for n, p in engine.model.named_parameters() if is_nf4(p)), "loss": loss.item(),
            "meta_nf4": run_meta(s).get("nf4")}


def _train(hf_dir: str, ckpt_root: str) -> dict:
    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.core.checkpoint.state import save_checkpoint
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.lora import LoraConfig, apply_lora
    from deepshard.finetune.models.qlora import apply_nf4, is_nf4

    spec = registry.for_hf(hf_dir)
    cfg = spec.hf.config_from_hf(hf_dir)
    model = spec.build(cfg)
    model.init_weights(0)
    spec.hf.load_weights(model, hf_dir)
    apply_lora(model, r=RANK, alpha=ALPHA, target_modules=TARGETS, seed=None)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(adapter_value(n.replace(".weight", ""), tuple(p.shape)))
    apply_nf4(model, world=WORLD)
    config = EngineConfig(zero=ZeroConfig(stage=3), precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(dp=WORLD))
    recipe = partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none")
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe)
    rank = mesh["dp"].get_local_rank()
    ids, labels = chat_rows(STEPS)
    losses = train_steps(engine, ids, labels, slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD),
                         mesh["dp"].get_group())
    params = dict(engine.model.named_parameters())
    q = params["layers.0.mlp.down_proj.weight"]._local_tensor
    lora = LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS, base_quant="nf4")
    meta = {"family": spec.name, "model": dataclasses.asdict(cfg), "peft": dataclasses.asdict(lora),
            "base": {"model": "hf", "path": hf_dir, "seed": 0}, "nf4": {"world": WORLD}}
    ckpt = save_checkpoint(Path(ckpt_root), STEPS, engine.optimizer, mesh["dp"], model=None,
                           app_state={"step": STEPS}, meta=meta)
    return {"losses": losses, "ckpt": str(ckpt),
            "adapters": {n: p.full_tensor().detach().clone() for n, p in params.items() if ".lora_" in n},
            "nf4_bytes": sum(_inner_bytes(p) for p in params.values() if is_nf4(p)),
            "nf4_names": sorted(n for n, p in params.items() if is_nf4(p)),
            "down_proj_0": (q.quantized_data.clone(), q.quantized_scalers.clone(), q.quantization_factor.clone())}


def _worker(hf_dirs: dict[str, str], ckpt_root: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    out = {family: _train(d, f"{ckpt_root}/{family}") for family, d in hf_dirs.items()}
    out["app"] = _app_run()
    return out


def _hooked_lora(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """LoRA by hand on transformers' model: each target's output += alpha / r * x A^T B^T."""
    adapters = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            ours = name.removeprefix("model.")
            a = torch.nn.Parameter(adapter_value(f"{ours}.lora_A", (RANK, module.in_features)))
            b = torch.nn.Parameter(adapter_value(f"{ours}.lora_B", (module.out_features, RANK)))
            adapters[f"{ours}.lora_A.weight"], adapters[f"{ours}.lora_B.weight"] = a, b
            module.register_forward_hook(lambda m, args, out, a=a, b=b: out + ALPHA / RANK * (args[0] @ a.T) @ b.T)
    return adapters


def _dequantized_base(family: str) -> torch.nn.Module:
    """transformers' model of the case with each block Linear weight replaced by the reference NF4 round trip."""
    model = hf_model(family, **SHAPE)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(ref_roundtrip(module.weight, WORLD))
    return model.requires_grad_(False)


def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    model = _dequantized_base(family).train()
    adapters = _hooked_lora(model)
    opt = torch.optim.AdamW(adapters.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ids, labels = chat_rows(STEPS)
    losses = []
    for step in range(STEPS):
        logits = model(ids[step]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[step].flatten(), reduction="sum",
                                                 ignore_index=-100) / (labels[step] != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in adapters.items()}, model.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory, gloo_pool):
    root = tmp_path_factory.mktemp("qlora")
    for family in FAMILIES:
        save_hf(family, root / family, **SHAPE)
    ranks = gloo_pool(WORLD).run(_worker, {f: str(root / f) for f in FAMILIES}, str(root / "ckpt"))
    return ranks, root


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_zero3_qlora_equals_plain_torch_on_the_dequantized_base(run, family):
    ranks = [r[family] for r in run[0]]
    losses, adapters, _ = _reference(family)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(losses, abs=1e-5)
    for name, ref in adapters.items():
        assert torch.allclose(ranks[0]["adapters"][name], ref, atol=1e-5), name
    # every block Linear weight is NF4 (7 per layer), nothing else is
    assert ranks[0]["nf4_names"] == sorted(f"layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    # rank r holds the rows r/2 of the full weight's reference codes and scales
    w = hf_model(family, **SHAPE).model.layers[0].mlp.down_proj.weight.detach()
    sblock = ref_scaler_block(*w.shape, WORLD)
    packed, scales, factor, _ = ref_quantize(w, sblock)
    for r, rank in enumerate(ranks):
        for mine, full in zip(rank["down_proj_0"], (packed, scales, factor)):
            assert torch.equal(mine, full.chunk(WORLD)[r])


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_each_rank_holds_half_the_nf4_base_by_census(run):
    ranks = [r["llama"] for r in run[0]]
    base = hf_model("llama", **SHAPE)
    weights = [m.weight for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    psi = sum(w.numel() for w in weights)
    # codes 0.5 B, an int8 scale per 64, an fp32 factor per scaler block: this rank's half of each
    expected = sum(w.numel() // 2 + w.numel() // BLOCK + 4 * w.numel() // (BLOCK * ref_scaler_block(*w.shape, WORLD))
                   for w in weights) // WORLD
    for rank in ranks:
        assert rank["nf4_bytes"] == expected
        assert 0.5 * psi / WORLD < rank["nf4_bytes"] < 0.54 * psi / WORLD


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_adapter_export_loads_in_peft_on_the_dequantized_base_and_merge_too(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.adapter_export import export_adapter, export_merged

    ranks = [r["llama"] for r in run[0]]
    _, _, oracle = _reference("llama")
    ids = chat_rows(1, seed=5)[0][0]
    with torch.no_grad():
        want = oracle(ids).logits
        export_adapter(ranks[0]["ckpt"], tmp_path / "adapter")
        peft = PeftModel.from_pretrained(_dequantized_base("llama"), str(tmp_path / "adapter")).eval()
        assert torch.allclose(peft(ids).logits, want, atol=1e-5)
        export_merged(ranks[0]["ckpt"], tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
        assert torch.allclose(merged(ids).logits, want, atol=1e-5)


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_the_apps_assembly_trains_a_qlora_run(run):
    app = run[0][0]["app"]
    assert len(app["nf4"]) == 14 and all(".lora_" not in n for n in app["nf4"])
    assert app["loss"] == app["loss"] and app["meta_nf4"] == {"world": 2}


@pytest.mark.parametrize("override, key", [
    ("+zero=stage2", "zero.stage=2"), ("parallel.tp=2", "parallel.tp=2"), ("parallel.pp=2", "parallel.pp=2"),
    ("offload.params=cpu", "offload.params=cpu"), ("zero.quantized_weights=true", "zero.quantized_weights"),
    ("model.dim=104", "layers.0.self_attn.q_proj.weight"), ("peft.base_quant=int3", "valid values are")])
def test_what_qlora_cannot_run_is_refused_before_start(override, key):
    from deepshard.finetune.config import validate
    from deepshard.finetune.tools.estimate import compose

    base = ["+peft=lora", "peft.base_quant=nf4", "launcher.nproc_per_node=2", "model.dim=128", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_hidden=256", "model.n_layers=2"]
    if not override.startswith("+zero"):
        base.append("+zero=stage3")
    with pytest.raises(ValueError) as e:
        validate(compose([*base, override]))
    assert key in str(e.value) and "peft.base_quant" in str(e.value)


def test_the_estimator_counts_the_nf4_base_at_half_a_byte():
    from deepshard.finetune.models.llama.model import LlamaConfig
    from deepshard.finetune.models.lora import LoraConfig
    from deepshard.finetune.models.memory_plan import model_counts

    cfg = LlamaConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256)
    lora, qlora = LoraConfig(r=4), LoraConfig(r=4, base_quant="nf4")
    plain, quant = model_counts(cfg, lora, world=2), model_counts(cfg, qlora, world=2)
    block_linears = 2 * (128 * 128 * 2 + 64 * 128 * 2 + 3 * 128 * 256)
    assert quant.nf4 == block_linears and plain.nf4 == 0
    assert quant.frozen == plain.frozen - block_linears and quant.num_params == plain.num_params


def test_memory_accounting_counts_an_nf4_weights_codes_and_scales():
    """core's storage census (engine.memory()'s frozen params) sees through the subclass, which has no
    storage of its own: the app's first step reported memory with it and failed there."""
    from deepshard.core.memory import frozen_param_bytes
    from deepshard.finetune.models.qlora import _torchao

    linear = torch.nn.Linear(256, 128, bias=False).requires_grad_(False)
    q = _torchao().to_nf4(linear.weight.detach(), block_size=BLOCK, scaler_block_size=256)
    linear.weight = torch.nn.Parameter(q, requires_grad=False)
    held = [q.quantized_data, q.quantized_scalers, q.quantization_factor]
    assert sum(t.nbytes for t in held) == 128 * 256 // 2 + 128 * 256 // BLOCK + 4 * 2  # codes, scales, factors
    assert sum(t.nbytes for t in held) <= frozen_param_bytes([linear]) <= sum(t.nbytes for t in held) + 128
