"""PLE hash constants and row ids against transformers 5.23.0 (the oracle, the session
fixture ``oracle`` of conftest.py: these tests skip where it is not installed).

Constants are compared with the buffers of ``Qwen4ExpTextNGramEmbedding``; row ids with
the ids that module feeds its ``ngram_embedding`` (a forward hook reads ``args[0]``,
``[B, T, C]``), one-shot and streamed through a ``DynamicCache``. Every invariant has a
negative control that shows the comparison can fail.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple import ids as ids_module
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.ids import (
    PleConstants,
    PleIdContext,
    is_prime,
    layer_multipliers,
    ple_row_ids,
    ple_row_ids_batch_reference,
    ple_row_ids_chunk,
    primes_from,
    splitmix64,
)

LIN, IDX = "linear_attention", "indexed_attention"


def tiny(**changes: object) -> PleConfig:
    """A test-sized config: V = 97, 2 heads per order (C = 4), primes from 50, three PLE
    layers (decoder layers 0, 2, 4) of six, layer 4 (one-indexed) indexed attention."""
    fields: dict[str, object] = {
        "ple_layer_ids": (5, 1, 3),
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 50,
        "vocab_size": 97,
        "eos_token_id": 7,
        "hidden_size": 8,
        "hc_count": 2,
        "num_hidden_layers": 6,
        "layer_types": (LIN, LIN, LIN, IDX, LIN, LIN),
    }
    fields.update(changes)
    return PleConfig(**fields)  # type: ignore[arg-type]


# Configs whose constants are compared with the oracle's buffers: orders 2..4, one to four
# layers, a base that is itself prime (2 counts), a divisor that pads, seeds 0, negative
# and past 2**64, V = 1 (the largest multiplier bound).
CONSTANT_CONFIGS = {
    "tiny": tiny(),
    "bigram": tiny(ngram_size=2, heads_per_ngram=1, ngram_vocab_size_base=2, seed=0),
    "order4": tiny(
        ngram_size=4,
        heads_per_ngram=3,
        hidden_size=18,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=7,
        seed=-7,
    ),
    "four_layers": tiny(
        ple_layer_ids=(1, 2, 3, 5), vocab_size=1, seed=2**64 + 5, ngram_vocab_size_base=10_007
    ),
}


def oracle_config(oracle: ModuleType, cfg: PleConfig, **overrides: object) -> Any:
    """The oracle's ``Qwen4ExpTextConfig`` of ``cfg`` (with ``overrides``)."""
    fields = cfg.to_hf_dict()
    del fields["model_type"]
    fields.update(overrides)
    return oracle.Qwen4ExpTextConfig(**fields)


@dataclass
class OracleEmbeddings:
    """One ``Qwen4ExpTextNGramEmbedding`` per PLE layer and the row ids they gather."""

    oracle: ModuleType
    config: Any
    layers: list[torch.nn.Module]
    captured: list[torch.Tensor]

    @classmethod
    def build(cls, oracle: ModuleType, cfg: PleConfig, **overrides: object) -> OracleEmbeddings:
        hf_config = oracle_config(oracle, cfg, **overrides)
        captured: list[torch.Tensor] = []
        layers = []
        for ple_index, decoder_layer in enumerate(cfg.decoder_layer_indices):
            module = oracle.Qwen4ExpTextNGramEmbedding(
                hf_config,
                embedding_dim=cfg.embed_dim,
                layer_idx=decoder_layer,
                ple_layer_index=ple_index,
            )
            module.ngram_embedding.register_forward_hook(
                lambda _m, args, _out: captured.append(args[0].clone())
            )
            layers.append(module)
        return cls(oracle, hf_config, layers, captured)

    @torch.no_grad()
    def row_ids(self, token_ids: torch.Tensor, cache: Any = None) -> np.ndarray:
        """``[B, T, L, C]`` row ids of ``token_ids [B, T]`` (one chunk when ``cache``)."""
        self.captured.clear()
        for module in self.layers:
            module(token_ids, cache)
        return torch.stack(self.captured, dim=2).numpy()


@pytest.fixture(scope="module")
def cfg() -> PleConfig:
    return tiny()


@pytest.fixture(scope="module")
def consts(cfg: PleConfig) -> PleConstants:
    return PleConstants.from_config(cfg)


@pytest.fixture(scope="module")
def embeddings(oracle: ModuleType, cfg: PleConfig) -> OracleEmbeddings:
    return OracleEmbeddings.build(oracle, cfg)


def random_ids(
    rng: np.random.Generator, length: int, cfg: PleConfig, eos_rate: float
) -> np.ndarray:
    """Raw ids in ``[0, V)`` with EOS sprinkled in at about ``eos_rate``."""
    ids = rng.integers(0, cfg.vocab_size, size=length)
    ids[rng.random(length) < eos_rate] = cfg.eos
    return ids


# -- constants ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONSTANT_CONFIGS))
def test_constants_equal_the_oracle_buffers(name: str, oracle: ModuleType) -> None:
    cfg = CONSTANT_CONFIGS[name]
    consts = PleConstants.from_config(cfg)
    embeddings = OracleEmbeddings.build(oracle, cfg)
    assert consts.multipliers.shape == (cfg.n_layers, cfg.ngram_size)
    assert consts.head_sizes.shape == consts.offsets.shape == (cfg.n_layers, cfg.n_cols)
    for layer, module in enumerate(embeddings.layers):
        np.testing.assert_array_equal(consts.multipliers[layer], module.layer_multipliers.numpy())
        np.testing.assert_array_equal(
            consts.head_sizes[layer], module.ngram_heads_vocab_sizes.numpy()
        )
        np.testing.assert_array_equal(consts.offsets[layer], module.ngram_heads_offsets.numpy())
        assert consts.table_rows[layer] == module.ngram_embedding.num_embeddings
        assert consts.addressed_rows[layer] == module.total_vocab_size
        assert cfg.table_width == module.ngram_embedding.embedding_dim
    assert all(consts.multipliers.ravel() % 2 == 1)
    assert len(set(consts.head_sizes.ravel().tolist())) == consts.head_sizes.size


def test_default_constants_are_those_spec_quotes() -> None:
    cfg = PleConfig(ple_layer_ids=(1, 2), eos_token_id=248_044)  # 40 layers, every 4th indexed
    consts = PleConstants.from_config(cfg)
    np.testing.assert_array_equal(
        consts.multipliers,
        [
            [23703573157769, 20109073645365, 8052911324071],
            [3352040966061, 19752442147475, 10742103100073],
        ],
    )
    assert consts.head_sizes[0, 0] == 20_000_003 and consts.head_sizes[0, -1] == 20_000_171
    assert consts.head_sizes[1, 0] == 20_000_213 and consts.head_sizes[1, -1] == 20_000_429
    assert consts.addressed_rows == (320_001_446, 320_005_046)
    assert consts.table_rows == (320_001_536, 320_005_120)
    # The table of the real model: 160 bf16 values a row is 95.4 GiB (docs/families.md §1).
    assert round(consts.table_rows[0] * 160 * 2 / 2**30, 1) == 95.4


def test_default_constants_equal_the_oracle_functions(oracle: ModuleType) -> None:
    """At real sizes the oracle module would allocate a 320M-row table: its functions are
    called directly instead (its trial division walks the 32 primes one at a time)."""
    consts = PleConstants.from_config(PleConfig(ple_layer_ids=(1, 2), eos_token_id=1))
    for layer in range(2):
        expected = oracle._build_layer_multipliers(248_320, 3, layer, 1234).numpy()
        np.testing.assert_array_equal(consts.multipliers[layer], expected)
    prime, oracle_primes = 20_000_000 - 1, []
    for _ in range(32):
        prime = oracle._find_nth_prime_after(prime, 1)
        oracle_primes.append(prime)
    assert consts.head_sizes.ravel().tolist() == oracle_primes
    assert oracle._find_nth_prime_after(20_000_000 - 1, 32) == oracle_primes[-1]


def test_splitmix64_and_multipliers_from_their_definition(oracle: ModuleType) -> None:
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output of seed 0
    assert [splitmix64(v) for v in (1, 2**64 - 1)] == [
        oracle._splitmix64(1),
        oracle._splitmix64(2**64 - 1),
    ]
    v = 248_320
    half = ((2**63 - 1) // v) // 2
    assert half == 18_571_544_855_136
    for m in layer_multipliers(v, 5, 3, 99):
        assert m % 2 == 1 and m <= 2 * half - 1 and (v - 1) * m < 2**63


def test_is_prime_is_exact() -> None:
    sieve = np.ones(20_000, dtype=bool)
    sieve[:2] = False
    for p in range(2, math.isqrt(sieve.size) + 1):
        sieve[p * p :: p] = False
    assert [n for n in range(sieve.size) if is_prime(n)] == np.flatnonzero(sieve).tolist()
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59) and is_prime(20_000_003)
    # Strong pseudoprimes to the bases 2..23 and a Carmichael number: composite.
    assert not is_prime(3_825_123_056_546_413_051) and not is_prime(561)
    assert not is_prime(3_215_031_751) and not is_prime((2**31 - 1) * (2**31 + 11))
    with pytest.raises(ValueError, match="exact only below"):
        is_prime(318_665_857_834_031_151_167_461)
    assert primes_from(20_000_000, 2) == [20_000_003, 20_000_023]
    assert primes_from(13, 3) == [13, 17, 19]  # the start counts when it is prime


def test_ple_off_gives_empty_constants() -> None:
    consts = PleConstants.from_config(tiny(ple_layer_ids=(), eos_token_id=None))
    assert consts.multipliers.shape == (0, 3) and consts.head_sizes.shape == (0, 4)
    assert consts.table_rows == () and consts.n_layers == 0
    assert ple_row_ids([1, 2, 3], consts, 7).shape == (3, 0, 4)


def test_constants_are_read_only(consts: PleConstants) -> None:
    with pytest.raises(ValueError, match="read-only"):
        consts.multipliers[0, 0] = 1
    packed = consts.packed()
    assert packed.dtype == torch.int64 and packed.shape == (3, 3 + 2 * 4)
    np.testing.assert_array_equal(packed[:, 3:7].numpy(), consts.head_sizes)


def test_control_wrong_multiplier_order_or_layer_changes_constants(
    consts: PleConstants, oracle: ModuleType
) -> None:
    cfg = tiny()
    embeddings = OracleEmbeddings.build(oracle, cfg)
    reordered = consts.multipliers[0][::-1]
    assert not np.array_equal(reordered, embeddings.layers[0].layer_multipliers.numpy())
    other_layer = layer_multipliers(cfg.vocab_size, 3, 1, cfg.seed)
    assert not np.array_equal(other_layer, embeddings.layers[0].layer_multipliers.numpy())
    # Primes counted from `base` (not strictly after it) differ at a prime base.
    assert primes_from(53, 1) != [oracle._find_nth_prime_after(53, 1)]


# -- row ids, one shot --------------------------------------------------------------------


def batch_rows(token_rows: Sequence[np.ndarray], consts: PleConstants, eos: int) -> np.ndarray:
    return np.stack([ple_row_ids(row, consts, eos) for row in token_rows])


def one_shot_cases(cfg: PleConfig) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(2026)
    eos = cfg.eos
    yield "random_with_eos", np.stack([random_ids(rng, 40, cfg, 0.15) for _ in range(3)])
    yield "eos_runs", np.array([[4, eos, eos, eos, 9, 9, eos, 3, eos, eos, 1, 2, 3, 4]])
    yield "eos_at_start", np.array([[eos, 5, 6, eos, 8, 1, 1, 1], [eos, eos, 2, 3, 4, 5, 6, 7]])
    yield "no_eos", np.stack([random_ids(rng, 25, cfg, 0.0) for _ in range(2)])
    yield "one_token", np.array([[eos], [3]])


@pytest.mark.parametrize("case", [name for name, _ in one_shot_cases(tiny())])
def test_row_ids_equal_the_oracle_one_shot(
    case: str, cfg: PleConfig, consts: PleConstants, embeddings: OracleEmbeddings
) -> None:
    tokens = dict(one_shot_cases(cfg))[case]
    ours = batch_rows(tokens, consts, cfg.eos)
    expected = embeddings.row_ids(torch.from_numpy(tokens))
    assert ours.dtype == np.int64 and ours.shape == (*tokens.shape, 3, 4)
    np.testing.assert_array_equal(ours, expected)
    assert (ours < np.array(consts.addressed_rows)[None, None, :, None]).all()


def test_eos_list_uses_element_zero_only(oracle: ModuleType) -> None:
    """``eos_token_id = [7, 11]``: 7 is the PLE EOS, 11 an ordinary token."""
    cfg = tiny(eos_token_id=[7, 11])
    assert cfg.eos == 7
    consts = PleConstants.from_config(cfg)
    embeddings = OracleEmbeddings.build(oracle, cfg, eos_token_id=[7, 11])
    tokens = np.array([[1, 11, 2, 3, 11, 11, 4, 7, 5, 6, 11, 7, 7, 8]])
    ours = batch_rows(tokens, consts, cfg.eos)
    np.testing.assert_array_equal(ours, embeddings.row_ids(torch.from_numpy(tokens)))
    # Control: treating 11 as the EOS changes the ids.
    assert not np.array_equal(batch_rows(tokens, consts, 11), ours)


def test_eos_at_or_past_the_vocabulary_wraps_like_the_oracle(oracle: ModuleType) -> None:
    """EOS = V + 100000 (transformers' own tests): its products overflow int64 and some
    mixes are negative, so only wrapping products and a floor modulo match."""
    cfg = tiny(eos_token_id=97 + 100_000)
    consts = PleConstants.from_config(cfg)
    embeddings = OracleEmbeddings.build(oracle, cfg)
    rng = np.random.default_rng(5)
    tokens = np.stack([random_ids(rng, 30, cfg, 0.2) for _ in range(2)])
    ours = batch_rows(tokens, consts, cfg.eos)
    np.testing.assert_array_equal(ours, embeddings.row_ids(torch.from_numpy(tokens)))
    # Control: the data does reach negative mixes (a truncating modulo would differ).
    products = (np.uint64(cfg.eos) * consts.multipliers.astype(np.uint64)).view(np.int64)
    assert (products < 0).any()
    mixes = np.bitwise_xor(products[:, 0], products[:, 1])
    assert (np.fmod(mixes, consts.head_sizes[:, 0]) != np.mod(mixes, consts.head_sizes[:, 0])).any()


def _walk_back_without_blocking(
    history: np.ndarray, n_context: int, ngram_size: int, eos: int
) -> np.ndarray:
    """The EOS rule dropped: every shift reads the raw token."""
    idx = np.arange(n_context, history.shape[0])[:, None] - np.arange(ngram_size)[None, :]
    return history[idx]


def test_control_dropping_the_eos_rule_or_reordering_multipliers_fails(
    cfg: PleConfig,
    consts: PleConstants,
    embeddings: OracleEmbeddings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = dict(one_shot_cases(cfg))["eos_runs"]
    expected = embeddings.row_ids(torch.from_numpy(tokens))
    reversed_consts = replace(consts, multipliers=consts.multipliers[:, ::-1].copy())
    assert not np.array_equal(batch_rows(tokens, reversed_consts, cfg.eos), expected)
    with monkeypatch.context() as patch:
        patch.setattr(ids_module, "_walk_back", _walk_back_without_blocking)
        assert not np.array_equal(batch_rows(tokens, consts, cfg.eos), expected)
    np.testing.assert_array_equal(batch_rows(tokens, consts, cfg.eos), expected)


def test_row_ids_refuse_a_batch_shape(consts: PleConstants) -> None:
    with pytest.raises(ValidationError, match=r"token_ids has shape \[2, 3\]"):
        ple_row_ids(np.zeros((2, 3), dtype=np.int64), consts, 7)
    with pytest.raises(ValidationError, match="context has 1 ids; expected ngram_size - 1 = 2"):
        ple_row_ids_chunk([1, 2], PleIdContext((7,)), consts, 7)


# -- streaming ----------------------------------------------------------------------------


def tokens_of(cfg: PleConfig) -> st.SearchStrategy[int]:
    """A raw id in ``[0, V)``, EOS about half the time (so runs of EOS are common)."""
    return st.one_of(st.integers(0, cfg.vocab_size - 1), st.just(cfg.eos))


def token_lists(cfg: PleConfig, max_size: int = 30) -> st.SearchStrategy[list[int]]:
    return st.lists(tokens_of(cfg), max_size=max_size)


def chunk_sizes(total: int, sizes: Sequence[int]) -> list[int]:
    """Chunks of the drawn sizes (zeros kept) while they fit, then one-token decode."""
    chunks, used = [], 0
    for size in sizes:
        size = min(size, total - used)
        chunks.append(size)
        used += size
    return chunks + [1] * (total - used)


def stream(
    tokens: np.ndarray, chunks: Sequence[int], consts: PleConstants, eos: int
) -> tuple[np.ndarray, PleIdContext]:
    context, parts, at = PleIdContext.start(consts.ngram_size, eos), [], 0
    for size in chunks:
        rows, context = ple_row_ids_chunk(tokens[at : at + size], context, consts, eos)
        assert rows.shape == (size, consts.n_layers, consts.n_cols)
        parts.append(rows)
        at += size
    empty = np.empty((0, consts.n_layers, consts.n_cols), dtype=np.int64)
    return np.concatenate([empty, *parts]), context


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_streaming_equals_one_shot_and_the_oracle_cache(
    data: st.DataObject, cfg: PleConfig, consts: PleConstants, embeddings: OracleEmbeddings
) -> None:
    tokens = np.array(data.draw(token_lists(cfg), label="tokens"), dtype=np.int64)
    sizes = data.draw(st.lists(st.integers(0, 6), max_size=8), label="sizes")
    chunks = chunk_sizes(tokens.size, sizes)
    streamed, context = stream(tokens, chunks, consts, cfg.eos)
    np.testing.assert_array_equal(streamed, ple_row_ids(tokens, consts, cfg.eos))
    assert context == PleIdContext.from_history(tokens.tolist(), 3, cfg.eos)

    cache, at = embeddings.oracle.DynamicCache(config=embeddings.config), 0
    for size in chunks:
        chunk = torch.from_numpy(tokens[at : at + size])[None]
        expected = embeddings.row_ids(chunk, cache)
        # The oracle returns its whole [ctx ++ chunk] rows for an empty chunk (it slices
        # [-0:]); only its cache update is meaningful there, which later chunks check.
        if size:
            np.testing.assert_array_equal(streamed[at : at + size], expected[0])
        at += size
    for decoder_layer in cfg.decoder_layer_indices:
        state = cache.get_conv_state(decoder_layer, state_idx=2)
        if state is not None:
            assert tuple(state[0].tolist()) == context.token_ids


def test_control_a_context_not_carried_gives_other_ids(
    cfg: PleConfig, consts: PleConstants
) -> None:
    tokens = np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int64)
    whole = ple_row_ids(tokens, consts, cfg.eos)
    start = PleIdContext.start(3, cfg.eos)
    first, context = ple_row_ids_chunk(tokens[:4], start, consts, cfg.eos)
    second, _ = ple_row_ids_chunk(tokens[4:], context, consts, cfg.eos)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    restarted, _ = ple_row_ids_chunk(tokens[4:], start, consts, cfg.eos)
    assert not np.array_equal(np.concatenate([first, restarted]), whole)


def test_context_rules() -> None:
    start = PleIdContext.start(3, 7)
    assert start.token_ids == (7, 7)
    assert start.advance([]) == start
    assert start.advance([1]).token_ids == (7, 1)
    assert start.advance([1, 2, 3]).advance([4]).token_ids == (3, 4)
    assert PleIdContext.from_history([1, 7, 2, 3, 4], 4, 7).token_ids == (2, 3, 4)


# -- the batched torch reference ----------------------------------------------------------


@st.composite
def flat_batches(draw: st.DrawFn, cfg: PleConfig) -> tuple[list[list[int]], list[list[int]], int]:
    """Requests' chunks (empty ones included), their carried contexts (EOS inside some)
    and a number of padding rows after the last request."""
    n_req = draw(st.integers(0, 5))
    chunks = [draw(token_lists(cfg, max_size=9)) for _ in range(n_req)]
    contexts = [draw(st.lists(tokens_of(cfg), min_size=2, max_size=2)) for _ in chunks]
    return chunks, contexts, draw(st.integers(0, 3))


def run_batch(
    chunks: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    padding: int,
    consts: PleConstants,
    eos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = [t for chunk in chunks for t in chunk] + [eos + 1] * padding
    qsl = np.cumsum([0, *(len(c) for c in chunks)])
    return ple_row_ids_batch_reference(
        torch.tensor(flat, dtype=torch.int64),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int64).reshape(len(chunks), 2),
        consts,
        eos,
    )


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_batch_reference_equals_the_per_request_reference(
    data: st.DataObject, cfg: PleConfig, consts: PleConstants
) -> None:
    chunks, contexts, padding = data.draw(flat_batches(cfg))
    rows, next_contexts = run_batch(chunks, contexts, padding, consts, cfg.eos)
    expected, expected_next = [], []
    for chunk, context in zip(chunks, contexts, strict=True):
        chunk_rows, after = ple_row_ids_chunk(chunk, PleIdContext(tuple(context)), consts, cfg.eos)
        expected.append(chunk_rows)
        expected_next.append(after.token_ids)
    # A padding row hashes as a request's first token.
    expected.extend(ple_row_ids([cfg.eos + 1], consts, cfg.eos) for _ in range(padding))
    empty = np.empty((0, 3, 4), dtype=np.int64)
    np.testing.assert_array_equal(rows.numpy(), np.concatenate([empty, *expected]))
    assert next_contexts.dtype == torch.int64
    assert next_contexts.tolist() == [list(c) for c in expected_next]


def test_batch_reference_equals_the_oracle(
    cfg: PleConfig, consts: PleConstants, embeddings: OracleEmbeddings
) -> None:
    """Three requests from their starts, in one flat batch, against the oracle one by one."""
    rng = np.random.default_rng(11)
    requests = [random_ids(rng, n, cfg, 0.2) for n in (13, 1, 22)]
    start = [[cfg.eos] * 2] * 3
    rows, _ = run_batch([r.tolist() for r in requests], start, 0, consts, cfg.eos)
    expected = [embeddings.row_ids(torch.from_numpy(r)[None])[0] for r in requests]
    np.testing.assert_array_equal(rows.numpy(), np.concatenate(expected))


def test_control_contexts_swapped_between_requests_change_ids(
    cfg: PleConfig, consts: PleConstants
) -> None:
    chunks, contexts = [[1, 2, 3], [4, 5]], [[10, 11], [12, 13]]
    rows, _ = run_batch(chunks, contexts, 0, consts, cfg.eos)
    swapped, _ = run_batch(chunks, contexts[::-1], 0, consts, cfg.eos)
    assert not torch.equal(rows, swapped)


def test_batch_reference_refuses_bad_boundaries(consts: PleConstants) -> None:
    ids, ctx = torch.arange(4), torch.full((2, 2), 7)
    with pytest.raises(ValidationError, match=r"query_start_loc=\[0, 3, 2\]"):
        ple_row_ids_batch_reference(ids, torch.tensor([0, 3, 2]), ctx, consts, 7)
    with pytest.raises(ValidationError, match=r"query_start_loc=\[0, 3, 5\]"):
        ple_row_ids_batch_reference(ids, torch.tensor([0, 3, 5]), ctx, consts, 7)
    with pytest.raises(ValidationError, match=r"context_token_ids has shape \[2, 3\]"):
        ple_row_ids_batch_reference(ids, torch.tensor([0, 3, 4]), torch.zeros(2, 3), consts, 7)
