"""Variants of the tiny LM's Engram layer: the short convolution after the gate
(``--short-conv``, :class:`~engramrt_lab.models.lm.ShortConv`: causal over positions,
the same in chunks with the request's earlier values as over the whole sequence, absent
at its start) and each n-gram order's hash heads summed before the projection
(``--wkv-heads summed``: the served projection, every column's, computes the same). A
model with both is trained, written, loaded and served (chunked prefill, prefix-cache
hits, rejected drafts) as the eager reference computes it."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engramrt.errors import ValidationError
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models.lm import KVCache, LMConfig, ShortConv, TinyLM

from .conftest import TRAIN_ARGS

HC, D = 4, 8


def _conv(kernel: int, dilation: int, seed: int = 0) -> ShortConv:
    conv = ShortConv(HC, D, kernel, dilation, 1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
        conv.norm_weight.copy_(1 + 0.5 * torch.randn(conv.norm_weight.shape, generator=g))
    return conv


def _history(y: torch.Tensor, start: int, context: int) -> torch.Tensor:
    """``y``'s ``context`` positions before ``start``, zeros before position 0."""
    history = y.new_zeros((y.shape[0], context, *y.shape[2:]))
    first = max(0, start - context)
    history[:, context - (start - first) :] = y[:, first:start]
    return history


@settings(max_examples=40, deadline=None)
@given(
    kernel=st.integers(1, 5),
    dilation=st.integers(1, 4),
    cuts=st.lists(st.integers(1, 23), max_size=5),
    seed=st.integers(0, 2**16),
)
def test_chunks_with_their_history_equal_the_whole_sequence(kernel, dilation, cuts, seed):
    conv = _conv(kernel, dilation, seed)
    y = torch.randn((2, 24, HC, D), generator=torch.Generator().manual_seed(seed + 1))
    whole = conv(y)
    bounds = [0, *sorted(set(cuts)), 24]
    with torch.no_grad():
        parts = [
            conv(y[:, a:b], _history(y, a, conv.context)) for a, b in itertools.pairwise(bounds)
        ]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=0)


def test_a_history_of_the_wrong_length_is_refused() -> None:
    conv = _conv(4, 2)
    with pytest.raises(
        ValidationError,
        match=r"history has shape \(1, 5, 4, 8\); expected "
        r"\(1, 6, 4, 8\), y's 6 earlier positions \(kernel 4, dilation 2\)",
    ):
        conv(torch.zeros((1, 3, HC, D)), torch.zeros((1, 5, HC, D)))


def test_the_taps_read_the_positions_they_name() -> None:
    """One tap at a time: tap ``j`` of ``kernel`` moves position ``t - (kernel-1-j) *
    dilation`` to ``t``; a later position never reaches an earlier one."""
    kernel, dilation = 3, 2
    y = torch.randn((1, 12, HC, D), generator=torch.Generator().manual_seed(5))
    normed = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + 1e-6)
    for tap in range(kernel):
        conv = ShortConv(HC, D, kernel, dilation, 1e-6)
        with torch.no_grad():
            conv.weight[tap] = 1.0
        shift = (kernel - 1 - tap) * dilation
        expected = torch.zeros_like(y)
        expected[:, shift:] = normed[:, : 12 - shift]
        torch.testing.assert_close(conv(y), torch.nn.functional.silu(expected))
    # A change at the last position leaves every earlier output as it was.
    conv = _conv(kernel, dilation)
    later = y.clone()
    later[:, -1] += 1.0
    with torch.no_grad():
        assert torch.equal(conv(later)[:, :-1], conv(y)[:, :-1])
        assert not torch.equal(conv(later)[:, -1], conv(y)[:, -1])


def _config(**fields: int) -> LMConfig:
    shape = {"engram_cols": 6, "engram_head_dim": 4, **fields}
    return LMConfig(
        vocab_size=50, dim=D, n_blocks=2, n_heads=2, n_kv_heads=1, head_dim=4, mlp_dim=16,
        hc_mult=HC, max_seq_len=32, engram_layer_ids=(1,), **shape,
    )  # fmt: skip


def test_a_new_convolution_leaves_the_model_as_without() -> None:
    """Its taps start at zero: the model's logits are those of the same weights without
    the convolution; with taps, they are not (the control)."""
    plain, with_conv = TinyLM(_config()), TinyLM(_config(engram_conv_kernel=4))
    missing = with_conv.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["layers.1.engram.conv.norm_weight", "layers.1.engram.conv.weight"]
    table = torch.randn((40, 4), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 40, (18, 6), generator=torch.Generator().manual_seed(4))

    def logits(model: TinyLM) -> torch.Tensor:
        head = model.engram_head(1)
        return model(tokens, engram={1: lambda streams: head(streams, table[ids])})

    with torch.no_grad():
        with_conv.engram_head(1).wkv.weight.normal_()  # the memory must matter
        plain.engram_head(1).wkv.weight.copy_(with_conv.engram_head(1).wkv.weight)
        assert torch.equal(logits(with_conv), logits(plain))
    # The taps at zero still learn: SiLU's slope at 0 is 1/2.
    logits(with_conv).square().mean().backward()
    conv = with_conv.engram_head(1).conv
    assert conv.weight.grad is not None and bool(conv.weight.grad.abs().sum() > 0)
    with torch.no_grad():
        conv.weight.normal_()
        assert not torch.allclose(logits(with_conv), logits(plain))


def test_summed_heads_serve_as_the_projection_of_every_column() -> None:
    """A head that sums each order's heads' rows computes what a plain head with
    :meth:`served_wkv` computes over the separate rows (float sums in another order);
    the served weight repeats each summed block over its heads."""
    from engramrt_lab.models.lm import TrainEngramHead

    summed = TrainEngramHead(_config(engram_summed_heads=3))
    plain = TrainEngramHead(_config())
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        summed.wkv.weight.copy_(torch.randn(summed.wkv.weight.shape, generator=g))
        plain.wkv.weight.copy_(summed.served_wkv())
    assert summed.wkv.weight.shape == (5 * D, 2 * 4) and plain.wkv.weight.shape == (5 * D, 6 * 4)
    served = summed.served_wkv()
    assert torch.equal(served[:, 4:8], summed.wkv.weight[:, :4])  # head 1 of order 0
    assert torch.equal(served[:, 12:16], summed.wkv.weight[:, 4:])  # head 0 of order 1
    streams = torch.randn((2, 5, HC, D), generator=g)
    rows = torch.randn((10, 6, 4), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(summed(streams, rows), plain(streams, rows))
        other = rows.clone()
        other[:, 1] += 1.0  # the control: another row changes the output
        assert not torch.allclose(summed(streams, other), summed(streams, rows))


def test_config_fields_are_checked_and_written_when_used() -> None:
    assert "engram_conv_kernel" not in _config().to_dict()  # older model.json files unchanged
    config = _config(engram_conv_kernel=4, engram_conv_dilation=3)
    assert LMConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    baseline = config.baseline()
    assert (baseline.engram_conv_kernel, baseline.engram_layer_ids) == (0, ())
    with pytest.raises(ValidationError, match="engram_conv_kernel=-1; expected an integer >= 0"):
        _config(engram_conv_kernel=-1)
    with pytest.raises(ValidationError, match="engram_conv_dilation=0; expected an integer >= 1"):
        _config(engram_conv_kernel=4, engram_conv_dilation=0)
    with pytest.raises(ValidationError, match="engram_conv_kernel=4 without Engram layers"):
        dataclasses.replace(baseline, engram_conv_kernel=4)
    with pytest.raises(ValidationError, match="engram_summed_heads=4 does not divide"):
        _config(engram_summed_heads=4)
    with pytest.raises(ValidationError, match="engram_summed_heads=-1; expected an integer >= 0"):
        _config(engram_summed_heads=-1)
    caches = [KVCache.empty(c, 8, "cpu", torch.float32) for c in (config, _config())]
    assert caches[0].conv is not None and caches[0].conv.shape == (1, 8, HC, D)
    with pytest.raises(ValidationError, match="another short convolution"):
        caches[0].copy_prefix(caches[1], 0)


def test_the_wide_baseline_matches_the_projection_not_the_convolution() -> None:
    """The FLOP-matched width follows the Engram projection's size (narrower with summed
    heads) and is the same with or without a short convolution."""
    from engramrt_lab.models.train import wide_mlp_dim

    plain = _config(engram_cols=12, engram_head_dim=32)
    conv = dataclasses.replace(plain, engram_conv_kernel=4, engram_conv_dilation=4)
    summed = dataclasses.replace(plain, engram_summed_heads=4)
    assert wide_mlp_dim(conv) == wide_mlp_dim(plain) > wide_mlp_dim(summed) > plain.mlp_dim


# -- trained, written, loaded and served ----------------------------------------------

VARIANT_FLAGS = ["--short-conv", "3", "--short-conv-dilation", "2", "--wkv-heads", "summed"]


@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory: pytest.TempPathFactory, tiny_sources) -> Path:
    """The training command with :data:`VARIANT_FLAGS`, 4 steps."""
    from engramrt_lab.models.train import main

    stdlib, site = tiny_sources
    out = tmp_path_factory.mktemp("tiny-lm-conv")
    args = [*TRAIN_ARGS, "--stdlib-root", str(stdlib), "--site-dirs", str(site)]
    assert main(["--out", str(out), *args, *VARIANT_FLAGS]) == 0
    return out


def _served(conv_dir: Path, tmp_path: Path, taps: bool):
    from engramrt_lab.models.serve import load_model

    model = load_model(
        conv_dir, TablePlacement("host", device="cpu"), load_baseline=False,
        head_backend="reference",
    )  # fmt: skip
    torch.manual_seed(3)
    model.lm.reset_parameters(std=0.3, engram_identity=False)  # the memory must matter
    if taps:  # the convolution must matter too
        for block in model.lm_config.engram_layer_ids:
            with torch.no_grad():
                model.lm.engram_head(block).conv.weight.normal_(0.0, 2.0)
    model.load_heads()
    return model


def test_the_trained_directory_records_the_variants(conv_dir: Path) -> None:
    data = json.loads((conv_dir / "model.json").read_text())
    lm = data["lm"]
    assert (lm["engram_conv_kernel"], lm["engram_conv_dilation"]) == (3, 2)
    assert lm["engram_summed_heads"] == 4  # the tiny preset's hash heads per order
    assert "engram_conv_kernel" not in data["baseline_lm"]
    assert (
        "--short-conv 3 --short-conv-dilation 2 --wkv-heads summed" in data["training"]["command"]
    )
    # The wide baseline matches the summed projection (a quarter of the columns).
    plain = dataclasses.replace(LMConfig.from_dict(lm), engram_summed_heads=0)
    from engramrt_lab.models.train import wide_mlp_dim

    assert data["baseline_wide_lm"]["mlp_dim"] == wide_mlp_dim(LMConfig.from_dict(lm))
    assert data["baseline_wide_lm"]["mlp_dim"] < wide_mlp_dim(plain)


def test_serving_computes_what_the_reference_does(conv_dir: Path, tmp_path: Path) -> None:
    """Chunks of 3 with a prefix-cache hit and rejected drafts give the eager reference's
    tokens; the convolution changes the logits of a served step (without it the tokens
    could agree trivially), and a chunk's convolution reads the request's earlier values
    (served logits match the reference's, which they do not with the history dropped)."""
    model = _served(conv_dir, tmp_path, taps=True)
    first = [int(t) for t in model.sample.tokens[0][:11]]
    prompts = [first, first[:9] + [int(t) for t in model.sample.tokens[1][3:7]]]
    served = model.generate(prompts, 5, history="slot", chunk_size=3, block_size=4)
    assert served.prefix_hit_tokens == [0, 8] and served.rejected_drafts == 2
    for prompt, tokens in zip(prompts, served.tokens, strict=True):
        assert model.reference_check(prompt, tokens).tokens == tokens
    without = _served(conv_dir, tmp_path, taps=False)
    reference, _ = model.reference_forward(first)
    assert not torch.allclose(reference, without.reference_forward(first)[0], atol=1e-3)


def test_a_chunk_reads_the_earlier_positions_values(
    conv_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The eager reference in chunks of 5 through a request cache against one forward:
    the convolution moves the logits no further apart than chunking moves them without
    its taps, while a convolution that ignores the cached values (zeros before each
    chunk, the control) moves them ten times further.

    Chunking alone moves logits (up to ~20 here): attention over other shapes
    reassociates fp32 sums (~1e-6 relative), and the heads round their output streams to
    bf16 (a half-ulp of 2^-9 relative), so an input that differs by 1e-6 can round the
    other way; seen: up to 0.035 without the taps. Hence a bound relative to that, three
    times it, never below 1e-2; the control moved logits by 0.8-2.2."""
    tokens: list[int] = []

    def apart(model) -> float:
        whole, whole_gates = model.reference_forward(tokens)
        chunked, chunked_gates = model.reference_forward(tokens, chunk=5)
        assert chunked.shape == whole.shape and chunked_gates.shape == whole_gates.shape
        return float((chunked - whole).abs().max())

    model = _served(conv_dir, tmp_path, taps=True)
    tokens += [int(t) for t in model.sample.tokens[0][:12]]
    bound = max(3 * apart(_served(conv_dir, tmp_path, taps=False)), 1e-2)
    assert apart(model) <= bound
    real = ShortConv.forward
    monkeypatch.setattr(ShortConv, "forward", lambda self, y, history=None: real(self, y))
    assert apart(model) > 10 * bound
    with pytest.raises(ValidationError, match="chunk=0; expected a positive"):
        model.reference_forward(tokens, chunk=0)
    with pytest.raises(ValidationError, match="token_ids is empty"):
        model.reference_forward([])
