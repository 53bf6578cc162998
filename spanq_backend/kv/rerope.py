"""ReRoPE: move cached keys to a new position by rotating them by the position delta (V is untouched).

RoPE rotates each pair of key dimensions by `pos * theta_i`. Rotations compose, so keys computed at position p
become the keys of position p + d after one more rotation by `d * theta_i` — exactly, whenever the rotary
embedding is a rotation with position-independent frequencies (plain RoPE; linear, llama3 and YaRN scaling; a
LongRoPE table fixed for the engine's context). A table may also scale every key by one constant factor (YaRN's
and LongRoPE's attention factor): keys then carry that factor from where they were computed, and the move is the
table's pure rotation (the table divided by the factor). `RopeSpec.from_cos_sin_cache` checks both properties on
the model's own cos/sin table and refuses otherwise (a factor or frequencies that change with the position, as
with dynamic NTK).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RelocationError", "RopeSpec", "rerope_", "rotation_for_delta"]


class RelocationError(ValueError):
    """The model's positional encoding cannot be relocated exactly (cached keys cannot be moved)."""


@dataclass(frozen=True)
class RopeSpec:
    """What ReRoPE needs of a model's rotary embedding.

    `cos_sin_cache` is `[max_positions, rotary_dim]`: cos of `pos * theta_i` for the first half of the columns,
    sin for the second half (vLLM's layout). `is_neox_style`: rotated pairs are `(i, i + rotary_dim/2)`;
    otherwise (GPT-J style) `(2i, 2i + 1)`. Only the first `rotary_dim` of `head_dim` dimensions rotate.
    """

    cos_sin_cache: torch.Tensor
    rotary_dim: int
    head_dim: int
    is_neox_style: bool = True

    @property
    def max_delta(self) -> int:
        return int(self.cos_sin_cache.shape[0]) - 1

    @classmethod
    def from_cos_sin_cache(
        cls, cos_sin_cache: torch.Tensor, rotary_dim: int, head_dim: int, is_neox_style: bool, *, what: str = "model"
    ) -> RopeSpec:
        """Build a spec and check that relocation by this table is exact (a pure, composable rotation)."""
        cache = cos_sin_cache.detach().to(torch.float64).cpu()
        if cache.ndim != 2 or cache.shape[1] != rotary_dim or rotary_dim % 2 or rotary_dim > head_dim:
            raise RelocationError(
                f"{what}: unexpected rotary table shape {tuple(cache.shape)} for rotary_dim={rotary_dim}, "
                f"head_dim={head_dim}"
            )
        cos, sin = cache.chunk(2, dim=-1)
        # Tolerances follow the table's own precision (vLLM builds it in the model's dtype) and grow with the
        # position, as fp32 rounding of `pos * theta` does; a scaled or non-linear table is off by far more.
        eps = torch.finfo(cos_sin_cache.dtype).eps if cos_sin_cache.is_floating_point() else 1e-7
        norm = cos * cos + sin * sin
        scale2 = norm.mean()  # the constant factor's square (1 for plain RoPE)
        spread = float(((norm - scale2) / scale2).abs().max()) if float(scale2) > 0 else float("inf")
        if spread > 64 * eps:
            raise RelocationError(
                f"{what}: the rotary embedding scales keys by a factor that changes with the position "
                f"(|cos|^2+|sin|^2 varies by {spread:.2e}); cached keys cannot be moved exactly, so span reuse is "
                "refused"
            )
        if float((scale2 - 1.0).abs()) > 4 * eps:  # one factor for every position (YaRN, LongRoPE): divide it out
            factor = scale2.sqrt()
            cos, sin = cos / factor, sin / factor
            cache = torch.cat([cos, sin], dim=-1)
            cos_sin_cache = cache.to(cos_sin_cache.dtype if cos_sin_cache.is_floating_point() else torch.float32)
        n = cache.shape[0]
        angle = torch.atan2(sin, cos)  # [n, half]
        # Linear in the position: angle(0) = 0 and angle(p+1) - angle(p) = angle(1) for every p (mod 2 pi).
        step = torch.remainder(angle[1:] - angle[:-1] - angle[1] + torch.pi, 2 * torch.pi) - torch.pi
        positions = torch.arange(1, n, dtype=torch.float64).unsqueeze(-1)
        allowed = 64 * eps * (1.0 + positions * angle[1].abs())  # per dimension
        bad = (step.abs() > allowed).any(dim=-1).nonzero()
        if float(angle[0].abs().max()) > 64 * eps or len(bad):
            where = int(bad[0]) + 1 if len(bad) else 0
            raise RelocationError(
                f"{what}: rotary angles are not linear in the position (the step from position {where - 1} to "
                f"{where} differs from the step 0 to 1), as with dynamic NTK or multimodal RoPE; span reuse is "
                "refused"
            )
        return cls(cos_sin_cache.detach(), rotary_dim, head_dim, is_neox_style)


def rotation_for_delta(spec: RopeSpec, delta: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (each `[rotary_dim/2]`) of the rotation that moves a key by `delta` positions."""
    if abs(delta) > spec.max_delta:
        raise RelocationError(f"cannot move a key by {delta} positions: the rotary table covers {spec.max_delta}")
    row = spec.cos_sin_cache[abs(delta)].to(device=device, dtype=dtype)
    cos, sin = row.chunk(2, dim=-1)
    return cos, (sin if delta >= 0 else -sin)


def rerope_(keys: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate `keys` (`[..., tokens, head_dim]`, any strides) in place by `delta` positions; returns `keys`.

    `delta` is one int for all tokens, or a tensor broadcastable to `keys.shape[:-1]` (per token or per block).
    The arithmetic runs in float32 at least; the result is stored in the keys' dtype, so in a cache below float32
    each move rounds once more (bf16: ~3e-3 relative a move, ~7e-2 after 500): `CidraPlanner.max_moves` bounds
    how often one cached block is moved before the prefix cache lets it go (it is prepared again where read next).
    """
    if keys.shape[-1] != spec.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]}, the rotary spec expects {spec.head_dim}")
    half = spec.rotary_dim // 2
    work = torch.promote_types(keys.dtype, torch.float32)
    if isinstance(delta, int):
        if delta == 0:
            return keys
        cos, sin = rotation_for_delta(spec, delta, work, keys.device)
    else:
        d = delta.to(device=keys.device, dtype=torch.long)
        if int(d.abs().max()) > spec.max_delta:
            raise RelocationError(f"a delta exceeds the rotary table ({spec.max_delta} positions)")
        rows = spec.cos_sin_cache.to(device=keys.device, dtype=work)[d.abs()]
        cos, sin = rows[..., :half], rows[..., half:] * torch.sign(d).to(work).unsqueeze(-1)
    if spec.is_neox_style:
        x1 = keys[..., :half]
        x2 = keys[..., half : spec.rotary_dim]
    else:
        x1 = keys[..., 0 : spec.rotary_dim : 2]
        x2 = keys[..., 1 : spec.rotary_dim : 2]
    a, b = x1.to(work), x2.to(work)
    new1 = a * cos - b * sin
    new2 = b * cos + a * sin
    x1.copy_(new1)
    x2.copy_(new2)
    return keys
