"""The PLE layer's reference against transformers 5.23.0's ``Qwen4ExpTextPLELayer`` on CPU.

The oracle's weights are randomised first: ``_init_weights`` zeroes ``conv1d`` and the three
norm weights (the oracle notes in docs/families.md), which would leave the conv and the ``(1 + w)`` untested. The
reference takes each token's concatenated table rows; the tests read them from the oracle's
``ple_embedding`` output (a forward hook), so the ids and the table are the oracle's own.

- bf16: bit for bit against the oracle, one-shot, streamed through a ``DynamicCache`` in
  hypothesis-chosen chunks, with padding masks, and over a flat batch of sequences.
- fp32: bit for bit against the oracle on CPU too; the oracle and the reference each within
  half the derived bound of :func:`ple_layer_tolerance` from the float64 value, and fp32
  variants that sum the conv in another order (as a GPU kernel may) within the bound.
- Controls: the mistakes the spec names (conv rounded per tap, gate in fp32 rounded once,
  state not carried, ``copysign`` at ``s = 0``) and a few structural ones fail these checks.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tests.families.qwen4_ple.conftest import ORACLE_MODEL_FIELDS
from tests.helpers import assert_same_bits

from engramrt.errors import CheckpointError, ValidationError
from engramrt.families.qwen4_ple import layer as ple
from engramrt.families.qwen4_ple.layer import (
    PleLayerWeights,
    ple_conv_state_len,
    ple_gate_reference,
    ple_layer_reference,
    ple_layer_reference_varlen,
    ple_layer_tolerance,
)
from engramrt.gate.reference import assert_within_tolerance

modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
transformers = pytest.importorskip("transformers")

VOCAB = 97
EOS = 5
D = 32
N = 3
H = 2  # C = (N-1)*H = 4 heads
K = 4
EPS = 1e-6
S = ple_conv_state_len(K, N)


def text_fields(hc: int, embed_dim: int) -> dict:
    """A tiny Qwen4-Exp text config whose decoder layer 1 (PLE id 2) is linear attention,
    as ``DynamicCache`` needs for the PLE conv state (the oracle notes in docs/families.md)."""
    return (
        dict(
            vocab_size=VOCAB,
            hidden_size=D,
            hc_count=hc,
            num_hidden_layers=2,
            layer_types=["linear_attention", "linear_attention"],
            ple_layer_ids=[2],
            ple_embed_dim=embed_dim,
            ngram_size=N,
            heads_per_ngram=H,
            ple_conv_kernel_size=K,
            ngram_vocab_size_base=101,
            make_ngram_vocab_size_divisible_by=8,
            eos_token_id=EOS,
            rms_norm_eps=EPS,
        )
        | ORACLE_MODEL_FIELDS
    )


LAYER_IDX = 1  # decoder layer index i = ple_layer_id - 1


@dataclass
class Oracle:
    config: object
    layers: dict[torch.dtype, torch.nn.Module]

    @property
    def width(self) -> int:
        return self.config.hc_count * D

    def weights(self, dtype: torch.dtype) -> PleLayerWeights:
        state = {
            f"model.layers.{LAYER_IDX}.ple.{k}": v
            for k, v in self.layers[dtype].state_dict().items()
        }
        return PleLayerWeights.from_state_dict(
            state,
            LAYER_IDX,
            hidden_size=D,
            hc_count=self.config.hc_count,
            embed_dim=self.config.ple_embed_dim,
            conv_kernel_size=K,
        )


@functools.cache
def oracle(hc: int, embed_dim: int, seed: int = 0) -> Oracle:
    """The oracle layer with every parameter randomised (norm and conv weights included)."""
    config = transformers.Qwen4ExpTextConfig(**text_fields(hc, embed_dim))
    layer = modeling.Qwen4ExpTextPLELayer(config, layer_idx=LAYER_IDX, ple_layer_index=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "proj" in name:
                scale = param.shape[-1] ** -0.5
            elif "norm" in name or "conv" in name:
                scale = 0.5
            else:
                scale = 1.0  # the table
            param.copy_(torch.randn(param.shape, generator=g) * scale)
    layer.eval()
    return Oracle(config, {torch.float32: layer, torch.bfloat16: _bf16_copy(layer, config)})


def _bf16_copy(layer: torch.nn.Module, config: object) -> torch.nn.Module:
    copy = modeling.Qwen4ExpTextPLELayer(config, layer_idx=LAYER_IDX, ple_layer_index=0)
    copy.load_state_dict(layer.state_dict())
    return copy.to(torch.bfloat16).eval()


def run_oracle(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    cache: object = None,
    conv_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, hc*D], rows [T, E])`` of one oracle call on one sequence."""
    captured = {}
    hook = layer.ple_embedding.register_forward_hook(
        lambda module, args, output: captured.__setitem__("rows", output)
    )
    try:
        with torch.no_grad():
            mask = None if conv_mask is None else conv_mask.long().unsqueeze(0)
            out = layer(hidden.unsqueeze(0), ids.unsqueeze(0), cache, conv_mask=mask)
    finally:
        hook.remove()
    return out[0], captured["rows"][0]


def oracle_state(cache: object) -> torch.Tensor:
    """The oracle's PLE conv state (``DynamicCache`` conv state 1) as our ``[S, hc*D]``."""
    return cache.get_conv_state(LAYER_IDX, state_idx=1)[0].t()


def draw_inputs(
    hc: int, num_tokens: int, dtype: torch.dtype, seed: int, *, zero_streams: int = 2
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """``(hidden, ids, zeroed)``: random streams with ``zero_streams`` (token, stream)
    pairs set to 0 (their query is 0, so ``s = 0`` exactly), ids with some EOS."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hc * D, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (num_tokens,), generator=g)
    ids[torch.rand(num_tokens, generator=g) < 0.1] = EOS
    zeroed = []
    for _ in range(min(zero_streams, num_tokens)):
        token, stream = (
            int(torch.randint(num_tokens, (1,), generator=g)),
            int(torch.randint(hc, (1,), generator=g)),
        )
        hidden[token, stream * D : (stream + 1) * D] = 0
        zeroed.append((token, stream))
    return hidden, ids, zeroed


def reference(o: Oracle, dtype: torch.dtype, hidden, rows, **kwargs):
    return ple_layer_reference(hidden, rows, o.weights(dtype), ngram_size=N, eps=EPS, **kwargs)


# --------------------------------------------------------------------------- bf16, one shot


SHAPES = [(2, 16), (3, 48), (4, 32)]


@pytest.mark.parametrize(("hc", "embed_dim"), SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 53])
def test_bf16_one_shot_is_the_oracle_bit_for_bit(hc: int, embed_dim: int, num_tokens: int) -> None:
    o = oracle(hc, embed_dim)
    hidden, ids, _ = draw_inputs(hc, num_tokens, torch.bfloat16, seed=num_tokens + hc)
    cache = transformers.DynamicCache(config=o.config)
    expected, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids, cache)
    out, state = reference(o, torch.bfloat16, hidden, rows)
    assert_same_bits(out, expected, "out")
    assert_same_bits(state, oracle_state(cache), "conv state")


def test_bf16_zero_score_gives_half_the_value() -> None:
    """A zero hidden stream has ``q = 0``, so ``s = 0`` and the gate is exactly 0.5: the
    stream's ``a`` is ``v / 2``. Checked through the oracle's own key, value and output."""
    o = oracle(3, 48)
    hidden, ids, zeroed = draw_inputs(3, 20, torch.bfloat16, seed=11, zero_streams=4)
    expected, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids)
    layer = o.layers[torch.bfloat16]
    with torch.no_grad():
        key = layer.norm_key(layer.key_proj(rows)).view(20, 3, D)
        query = layer.norm_query(hidden).view(20, 3, D)
        value = layer.value_proj(rows)
    gate = ple_gate_reference(key, query)
    for token, stream in zeroed:
        assert gate[token, stream].item() == 0.5
    out, _ = reference(o, torch.bfloat16, hidden, rows)
    assert_same_bits(out, expected, "out")
    weights = o.weights(torch.bfloat16)
    projections = F.linear(rows, weights.key_proj), F.linear(rows, weights.value_proj)
    gated, _ = ple.ple_gate_norm_reference(*projections, hidden, weights, EPS, None)
    for token, stream in zeroed:
        half = (value[token].float() * 0.5).to(torch.bfloat16)
        assert_same_bits(gated[token, stream * D : (stream + 1) * D], half, "a at s = 0")


def oracle_gate(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The oracle's gate lines, verbatim (modeling_qwen4_exp.py, Qwen4ExpTextPLELayer.forward)."""
    gate = (key * query).sum(dim=-1, keepdim=True) / (key.shape[-1] ** 0.5)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    return torch.sigmoid(gate)[..., 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_is_the_oracle_expression_and_sign_zero_is_zero(dtype: torch.dtype) -> None:
    """Random scores of every size (tiny ones hit the clamp), plus rows whose score is
    ``+0`` and ``-0``: the gate is 0.5 there, as ``torch.sign`` makes it."""
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(4000, 3, D, generator=g) * torch.logspace(-6, 1, 4000).view(-1, 1, 1)).to(
        dtype
    )
    query = torch.randn(4000, 3, D, generator=g).to(dtype)
    query[:5] = 0  # s = +-0
    key[5:8] = -0.0
    found = ple_gate_reference(key, query)
    expected = oracle_gate(key, query)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(found.view(bits), expected.view(bits))
    assert bool((found[:8] == 0.5).all())


# --------------------------------------------------------------------------- fp32


def _conv_variant(
    *, round_to: torch.dtype | None = None, dilation: int | None = None, reverse: bool = False
) -> Callable:
    """``_short_conv`` with a separate fp32 multiply and add per tap (not fused), and: the
    running sum rounded to ``round_to`` after every tap, or the taps read ``dilation`` apart
    instead of N (the state keeps its S rows), or the taps summed newest first."""

    def conv(gated_normed, conv_state, conv1d, ngram_size):
        dtype, num_tokens = gated_normed.dtype, gated_normed.shape[0]
        step = ngram_size if dilation is None else dilation
        window = torch.cat([conv_state, gated_normed])
        offset = conv_state.shape[0] - (conv1d.shape[2] - 1) * step
        total = torch.zeros(gated_normed.shape, dtype=torch.float32)
        taps = range(conv1d.shape[2])
        for tap in reversed(taps) if reverse else taps:
            start = offset + tap * step
            total = total + conv1d[:, 0, tap].float() * window[start : start + num_tokens].float()
            if round_to is not None:
                total = total.to(round_to).float()
        mixed = F.silu(total.to(dtype).float()).to(dtype)
        return mixed, window[window.shape[0] - conv_state.shape[0] :]

    return conv


@pytest.mark.parametrize(("hc", "embed_dim"), SHAPES)
def test_fp32_is_the_oracle_and_within_the_derived_bound(hc: int, embed_dim: int) -> None:
    """On CPU the fp32 reference is the oracle bit for bit; the oracle and the reference are
    each within B = bound / 2 of the float64 value (the derivation's own claim)."""
    o = oracle(hc, embed_dim)
    num_tokens = 61
    hidden, ids, _ = draw_inputs(hc, num_tokens, torch.float32, seed=5, zero_streams=3)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:3] = False
    ids = torch.where(mask, ids, EOS)
    expected, rows = run_oracle(o.layers[torch.float32], hidden, ids, conv_mask=mask)
    out, _ = reference(o, torch.float32, hidden, rows, token_mask=mask)
    assert_same_bits_fp32(out, expected, "fp32 reference vs oracle")
    exact, bound = ple_layer_tolerance(
        hidden, rows, o.weights(torch.float32), ngram_size=N, eps=EPS, token_mask=mask
    )
    assert_within_tolerance(expected, exact, bound / 2, label="oracle vs float64")
    assert_within_tolerance(out, exact, bound / 2, label="fp32 reference vs float64")
    # The bound is not vacuous: it is far below the outputs' size.
    assert float((bound / exact.abs().clamp_min(1e-3)).median()) < 1e-2


def assert_same_bits_fp32(found: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    assert found.dtype == expected.dtype == torch.float32, (found.dtype, expected.dtype)
    differ = found.view(torch.int32) != expected.view(torch.int32)
    assert not bool(differ.any()), f"{label}: {int(differ.sum())} of {found.numel()} values differ"


LEGAL_ORDERS = {
    "taps multiplied then added": _conv_variant(),
    "taps newest first": _conv_variant(reverse=True),
}


@pytest.mark.parametrize("order", sorted(LEGAL_ORDERS))
def test_fp32_other_summation_orders_stay_within_the_bound(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the bound is for: an fp32 implementation that sums in another order (as a GPU
    kernel will) differs from the oracle in its bits but not by more than the bound."""
    o = oracle(3, 48)
    hidden, ids, _ = draw_inputs(3, 61, torch.float32, seed=6, zero_streams=3)
    expected, rows = run_oracle(o.layers[torch.float32], hidden, ids)
    _, bound = ple_layer_tolerance(hidden, rows, o.weights(torch.float32), ngram_size=N, eps=EPS)
    monkeypatch.setattr(ple, "_short_conv", LEGAL_ORDERS[order])
    out, _ = reference(o, torch.float32, hidden, rows)
    assert float((out != expected).float().mean()) > 0.05, "the variant should differ in bits"
    assert_within_tolerance(out, expected, bound, label=order)


def _copysign_gate(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The gate with ``sign(s)`` as ``copysign(1, s)``: ``s = 0`` gives ``g = +sqrt(1e-6)``."""
    dtype = key.dtype
    score = ((key.float() * query.float()).to(dtype).float().sum(-1).to(dtype).float() / D**0.5).to(
        dtype
    )
    root = score.float().abs().clamp_min(1e-6).sqrt().to(dtype)
    logit = torch.copysign(root.float(), score.float()).to(dtype)
    return torch.sigmoid(logit.float()).to(dtype)


def _no_one_plus_w(x, weight, group, eps):
    grouped = x.float().unflatten(-1, (-1, group))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return normed.flatten(-2).to(x.dtype)


FP32_MISTAKES = {
    "copysign at s = 0": ("ple_gate_reference", _copysign_gate),
    "conv summed in bf16": ("_short_conv", _conv_variant(round_to=torch.bfloat16)),
    "conv dilation 1": ("_short_conv", _conv_variant(dilation=1)),
    "norms without 1 + w": ("_group_rms_norm", _no_one_plus_w),
}


@pytest.mark.parametrize("mistake", sorted(FP32_MISTAKES))
def test_fp32_bound_catches_mistakes(mistake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Controls: each mistake, patched into the reference, fails the fp32 comparison."""
    o = oracle(3, 48)
    hidden, ids, _ = draw_inputs(3, 40, torch.float32, seed=9, zero_streams=4)
    expected, rows = run_oracle(o.layers[torch.float32], hidden, ids)
    _, bound = ple_layer_tolerance(hidden, rows, o.weights(torch.float32), ngram_size=N, eps=EPS)
    name, replacement = FP32_MISTAKES[mistake]
    monkeypatch.setattr(ple, name, replacement)
    out, _ = reference(o, torch.float32, hidden, rows)
    with pytest.raises(AssertionError, match="outside the derived tolerance"):
        assert_within_tolerance(out, expected, bound, label=mistake)


# --------------------------------------------------------------------------- bf16 controls


def _gate_in_fp32_rounded_once(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    score = (key.float() * query.float()).sum(-1) / key.shape[-1] ** 0.5
    return torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt()).to(key.dtype)


BF16_MISTAKES = {
    "conv rounded per tap": ("_short_conv", _conv_variant(round_to=torch.bfloat16), 0.05),
    "gate in fp32 rounded once": ("ple_gate_reference", _gate_in_fp32_rounded_once, 0.02),
}


@pytest.mark.parametrize("mistake", sorted(BF16_MISTAKES))
def test_bf16_bit_check_catches_rounding_mistakes(
    mistake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Controls: rounding at other points than the oracle's changes a visible share of the
    bf16 outputs (docs/families.md §6 measured ~17% for the conv, ~8% for the gate)."""
    o = oracle(4, 32)
    hidden, ids, _ = draw_inputs(4, 200, torch.bfloat16, seed=21)
    expected, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids)
    name, replacement, least = BF16_MISTAKES[mistake]
    monkeypatch.setattr(ple, name, replacement)
    out, _ = reference(o, torch.bfloat16, hidden, rows)
    differ = float((out.view(torch.int16) != expected.view(torch.int16)).float().mean())
    assert differ > least, f"{mistake}: only {differ:.1%} of outputs differ"


# --------------------------------------------------------------------------- streaming


def split_points(num_tokens: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *sorted(min(c, num_tokens) for c in cuts), num_tokens]
    return list(itertools.pairwise(bounds))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(1, 40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    padding=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
@example(num_tokens=9, cuts=[3, 5], padding=0, seed=65536)  # the oracle's states differ here
def test_streaming_carries_the_state_bit_for_bit(
    num_tokens: int, cuts: list[int], padding: int, seed: int
) -> None:
    """Chunks with the state carried (zero-length chunks included) equal one shot, and equal
    the oracle driven with a ``DynamicCache`` over the same (non-empty) chunks; the carried
    state is the cache's. ``padding`` left-pads the sequence (masked, ids EOS).

    The final state equals the one-shot state wherever the oracle's own do: in bf16 the
    oracle's projections round by the shape of the chunk (CPU matrix products block by
    rows), so its chunked state can differ from its one-shot state by an ulp (seen:
    9 tokens cut at 3 and 5, seed 65536, 3 values). There the state must be the oracle's
    chunked one, checked after every chunk; the one-shot state is the oracle's one-shot
    one."""
    o = oracle(3, 48)
    hidden, ids, _ = draw_inputs(3, num_tokens, torch.bfloat16, seed=seed)
    mask = torch.arange(num_tokens) >= padding
    ids = torch.where(mask, ids, EOS)
    token_mask = None if padding == 0 else mask
    one_shot_cache = transformers.DynamicCache(config=o.config)
    whole, rows = run_oracle(
        o.layers[torch.bfloat16], hidden, ids, one_shot_cache, conv_mask=token_mask
    )
    one_shot, one_shot_state = reference(o, torch.bfloat16, hidden, rows, token_mask=token_mask)
    assert_same_bits(one_shot, whole, "one shot vs oracle")
    assert_same_bits(one_shot_state, oracle_state(one_shot_cache), "one-shot state vs oracle")

    cache = transformers.DynamicCache(config=o.config)
    state = None
    for start, stop in split_points(num_tokens, cuts):
        piece_mask = None if token_mask is None else token_mask[start:stop]
        out, state = reference(
            o,
            torch.bfloat16,
            hidden[start:stop],
            rows[start:stop],
            conv_state=state,
            token_mask=piece_mask,
        )
        assert_same_bits(out, one_shot[start:stop], f"chunk [{start}, {stop}) vs one shot")
        if stop > start:
            expected, chunk_rows = run_oracle(
                o.layers[torch.bfloat16], hidden[start:stop], ids[start:stop], cache, piece_mask
            )
            assert_same_bits(chunk_rows, rows[start:stop], "oracle rows, chunked vs one shot")
            assert_same_bits(out, expected, f"chunk [{start}, {stop}) vs oracle")
            assert_same_bits(state, oracle_state(cache), "state vs oracle cache")
    oracle_chunked, oracle_one_shot = oracle_state(cache), oracle_state(one_shot_cache)
    if torch.equal(oracle_chunked.view(torch.int16), oracle_one_shot.view(torch.int16)):
        assert_same_bits(state, one_shot_state, "final state vs one shot")


def test_streaming_without_the_state_fails() -> None:
    """Control: starting every chunk from zeros changes the outputs after the first chunk."""
    o = oracle(3, 48)
    hidden, ids, _ = draw_inputs(3, 30, torch.bfloat16, seed=4)
    expected, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids)
    out, _ = reference(o, torch.bfloat16, hidden[12:], rows[12:], conv_state=None)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(out, expected[12:], "chunk without state")
    _, state = reference(o, torch.bfloat16, hidden[:12], rows[:12])
    out, _ = reference(o, torch.bfloat16, hidden[12:], rows[12:], conv_state=state)
    assert_same_bits(out, expected[12:], "chunk with state")


# --------------------------------------------------------------------------- masks


def test_token_mask_is_the_oracle_conv_mask() -> None:
    """Left padding and holes, ids EOS where masked (as ``Qwen4ExpTextModel`` does): bit for
    bit the oracle's ``conv_mask``. Masked tokens have ``a = b = 0``: their state rows are
    zero, and a padded prefix (nothing but zeros in its conv window) outputs zero."""
    o = oracle(2, 16)
    num_tokens, padding = 32, 4
    hidden, ids, _ = draw_inputs(2, num_tokens, torch.bfloat16, seed=8)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:padding] = False
    mask[20:22] = False
    mask[num_tokens - 1] = False
    ids = torch.where(mask, ids, EOS)
    expected, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids, conv_mask=mask)
    out, state = reference(o, torch.bfloat16, hidden, rows, token_mask=mask)
    assert_same_bits(out, expected, "masked out")
    assert bool((out[:padding] == 0).all())
    assert bool((state[-1] == 0).all())  # the last token is masked
    # Control: the same rows without the mask give other outputs.
    unmasked, _ = reference(o, torch.bfloat16, hidden, rows)
    assert not torch.equal(unmasked, expected)
    assert bool((unmasked[:padding] != 0).any())


# --------------------------------------------------------------------------- flat batches


def test_varlen_is_each_sequence_alone_and_the_oracle() -> None:
    """Four sequences, each after a prefix of its own, in one flat batch (one of no tokens):
    bit for bit the one-sequence reference and the oracle per sequence, states included."""
    o = oracle(3, 48)
    prefixes, lengths = [5, 2, 9, 0], [4, 0, 1, 13]
    hiddens, rowss, states, expected_outs, expected_states = [], [], [], [], []
    for seq, (prefix, length) in enumerate(zip(prefixes, lengths, strict=True)):
        hidden, ids, _ = draw_inputs(3, prefix + length, torch.bfloat16, seed=100 + seq)
        cache = transformers.DynamicCache(config=o.config)
        _, rows = run_oracle(o.layers[torch.bfloat16], hidden, ids)
        state = None
        if prefix:
            _, state = reference(o, torch.bfloat16, hidden[:prefix], rows[:prefix])
            run_oracle(o.layers[torch.bfloat16], hidden[:prefix], ids[:prefix], cache)
        states.append(torch.zeros(S, o.width, dtype=torch.bfloat16) if state is None else state)
        if length:
            out, _ = run_oracle(o.layers[torch.bfloat16], hidden[prefix:], ids[prefix:], cache)
            expected_outs.append(out)
            expected_states.append(oracle_state(cache))
        else:
            expected_states.append(states[-1])
        hiddens.append(hidden[prefix:])
        rowss.append(rows[prefix:])
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, new_states = ple_layer_reference_varlen(
        torch.cat(hiddens),
        torch.cat(rowss),
        o.weights(torch.bfloat16),
        query_start_loc=starts,
        ngram_size=N,
        eps=EPS,
        conv_states=torch.stack(states),
    )
    assert_same_bits(out, torch.cat(expected_outs), "flat batch vs oracle")
    assert_same_bits(new_states, torch.stack(expected_states), "states vs oracle")
    for seq in range(len(lengths)):
        alone, alone_state = reference(
            o, torch.bfloat16, hiddens[seq], rowss[seq], conv_state=states[seq]
        )
        assert_same_bits(out[starts[seq] : starts[seq + 1]], alone, f"sequence {seq}")
        assert_same_bits(new_states[seq], alone_state, f"state {seq}")


# --------------------------------------------------------------------------- weights


def good_weights(hc: int = 3, embed_dim: int = 48) -> dict[str, torch.Tensor]:
    return {
        "key_proj": torch.zeros(hc * D, embed_dim, dtype=torch.bfloat16),
        "value_proj": torch.zeros(D, embed_dim, dtype=torch.bfloat16),
        "norm_key": torch.zeros(hc * D, dtype=torch.bfloat16),
        "norm_query": torch.zeros(hc * D, dtype=torch.bfloat16),
        "norm_conv": torch.zeros(hc * D, dtype=torch.bfloat16),
        "conv1d": torch.zeros(hc * D, 1, K, dtype=torch.bfloat16),
    }


BAD_WEIGHTS = {
    "key_proj columns": (
        "key_proj",
        torch.zeros(96, 47, dtype=torch.bfloat16),
        ["key_proj", "[96, 47]", "expected [hc*D, E]", "E=48"],
    ),
    "key_proj rows": (
        "key_proj",
        torch.zeros(80, 48, dtype=torch.bfloat16),
        ["key_proj", "[80, 48]", "D=32"],
    ),
    "value_proj dtype": (
        "value_proj",
        torch.zeros(32, 48, dtype=torch.int32),
        ["value_proj", "torch.int32", "expected a model dtype"],
    ),
    "norm_conv shape": (
        "norm_conv",
        torch.zeros(95, dtype=torch.bfloat16),
        ["norm_conv", "[95]", "expected shape [96]"],
    ),
    "norm_key dtype": (
        "norm_key",
        torch.zeros(96, dtype=torch.float32),
        ["norm_key", "torch.float32", "expected value_proj's dtype torch.bfloat16"],
    ),
    "conv1d shape": (
        "conv1d",
        torch.zeros(96, K, dtype=torch.bfloat16),
        ["conv1d", "[96, 4]", "expected [96, 1, K]"],
    ),
    "not a tensor": ("norm_query", [0.0] * 96, ["norm_query is a list", "expected a tensor"]),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_weights_errors_name_parameter_value_and_expectation(case: str) -> None:
    name, bad, phrases = BAD_WEIGHTS[case]
    tensors = good_weights() | {name: bad}
    with pytest.raises(ValidationError) as info:
        PleLayerWeights(**tensors)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


def test_weights_sizes() -> None:
    weights = PleLayerWeights(**good_weights(hc=4, embed_dim=16))
    assert (weights.hidden_size, weights.hc_count, weights.embed_dim, weights.conv_kernel_size) == (
        D,
        4,
        16,
        K,
    )
    assert weights.dtype == torch.bfloat16


@functools.cache
def full_models() -> dict[str, torch.nn.Module]:
    """A composite (``Qwen4ExpForConditionalGeneration``) and a text-only
    (``Qwen4ExpForCausalLM``) tiny model: their state dicts carry the real checkpoint names."""
    text = text_fields(2, 16)
    config = transformers.Qwen4ExpConfig(
        text_config=text,
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=D
        ),
    )
    composite = transformers.Qwen4ExpForConditionalGeneration(config)
    text_only = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text))
    return {"model.language_model.": composite, "model.": text_only}


@pytest.mark.parametrize("prefix", ["model.language_model.", "model."])
def test_weights_from_a_state_dict_with_either_prefix(prefix: str) -> None:
    model = full_models()[prefix]
    state = model.state_dict()
    module = (
        model.model.language_model.layers[LAYER_IDX].ple
        if prefix == "model.language_model."
        else model.model.layers[LAYER_IDX].ple
    )
    sizes = dict(hidden_size=D, hc_count=2, embed_dim=16, conv_kernel_size=K)
    for chosen in (None, prefix):
        weights = PleLayerWeights.from_state_dict(state, LAYER_IDX, prefix=chosen, **sizes)
        assert weights.key_proj is state[f"{prefix}layers.{LAYER_IDX}.ple.key_proj.weight"]
        assert torch.equal(weights.conv1d, module.conv1d.weight)
        assert torch.equal(weights.norm_conv, module.norm_conv.weight)
    with pytest.raises(CheckpointError, match=rf"{prefix}layers\.0\.ple\.key_proj\.weight"):
        PleLayerWeights.from_state_dict(state, 0, prefix=prefix, **sizes)  # layer 0 has no PLE
    with pytest.raises(CheckpointError, match=r"expected hc_count=3"):
        PleLayerWeights.from_state_dict(state, LAYER_IDX, **(sizes | {"hc_count": 3}))
    broken = dict(state)
    broken[f"{prefix}layers.{LAYER_IDX}.ple.norm_key.weight"] = torch.zeros(7)
    with pytest.raises(
        CheckpointError, match=rf"{prefix}layers\.1\.ple\.\*: norm_key has shape \[7\]"
    ):
        PleLayerWeights.from_state_dict(broken, LAYER_IDX, **sizes)


def test_weights_from_a_state_dict_refuses_both_prefixes_and_neither() -> None:
    text_only = full_models()["model."].state_dict()
    both = text_only | {
        "model.language_model." + k[len("model.") :]: v for k, v in text_only.items()
    }
    sizes = dict(hidden_size=D, hc_count=2, embed_dim=16, conv_kernel_size=K)
    with pytest.raises(CheckpointError, match="holds both of"):
        PleLayerWeights.from_state_dict(both, LAYER_IDX, **sizes)
    with pytest.raises(CheckpointError, match="holds neither of"):
        PleLayerWeights.from_state_dict({}, LAYER_IDX, **sizes)


# --------------------------------------------------------------------------- inputs


def test_inputs_are_checked_once_at_the_door() -> None:
    o = oracle(2, 16)
    weights = o.weights(torch.bfloat16)
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    rows = torch.randn(5, 16).to(torch.bfloat16)
    cases = [
        (dict(hidden=hidden[:, :60]), "hidden has shape [5, 60]"),
        (dict(rows=rows.float()), "rows has shape [5, 16] dtype torch.float32"),
        (
            dict(conv_state=torch.zeros(S - 1, 64, dtype=torch.bfloat16)),
            f"expected torch.bfloat16 [{S}, 64]",
        ),
        (
            dict(token_mask=torch.ones(5, dtype=torch.long)),
            "token_mask has shape [5] dtype torch.int64",
        ),
        (dict(ngram_size=0), "ngram_size=0"),
        (dict(eps=0.0), "eps=0.0"),
    ]
    for change, phrase in cases:
        args = dict(hidden=hidden, rows=rows, ngram_size=N, eps=EPS) | change
        with pytest.raises(ValidationError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
            ple_layer_reference(args.pop("hidden"), args.pop("rows"), weights, **args)
    with pytest.raises(ValidationError, match=r"query_start_loc=\[0, 3, 2, 5\]"):
        ple_layer_reference_varlen(
            hidden, rows, weights, query_start_loc=torch.tensor([0, 3, 2, 5]), ngram_size=N, eps=EPS
        )


def test_empty_chunk_keeps_the_state() -> None:
    o = oracle(2, 16)
    state = torch.randn(S, 64).to(torch.bfloat16)
    out, new_state = reference(
        o,
        torch.bfloat16,
        torch.empty(0, 64, dtype=torch.bfloat16),
        torch.empty(0, 16, dtype=torch.bfloat16),
        conv_state=state,
    )
    assert out.shape == (0, 64)
    assert_same_bits(new_state, state, "state")
