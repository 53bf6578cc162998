"""spanq_backend.kv.rerope: moving cached keys to a new position is exactly RoPE at that position.

The reference is Hugging Face transformers' own RoPE (`LlamaRotaryEmbedding` + `apply_rotary_pos_emb`) for the
NeoX layout, and the definition (pairs `(2i, 2i+1)` rotated by `pos * theta_i`) for the GPT-J layout. The
rotary tables come from vLLM's `get_rope`, the table the plugin reads from the loaded model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from spanq_backend.kv.rerope import RelocationError, RopeSpec, rerope_, rotation_for_delta

HEAD_DIM = 64
MAX_POS = 1024
ATOL = 2e-5  # fp32: two roundings of cos/sin and of the rotated values


def atol_at(max_position: int) -> float:
    """fp32 tolerance: angles `pos * theta` carry a relative rounding of ~6e-8, on top of ATOL."""
    return ATOL + 2.5e-7 * max_position


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


# --------------------------------------------------------------------------------------------- references


def hf_config(
    head_dim: int = HEAD_DIM, theta: float = 10000.0, rope_scaling: dict | None = None
) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        rope_theta=theta,
        rope_scaling=rope_scaling,
    )


def hf_rope(x: torch.Tensor, positions: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """HF's RoPE of keys `x` (`[heads, tokens, head_dim]`) at `positions` (`[tokens]`), NeoX layout."""
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(x[None], positions[None].long())
    _, k = apply_rotary_pos_emb(x[None], x[None], cos, sin)
    return k[0]


def hf_cos_sin_cache(config: LlamaConfig, n: int = MAX_POS) -> torch.Tensor:
    """`[n, rotary_dim]` cos|sin table built from HF's inverse frequencies."""
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.to(torch.float32)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def gptj_rope(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0
) -> torch.Tensor:
    """RoPE by its definition in the GPT-J (interleaved) layout: pair (2i, 2i+1) turns by pos * theta_i."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angle = positions.to(torch.float64)[:, None] * inv_freq[None]  # [tokens, rotary_dim/2]
    cos, sin = angle.cos(), angle.sin()
    out = x.to(torch.float64).clone()
    even, odd = out[..., 0:rotary_dim:2].clone(), out[..., 1:rotary_dim:2].clone()
    out[..., 0:rotary_dim:2] = even * cos - odd * sin
    out[..., 1:rotary_dim:2] = odd * cos + even * sin
    return out.to(x.dtype)


@pytest.fixture(scope="module")
def vllm_rope():
    """`vllm_rope(head_size, is_neox_style, rope_parameters)` → vLLM's rotary embedding, built on the CPU."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def build(head_size: int = HEAD_DIM, is_neox_style: bool = True, rope_parameters: dict | None = None):
        params = {"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})}
        with set_current_vllm_config(VllmConfig()):
            return get_rope(head_size, MAX_POS, is_neox_style, params, torch.float32)

    return build


def spec_of(rope) -> RopeSpec:
    return RopeSpec.from_cos_sin_cache(
        rope.cos_sin_cache, rope.rotary_dim, rope.head_size, rope.is_neox_style
    )


def keys(tokens: int = 12, heads: int = 2, head_dim: int = HEAD_DIM, seed: int = 0) -> torch.Tensor:
    return torch.randn(heads, tokens, head_dim, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- NeoX (Llama)


@pytest.mark.vllm
@pytest.mark.parametrize("start, delta", [(0, 1), (3, 37), (40, 200), (300, -5), (250, -250), (17, -9)])
def test_moved_keys_equal_hf_rope_at_the_new_position(vllm_rope, start, delta):
    config = hf_config()
    spec = spec_of(vllm_rope())
    x = keys()
    positions = torch.arange(start, start + x.shape[1])
    cached = hf_rope(x, positions, config)

    moved = rerope_(cached.clone(), delta, spec)

    expected = hf_rope(x, positions + delta, config)
    torch.testing.assert_close(moved, expected, rtol=0, atol=atol_at(int(positions.max()) + max(delta, 0)))
    # and it really moved: the old keys are far from the new ones
    assert (moved - cached).abs().max() > 1e-2


@pytest.mark.vllm
def test_vllm_table_is_the_hf_rotation(vllm_rope):
    """The table the plugin reads (vLLM's) is the rotation HF applies: the two references agree."""
    torch.testing.assert_close(vllm_rope().cos_sin_cache, hf_cos_sin_cache(hf_config()), rtol=0, atol=1e-5)


@pytest.mark.vllm
def test_per_token_tensor_deltas(vllm_rope):
    config = hf_config()
    spec = spec_of(vllm_rope())
    x = keys(tokens=8)
    positions = torch.tensor([0, 5, 9, 100, 101, 400, 33, 7])
    deltas = torch.tensor([3, -5, 0, 250, -100, -399, 1, 600])
    cached = hf_rope(x, positions, config)

    moved = rerope_(cached.clone(), deltas, spec)  # [tokens] broadcasts over [heads, tokens]

    torch.testing.assert_close(moved, hf_rope(x, positions + deltas, config), rtol=0, atol=atol_at(800))
    # the token with delta 0 is untouched, bit for bit
    assert torch.equal(moved[:, 2], cached[:, 2])


@pytest.mark.vllm
def test_per_block_tensor_deltas_broadcast(vllm_rope):
    """`[blocks, heads, block_size, head_dim]` keys with one delta per block (`[blocks, 1, 1]`)."""
    config = hf_config()
    spec = spec_of(vllm_rope())
    blocks, heads, bs = 3, 2, 4
    x = keys(tokens=blocks * bs, heads=heads)
    positions = torch.arange(blocks * bs)
    cached = hf_rope(x, positions, config)  # [heads, tokens, d]
    as_blocks = cached.view(heads, blocks, bs, HEAD_DIM).transpose(0, 1).contiguous()
    deltas = torch.tensor([64, -4, 0]).view(blocks, 1, 1)

    rerope_(as_blocks, deltas, spec)

    new_positions = positions + deltas.view(blocks).repeat_interleave(bs)
    expected = hf_rope(x, new_positions, config).view(heads, blocks, bs, HEAD_DIM).transpose(0, 1)
    torch.testing.assert_close(as_blocks, expected, rtol=0, atol=ATOL)


@pytest.mark.vllm
def test_moving_there_and_back_restores_the_keys(vllm_rope):
    spec = spec_of(vllm_rope())
    x = hf_rope(keys(), torch.arange(12), hf_config())
    y = rerope_(rerope_(x.clone(), 513, spec), -513, spec)
    torch.testing.assert_close(y, x, rtol=0, atol=ATOL)


@pytest.mark.vllm
def test_zero_delta_leaves_keys_bit_identical(vllm_rope):
    spec = spec_of(vllm_rope())
    x = keys()
    y = x.clone()
    assert rerope_(y, 0, spec) is y
    assert torch.equal(y, x)
    rerope_(y, torch.zeros(x.shape[1], dtype=torch.long), spec)
    assert torch.equal(y, x)


@pytest.mark.vllm
def test_rerope_works_in_place_on_a_transposed_view(vllm_rope):
    config = hf_config()
    spec = spec_of(vllm_rope())
    x = keys()
    cached = hf_rope(x, torch.arange(12), config)
    storage = cached.transpose(0, 1).contiguous()  # [tokens, heads, d], as a cache would hold it
    view = storage.transpose(0, 1)  # [heads, tokens, d], not contiguous
    assert not view.is_contiguous()

    out = rerope_(view, 21, spec)

    assert out is view
    expected = hf_rope(x, torch.arange(12) + 21, config)
    torch.testing.assert_close(storage.transpose(0, 1), expected, rtol=0, atol=ATOL)


@pytest.mark.vllm
def test_bf16_keys_are_rotated_in_float32(vllm_rope):
    """Low-precision caches: the result is the fp32 rotation rounded once, not a drift of bf16 products."""
    spec = spec_of(vllm_rope())
    x = hf_rope(keys(), torch.arange(12), hf_config()).to(torch.bfloat16)
    expected = rerope_(x.to(torch.float32), 77, spec).to(torch.bfloat16)
    got = rerope_(x.clone(), 77, spec)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------- other layouts


@pytest.mark.vllm
@pytest.mark.parametrize("delta", [9, -9, 300])
def test_gptj_interleaved_layout(vllm_rope, delta):
    rope = vllm_rope(is_neox_style=False)
    spec = spec_of(rope)
    assert not spec.is_neox_style
    x = keys()
    positions = torch.arange(20, 32)
    cached = gptj_rope(x, positions, HEAD_DIM)

    moved = rerope_(cached.clone(), delta, spec)

    torch.testing.assert_close(moved, gptj_rope(x, positions + delta, HEAD_DIM), rtol=0, atol=ATOL)


@pytest.mark.vllm
def test_gptj_layout_is_not_the_neox_layout(vllm_rope):
    """The layout flag matters: rotating interleaved keys as NeoX pairs gives other keys."""
    rope = vllm_rope(is_neox_style=False)
    neox_spec = RopeSpec.from_cos_sin_cache(rope.cos_sin_cache, HEAD_DIM, HEAD_DIM, True)
    x = keys()
    positions = torch.arange(12)
    moved = rerope_(gptj_rope(x, positions, HEAD_DIM), 5, neox_spec)
    assert (moved - gptj_rope(x, positions + 5, HEAD_DIM)).abs().max() > 1e-2


@pytest.mark.vllm
@pytest.mark.parametrize("is_neox_style", [True, False])
def test_partial_rotary_leaves_the_other_dimensions_untouched(vllm_rope, is_neox_style):
    rotary_dim = HEAD_DIM // 2
    rope = vllm_rope(is_neox_style=is_neox_style, rope_parameters={"partial_rotary_factor": 0.5})
    spec = spec_of(rope)
    assert (spec.rotary_dim, spec.head_dim) == (rotary_dim, HEAD_DIM)
    x = keys()
    positions = torch.arange(5, 17)
    if is_neox_style:  # HF's partial rotary (GPT-NeoX, Phi): RoPE on the first rotary_dim dimensions only
        config = hf_config(head_dim=rotary_dim)

        def rope_at(p: torch.Tensor) -> torch.Tensor:
            return torch.cat(
                [hf_rope(x[..., :rotary_dim].contiguous(), p, config), x[..., rotary_dim:]], dim=-1
            )
    else:

        def rope_at(p: torch.Tensor) -> torch.Tensor:
            return gptj_rope(x, p, rotary_dim)

    cached = rope_at(positions)
    moved = rerope_(cached.clone(), 40, spec)

    torch.testing.assert_close(moved, rope_at(positions + 40), rtol=0, atol=ATOL)
    assert torch.equal(moved[..., rotary_dim:], cached[..., rotary_dim:])


@pytest.mark.vllm
@pytest.mark.parametrize("delta", [100, -60, 700])
def test_llama3_scaled_rope(vllm_rope, delta):
    config = hf_config(theta=500000.0, rope_scaling=dict(LLAMA3))
    rope = vllm_rope(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    assert type(rope).__name__ == "Llama3RotaryEmbedding"
    torch.testing.assert_close(rope.cos_sin_cache, hf_cos_sin_cache(config), rtol=0, atol=1e-5)
    spec = spec_of(rope)
    x = keys()
    positions = torch.arange(60, 72)
    cached = hf_rope(x, positions, config)

    moved = rerope_(cached.clone(), delta, spec)

    torch.testing.assert_close(moved, hf_rope(x, positions + delta, config), rtol=0, atol=atol_at(72 + delta))


# --------------------------------------------------------------------------------------------- the table check


def plain_table(n: int = MAX_POS, rotary_dim: int = HEAD_DIM, theta: float = 10000.0) -> torch.Tensor:
    return hf_cos_sin_cache(hf_config(head_dim=rotary_dim, theta=theta), n)


def test_from_cos_sin_cache_accepts_plain_llama3_and_linear_tables():
    for table in (
        plain_table(),
        hf_cos_sin_cache(hf_config(theta=500000.0, rope_scaling=dict(LLAMA3))),
        hf_cos_sin_cache(hf_config(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ):
        spec = RopeSpec.from_cos_sin_cache(table, HEAD_DIM, HEAD_DIM, True)
        assert spec.max_delta == MAX_POS - 1


@pytest.mark.vllm
def test_from_cos_sin_cache_accepts_a_long_context_llama3_table():
    """Llama 3.1 8B's table (head 128, 131072 positions): fp32 rounding of large angles is not non-linearity."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {**LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 8192}
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(128, 131072, True, params, torch.float32)
    spec = RopeSpec.from_cos_sin_cache(rope.cos_sin_cache, 128, 128, True)
    assert spec.max_delta == 131071


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_from_cos_sin_cache_accepts_a_half_precision_table(dtype):
    """vLLM builds the table in the model's dtype (Llama passes none: the default dtype, set to the model's).

    SmolLM2's own rotary embedding (bf16, head 64, theta 1e5, 8192 positions) is a pure rotation, rounded."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 8192, True, {"rope_type": "default", "rope_theta": 100000.0}, dtype)
    assert rope.cos_sin_cache.dtype == dtype
    RopeSpec.from_cos_sin_cache(rope.cos_sin_cache, 64, 64, True)


@pytest.mark.vllm
@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},  # Qwen3's YaRN form
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 128},  # GPT-OSS's
])
def test_vllm_yarn_moves_keys_exactly_its_attention_factor_kept(vllm_rope, rope_parameters):
    """YaRN's table is a rotation times one attention factor: keys carry the factor from where they were
    computed, and moving them must rotate only — else every move would scale them once more."""
    rope = vllm_rope(rope_parameters=rope_parameters)
    table = rope.cos_sin_cache
    factor2 = float((table[:, : HEAD_DIM // 2] ** 2 + table[:, HEAD_DIM // 2 :] ** 2).mean())
    assert abs(factor2 - 1.0) > 1e-3, "this YaRN table scales keys (the case under test)"
    spec = RopeSpec.from_cos_sin_cache(table, rope.rotary_dim, rope.head_size, True, what="YaRN model")
    x = keys(tokens=1)
    for at, delta in ((5, 300), (400, -350)):
        want = neox_rope_by_table(x, at + delta, table)
        moved = rerope_(neox_rope_by_table(x, at, table), delta, spec)
        assert (moved - want).abs().max() < 1e-4, (at, delta)
        # The table as it is (factor not divided out) is a wrong move: it scales the keys again.
        wrong = rerope_(neox_rope_by_table(x, at, table), delta, RopeSpec(table, HEAD_DIM, HEAD_DIM, True))
        assert (wrong - want).abs().max() > 1e-2


@pytest.mark.parametrize("mscale", [1.1, 0.9])
def test_from_cos_sin_cache_takes_a_constant_scale_and_moves_by_rotation_only(mscale):
    table = plain_table() * mscale
    spec = RopeSpec.from_cos_sin_cache(table, HEAD_DIM, HEAD_DIM, True)
    x = keys(tokens=1)
    moved = rerope_(neox_rope_by_table(x, 10, table), 90, spec)
    assert (moved - neox_rope_by_table(x, 100, table)).abs().max() < 1e-4


def test_from_cos_sin_cache_refuses_a_scale_that_changes_with_the_position():
    n = plain_table().shape[0]
    table = plain_table() * (1.0 + 0.1 * torch.arange(n)[:, None] / n)
    with pytest.raises(RelocationError, match="changes with the position"):
        RopeSpec.from_cos_sin_cache(table, HEAD_DIM, HEAD_DIM, True)


def base_switch_table(
    switch: int, n: int = MAX_POS * 2, low: float = 10000.0, high: float = 40000.0
) -> torch.Tensor:
    """Dynamic-NTK-like: positions below `switch` turn with base `low`, the others with base `high`."""
    a = plain_table(n, theta=low)
    b = plain_table(n, theta=high)
    return torch.where(torch.arange(n)[:, None] < switch, a, b)


@pytest.mark.parametrize("switch", [4, 8, 50, 256, 1024, 1500, 2040])
def test_from_cos_sin_cache_refuses_angles_not_linear_in_position(switch):
    """A table with another base above some position cannot move keys across that position, wherever it is."""
    table = base_switch_table(switch)
    # the property the check guards: one move by the table's own row is wrong across the switch
    spec = RopeSpec(table, HEAD_DIM, HEAD_DIM, True)
    x = keys(tokens=1)
    at = switch - 3
    moved = rerope_(neox_rope_by_table(x, at, table), 6, spec)
    assert (moved - neox_rope_by_table(x, at + 6, table)).abs().max() > 1e-3

    with pytest.raises(RelocationError, match="not linear in the position"):
        RopeSpec.from_cos_sin_cache(table, HEAD_DIM, HEAD_DIM, True)


def neox_rope_by_table(x: torch.Tensor, position: int, table: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE of `x` at `position` by reading row `position` of `table` (what the model does)."""
    cos, sin = table[position].chunk(2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_from_cos_sin_cache_refuses_a_wrong_shape():
    with pytest.raises(RelocationError, match="unexpected rotary table shape"):
        RopeSpec.from_cos_sin_cache(plain_table(), 32, HEAD_DIM, True)  # table has 64 columns
    with pytest.raises(RelocationError, match="unexpected rotary table shape"):
        RopeSpec.from_cos_sin_cache(plain_table(rotary_dim=128), 128, HEAD_DIM, True)  # rotary_dim > head_dim


def test_moves_beyond_the_table_are_refused():
    spec = RopeSpec.from_cos_sin_cache(plain_table(64), HEAD_DIM, HEAD_DIM, True)
    with pytest.raises(RelocationError, match="covers 63"):
        rerope_(keys(), 64, spec)
    with pytest.raises(RelocationError, match="covers 63"):
        rerope_(keys(), -64, spec)
    with pytest.raises(RelocationError):
        rerope_(keys(tokens=2), torch.tensor([1, -70]), spec)
    rerope_(keys(), -63, spec)  # the last row is usable


def test_keys_of_another_head_dim_are_refused():
    spec = RopeSpec.from_cos_sin_cache(plain_table(), HEAD_DIM, HEAD_DIM, True)
    with pytest.raises(ValueError, match="head_dim 32"):
        rerope_(keys(head_dim=32), 1, spec)


def test_rotation_for_negative_delta_is_the_inverse():
    spec = RopeSpec.from_cos_sin_cache(plain_table(), HEAD_DIM, HEAD_DIM, True)
    cos_p, sin_p = rotation_for_delta(spec, 12, torch.float32, torch.device("cpu"))
    cos_n, sin_n = rotation_for_delta(spec, -12, torch.float32, torch.device("cpu"))
    assert torch.equal(cos_p, cos_n)
    assert torch.equal(sin_p, -sin_n)


# --------------------------------------------------------------------------------------------- a loaded model


class FakeModel(torch.nn.Module):
    """Layers holding vLLM rotary embeddings, as a loaded vLLM model does (`...self_attn.rotary_emb`)."""

    def __init__(self, *ropes):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in ropes)
        for layer, rope in zip(self.layers, ropes):
            layer.rotary_emb = rope


@pytest.mark.vllm
def test_rope_spec_of_model_reads_the_shared_rope(vllm_rope):
    from spanq_backend.vllm_integration.kv_layout import rope_spec_of_model

    rope = vllm_rope(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    spec = rope_spec_of_model(FakeModel(rope, rope))
    assert (spec.rotary_dim, spec.head_dim, spec.is_neox_style) == (HEAD_DIM, HEAD_DIM, True)
    assert torch.equal(spec.cos_sin_cache, rope.cos_sin_cache)


@pytest.mark.vllm
def test_rope_spec_of_model_refuses_what_cannot_move(vllm_rope):
    from spanq_backend.vllm_integration.kv_layout import rope_spec_of_model

    with pytest.raises(RelocationError, match="no rotary position embedding"):
        rope_spec_of_model(torch.nn.Linear(2, 2))
    plain, other = vllm_rope(), vllm_rope(rope_parameters={"rope_theta": 20000.0})
    with pytest.raises(RelocationError, match="different rotary embeddings"):
        rope_spec_of_model(FakeModel(plain, other))
    mrope = vllm_rope(rope_parameters={"mrope_section": [16, 8, 8]})
    with pytest.raises(RelocationError, match="multimodal"):
        rope_spec_of_model(FakeModel(mrope))


@pytest.mark.vllm
def test_rope_specs_of_layers_gives_each_layer_its_own_rope(vllm_rope):
    """Gemma 3's local and global layers rotate with different bases: each layer's keys move with its own."""
    from spanq_backend.vllm_integration.kv_layout import rope_specs_of_layers

    local, glob = vllm_rope(), vllm_rope(rope_parameters={"rope_theta": 1e6})
    model = FakeModel(local, local, glob)
    names = [f"layers.{i}.attn" for i in range(3)]
    specs = rope_specs_of_layers(model, names)
    assert torch.equal(specs[0].cos_sin_cache, local.cos_sin_cache)
    assert specs[1] is specs[0]
    assert torch.equal(specs[2].cos_sin_cache, glob.cos_sin_cache)
    with pytest.raises(RelocationError, match="cannot tell which one"):
        rope_specs_of_layers(model, ["elsewhere.attn"])
    # one rope for every layer: no names needed
    assert len(rope_specs_of_layers(FakeModel(local, local), ["a", "b"])) == 2


@pytest.mark.vllm
def test_a_longrope_table_is_the_one_vllm_reads_for_this_engine(vllm_rope):
    """vLLM's LongRoPE reads its short-factor table when the engine's context fits the original one; spanq
    moves keys with that table (not the long one)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from spanq_backend.vllm_integration.kv_layout import rope_spec_of_rotary

    half = HEAD_DIM // 2
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
              "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [2.0 + 0.1 * i for i in range(half)]}
    config = VllmConfig()
    config.model_config = type("M", (), {"max_model_len": 512})()
    with set_current_vllm_config(config):
        rope = get_rope(HEAD_DIM, MAX_POS, True, params, torch.float32)
    assert not rope.use_long_rope
    spec = rope_spec_of_rotary(rope, "phi3")
    short = rope.long_short_cos_sin_cache[:512]
    x = keys(tokens=1)
    moved = rerope_(neox_rope_by_table(x, 20, short), 100, spec)
    assert (moved - neox_rope_by_table(x, 120, short)).abs().max() < 1e-4
