"""The MLP in sequence tiles (``model.mlp_tiles``, DeepSpeed ALST's TiledMLP).

An MLP keeps [tokens, ffn_hidden] activations (gate, up, their SwiGLU) for backward: at long
sequences that is several times the block's input.  Here forward runs tile by tile without a graph
and keeps only the input; backward recomputes one tile at a time and backpropagates it at once, so
at most one tile's intermediates exist.  The MLP is per token, so each tile's output is exactly the
untiled one's rows; parameter gradients are summed over tiles (another order of the same sum).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], tiles: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tiles = fn, tiles
        ctx.params = params  # the module's own parameters (leaves): what fn reads, held anyway
        ctx.save_for_backward(x)
        with torch.no_grad():
            out = torch.cat([fn(t) for t in x.reshape(-1, x.shape[-1]).chunk(tiles)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        params = list(ctx.params)
        need_dx = ctx.needs_input_grad[2]
        dx_tiles: list[torch.Tensor] = []
        dparams: list[torch.Tensor | None] = [None] * len(params)
        tiles = zip(x.reshape(-1, x.shape[-1]).chunk(ctx.tiles), grad.reshape(-1, grad.shape[-1]).chunk(ctx.tiles))
        for xt, gt in tiles:
            xt = xt.detach().requires_grad_(need_dx)
            with torch.enable_grad():
                out = ctx.fn(xt)
            got = list(torch.autograd.grad(out, [xt, *params] if need_dx else params, gt, allow_unused=True))
            if need_dx:
                dx_tiles.append(got.pop(0))
            for i, g in enumerate(got):
                if g is not None:
                    dparams[i] = g if dparams[i] is None else dparams[i] + g
        dx = torch.cat(dx_tiles).reshape(x.shape) if need_dx else None
        return (None, None, dx, *dparams)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int,
              params: list[torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` (a per-token MLP reading the trainable ``params``) in ``tiles`` tiles of x's tokens, with
    at most one tile's intermediates alive in forward or backward; the params travel as inputs so
    autograd routes their gradients (and ZeRO's hooks see one gradient per parameter, not one per tile)."""
    return _TiledMLP.apply(fn, tiles, x, *params)
