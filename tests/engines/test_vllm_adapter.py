"""``from_vllm_step`` against vLLM 0.33.0's own classes and its own Engram hasher.

The step metadata comes from vLLM's real ``BlockTable`` (its slot-mapping
kernel), ``CpuGpuBuffer`` and ``CommonAttentionMetadata``; the second oracle
is vLLM's ``NgramHashState.forward`` (its cache-write and hash kernels), run
with the tiny preset's constants. On a CPU machine both run under Triton's
interpreter (TRITON_INTERPRET=1).

Environment (CPU torch; vLLM without its dependencies, plus only what
importing these classes and the Engram module needs):

    pip install torch==2.13.0 triton==3.6.0
    pip install vllm==0.33.0 --no-deps
    pip install -c constraints.txt  # constraints.txt: torch==2.13.0 and numpy<2.4
        packaging uvloop py-cpuinfo psutil requests regex pyzmq numpy pydantic
        cbor2 transformers aiohttp openai-harmony openai pillow pybase64
        cachetools msgspec cloudpickle prometheus_client xgrammar fastapi
        partial_json_parser llguidance einops
    pip install -c constraints.txt -e . pytest hypothesis
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # vLLM turns Triton off unless exactly one GPU driver is active, except in a
    # distributed worker whose visible-device list is empty: be one, so its kernels
    # are real Triton functions that the interpreter runs.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
vllm_engram = pytest.importorskip(
    "vllm.models.deepseek_v41.common.engram",
    reason="vllm==0.33.0 is not importable (see this module's docstring for its environment)",
)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("vLLM's Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import vllm.v1.utils as vllm_utils  # noqa: E402
from vllm.models.deepseek_v41.common.mm_preprocess import IMAGE_SENTINEL_BASE_ID  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker.block_table import BlockTable, ComputeSlotMappingKernel  # noqa: E402

from engramrt.adapters import from_vllm_step, vllm_slot_cache  # noqa: E402
from engramrt.config import PRESETS  # noqa: E402
from engramrt.errors import ValidationError  # noqa: E402
from engramrt.hashing import HashConstants, NgramHasher, hash_sequence  # noqa: E402
from engramrt.tokenmap import TokenMap  # noqa: E402

N = 4  # max_ngram_size of the tiny preset
BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_REQS = 8
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch) -> None:
    """CpuGpuBuffer pins its host side when vLLM sees a GPU; on a CPU machine it cannot."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(vllm_utils, "PIN_MEMORY", False)


@functools.cache
def _token_map() -> TokenMap:
    return TokenMap.from_tokenizer_file()


@functools.cache
def _consts() -> HashConstants:
    return HashConstants.from_config(PRESETS["tiny"], _token_map())


def _hasher() -> NgramHasher:
    return NgramHasher.from_config(PRESETS["tiny"], _token_map(), DEVICE)


def _vllm_hash_state() -> torch.nn.Module:
    """vLLM's ``NgramHashState`` (V1 runner: slot cache on) with the tiny preset's constants.

    Built around ``__init__`` (which loads a checkpoint's tokenizer through a
    ``VllmConfig``); ``forward`` is vLLM's own, unchanged.
    """
    consts = _consts()
    state = vllm_engram.NgramHashState.__new__(vllm_engram.NgramHashState)
    torch.nn.Module.__init__(state)
    layers, cols = consts.col_primes.shape
    state.block_size = BLOCK_SIZE
    state.lookback_depth = N - 1
    state.use_slot_cache = True
    state.pad_id = consts.pad_id
    state._cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.int32, device=DEVICE)
    token_map = torch.from_numpy(_token_map().map.astype(np.int32)).to(DEVICE)
    state.register_buffer("token_map", token_map, persistent=False)
    primes = torch.from_numpy(consts.col_primes.reshape(layers, N - 1, cols // (N - 1)))
    state.register_buffer("primes", primes.to(DEVICE), persistent=False)
    state.register_buffer("offsets", torch.from_numpy(consts.offsets).to(DEVICE), persistent=False)
    multipliers = torch.from_numpy(consts.multipliers).to(DEVICE)
    state.register_buffer("multipliers", multipliers, persistent=False)
    return state


def _block_table(dcp_world_size: int = 1) -> BlockTable:
    table = BlockTable(
        BLOCK_SIZE,
        MAX_REQS,
        8,
        64,
        pin_memory=False,
        device=DEVICE,
        cp_kv_cache_interleave_size=1,
    )
    table.dcp_world_size, table.dcp_rank = dcp_world_size, 0
    return table


def _compute_slot_mapping(
    table: BlockTable, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``BlockTable.compute_slot_mapping``: its kernel, launched as its launcher does (the
    launcher's argument inspection does not run under the interpreter)."""
    ComputeSlotMappingKernel.kernel[(num_reqs + 1,)](
        positions.shape[0],
        table.max_num_batched_tokens,
        query_start_loc,
        positions,
        table.block_table.gpu,
        table.block_table.gpu.stride(0),
        table.slot_mapping.gpu,
        KV_CACHE_BLOCK_SIZE=table.block_size,
        TOTAL_CP_WORLD_SIZE=table.dcp_world_size,
        TOTAL_CP_RANK=table.dcp_rank,
        CP_KV_CACHE_INTERLEAVE_SIZE=table.cp_kv_cache_interleave_size,
        PAD_ID=-1,
        BLOCK_SIZE=ComputeSlotMappingKernel.triton_block_size,
    )
    return table.slot_mapping.gpu


@dataclass
class Step:
    """One runner step as vLLM holds it: its metadata and the persistent input buffers."""

    meta: CommonAttentionMetadata
    input_ids: torch.Tensor  # [T_pad]
    positions: torch.Tensor  # [T_pad]
    lookback: CpuGpuBuffer  # [max_num_reqs, N-1]
    num_reqs: int  # unpadded
    num_tokens: int  # unpadded

    def adapter_args(self) -> dict:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "query_start_loc": self.meta.query_start_loc,
            "slot_mapping": self.meta.slot_mapping,
            "block_table": self.meta.block_table_tensor,
            "block_size": BLOCK_SIZE,
        }


def _step(
    table: BlockTable,
    rows: list[tuple[int, list[int], list[int]]],
    *,
    pad_requests: int = 0,
    pad_tokens: int = 0,
    uniform_padding: bool = False,
    req_idx: list[int] | None = None,
) -> Step:
    """A step of ``rows`` (block-table row, positions, token ids), padded for a CUDA graph.

    Padded requests repeat the last boundary, or (``uniform_padding``) each own
    one padding token, as a uniform-decode graph pads them. The metadata's
    ``num_reqs`` / ``num_actual_tokens`` are padded, as vLLM builds them for a
    captured graph size.
    """
    num_reqs, num_tokens = len(rows), sum(len(p) for _, p, _ in rows)
    r_pad, t_pad = num_reqs + pad_requests, num_tokens + pad_tokens
    ids = np.full(t_pad, 7, dtype=np.int64)  # stale values in the padding
    positions = np.full(t_pad, 3, dtype=np.int64)
    qsl = [0]
    for row, (table_row, pos, tokens) in enumerate(rows):
        assert table_row == row or req_idx is not None
        ids[qsl[-1] : qsl[-1] + len(pos)] = tokens
        positions[qsl[-1] : qsl[-1] + len(pos)] = pos
        qsl.append(qsl[-1] + len(pos))
    for _ in range(pad_requests):
        qsl.append(min(qsl[-1] + 1, t_pad) if uniform_padding else qsl[-1])
    query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
    positions_t = torch.from_numpy(positions).to(DEVICE)
    table.commit_block_table(MAX_REQS)
    slots = _compute_slot_mapping(
        table, num_reqs, query_start_loc[: num_reqs + 1], positions_t[:num_tokens]
    )
    lookback = CpuGpuBuffer(MAX_REQS, N - 1, dtype=torch.int32, device=DEVICE, pin_memory=False)
    lookback.np.fill(-1)
    meta = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.cpu(),
        seq_lens=torch.zeros(r_pad, dtype=torch.int32, device=DEVICE),
        num_reqs=r_pad,
        num_actual_tokens=t_pad,
        max_query_len=max(len(p) for _, p, _ in rows),
        max_seq_len=int(positions.max()) + 1,
        block_table_tensor=table.get_device_tensor(r_pad),
        slot_mapping=slots[:t_pad],
        req_idx=None if req_idx is None else np.array(req_idx),
    )
    return Step(meta, torch.from_numpy(ids).to(DEVICE), positions_t, lookback, num_reqs, num_tokens)


def _vllm_ids(
    state: torch.nn.Module,
    step: Step,
    lookback: torch.Tensor | None = None,
    image_mask: torch.Tensor | None = None,
) -> np.ndarray:
    """vLLM's own ids of a step, the way its DeepSeek-V4.1 model calls its hasher."""
    if lookback is None:
        lookback = step.input_ids.new_full((step.meta.num_reqs, N - 1), -1)
    if image_mask is None:
        image_mask = torch.zeros_like(step.input_ids, dtype=torch.bool)
    ids = state(
        step.input_ids,
        step.positions,
        step.meta.query_start_loc,
        image_mask,
        lookback,
        lookback == IMAGE_SENTINEL_BASE_ID,
        step.meta.slot_mapping,
        step.meta.block_table_tensor,
    )
    return ids.cpu().numpy().astype(np.int64)


def _one_shot(tokens: list[int]) -> np.ndarray:
    return hash_sequence(_token_map().compress(np.array(tokens)), _consts())


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 120_000, n).tolist()


# Padded and unpadded counts ------------------------------------------------------


def test_padded_metadata_counts_and_unpadded_arguments() -> None:
    """A uniform-decode graph step: 2 real decodes padded to 4 requests of one token.

    ``CommonAttentionMetadata.num_reqs`` / ``.num_actual_tokens`` hold the
    padded 4 / 4; the adapter takes the unpadded counts under names that say
    so, and its ids and cache writes match vLLM's hasher on the real rows.
    """
    table = _block_table()
    tokens = [_tokens(6, seed) for seed in (1, 2)]
    table.add_row([3, 5], 0)
    table.add_row([9, 2], 1)
    state, cache, hasher = (
        _vllm_hash_state(),
        vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE),
        _hasher(),
    )
    prefill = _step(table, [(0, list(range(5)), tokens[0][:5]), (1, list(range(5)), tokens[1][:5])])
    _vllm_ids(state, prefill)
    hasher(from_vllm_step(**prefill.adapter_args()), cache)
    decode = _step(
        table,
        [(0, [5], tokens[0][5:]), (1, [5], tokens[1][5:])],
        pad_requests=2,
        pad_tokens=2,
        uniform_padding=True,
    )
    assert (decode.meta.num_reqs, decode.meta.num_actual_tokens) == (4, 4)  # padded
    batch = from_vllm_step(
        **decode.adapter_args(),
        num_reqs_unpadded=decode.num_reqs,
        num_tokens_unpadded=decode.num_tokens,
        cache=cache,
    )
    ours = hasher(batch, cache).cpu().numpy()
    theirs = _vllm_ids(state, decode)
    assert np.array_equal(ours[:2], theirs[:2])
    assert np.array_equal(ours[0], _one_shot(tokens[0])[5])
    assert np.array_equal(ours[1], _one_shot(tokens[1])[5])
    assert batch.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # padded requests own nothing
    # Control: the metadata's padded counts are not the unpadded ones: taken as such,
    # the padded requests become real and own the padding tokens.
    padded = from_vllm_step(
        **decode.adapter_args(),
        num_reqs_unpadded=decode.meta.num_reqs,
        num_tokens_unpadded=decode.meta.num_actual_tokens,
    )
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_ambiguous_count_names_are_deprecated() -> None:
    table = _block_table()
    table.add_row([3], 0)
    step = _step(table, [(0, [0, 1], _tokens(2, 3))], pad_requests=1, pad_tokens=2)
    with pytest.warns(DeprecationWarning, match="CommonAttentionMetadata.num_reqs is a padded"):
        old = from_vllm_step(**step.adapter_args(), num_reqs=1)
    new = from_vllm_step(**step.adapter_args(), num_reqs_unpadded=1)
    assert old.query_start_loc.tolist() == new.query_start_loc.tolist()
    with pytest.raises(ValidationError, match="pass only num_tokens_unpadded"):
        from_vllm_step(**step.adapter_args(), num_actual_tokens=2, num_tokens_unpadded=2)


# One request in two rows -----------------------------------------------------------


def test_one_request_in_two_rows_is_refused() -> None:
    """Prefill context parallel puts two chunks of one request in one step (DualChunkSwap).

    vLLM writes its slot cache before hashing, so the second row reads the
    first row's tokens; engramrt reads history before the step writes it, so
    the second row's history would be empty. ``req_idx`` (the metadata's host
    array) lets validation refuse the step, naming the rows.
    """
    table = _block_table()
    table.add_row([3, 5, 6], 0)
    table.add_row([3, 5, 6], 1)  # the request's row, repeated for its second chunk
    tokens = _tokens(8, 4)
    rows = [(0, list(range(4)), tokens[:4]), (1, list(range(4, 8)), tokens[4:])]
    step = _step(table, rows, req_idx=[0, 0])
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    with pytest.raises(ValidationError, match=r"rows 0 and 1 both belong to request 0"):
        from_vllm_step(**step.adapter_args(), req_idx=step.meta.req_idx, cache=cache)
    # Control: vLLM's hasher gets the second row right, the slot cache path does not.
    theirs = _vllm_ids(_vllm_hash_state(), step)
    ours = _hasher()(from_vllm_step(**step.adapter_args(), cache=cache), cache).cpu().numpy()
    one_shot = _one_shot(tokens)
    assert np.array_equal(theirs, one_shot)
    assert not np.array_equal(ours[4:7], one_shot[4:7])
    assert np.array_equal(ours[:4], one_shot[:4])
    # One row per request passes.
    table.add_row([9], 1)
    other = _step(table, [rows[0], (1, [0, 1], _tokens(2, 5))], req_idx=[0, 1])
    from_vllm_step(**other.adapter_args(), req_idx=other.meta.req_idx)


# Decode context parallel -----------------------------------------------------------


def test_decode_context_parallel_is_refused() -> None:
    """DCP > 1: vLLM's slot mapping addresses virtual blocks of ``block_size * W`` and holds
    -1 for the tokens another rank stores; engramrt's slot cache cannot hold that history."""
    table = _block_table(dcp_world_size=2)
    table.add_row([3, 5], 0)
    step = _step(table, [(0, list(range(8)), _tokens(8, 6))])
    slots = step.meta.slot_mapping[:8].tolist()
    # Control: the real mapping is not table[p // bs] * bs + p % bs for DCP.
    assert slots == [12, -1, 13, -1, 14, -1, 15, -1]
    with pytest.raises(ValidationError, match=r"dcp_world_size=2; only 1 is supported"):
        from_vllm_step(**step.adapter_args(), dcp_world_size=2)
    with pytest.raises(ValidationError, match=r"dcp_world_size=2"):
        from_vllm_step(**step.adapter_args(), dcp_world_size=2, validate=False)


# The lookback buffer ---------------------------------------------------------------


def test_lookback_buffer_of_max_num_reqs_rows_is_sliced() -> None:
    """The runner's lookback buffer is ``[max_num_reqs, N-1]``; the step uses its first R_pad rows.

    A request whose first 5 tokens came from elsewhere (a KV connector) and
    whose slot cache is empty: the lookback ids give it the right history.
    """
    table = _block_table()
    table.add_row([3, 5], 0)
    table.add_row([9], 1)
    tokens = _tokens(7, 7)
    step = _step(
        table, [(0, [5, 6], tokens[5:]), (1, [0], tokens[:1])], pad_requests=1, pad_tokens=1
    )
    step.lookback.np[0] = tokens[4::-1][: N - 1]  # column j: position 5 - 1 - j
    lookback = step.lookback.copy_to_gpu()
    assert lookback.shape == (MAX_REQS, N - 1)
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    batch = from_vllm_step(
        **step.adapter_args(),
        num_reqs_unpadded=step.num_reqs,
        num_tokens_unpadded=step.num_tokens,
        lookback_token_ids=lookback,
        cache=cache,
    )
    assert batch.lookback_token_ids is not None
    assert batch.lookback_token_ids.shape == (3, N - 1)
    ours = _hasher()(batch, cache).cpu().numpy()
    theirs = _vllm_ids(_vllm_hash_state(), step, lookback=lookback)
    assert np.array_equal(ours[:2], _one_shot(tokens)[5:])
    assert np.array_equal(ours[:3], theirs[:3])
    with pytest.raises(ValidationError, match=r"lookback_token_ids has shape \[2, 3\]"):
        from_vllm_step(**step.adapter_args(), lookback_token_ids=lookback[:2])


# Image placeholders ----------------------------------------------------------------


def test_image_placeholder_id_makes_dead_positions() -> None:
    """vLLM's vision model puts id 129264 (inside the vocabulary) at every image position
    and hashes them as dead; ``image_token_id`` does the same, in the step and in the
    lookback ids."""
    table = _block_table()
    table.add_row([3, 5], 0)
    tokens = _tokens(8, 8)
    tokens[2:4] = [IMAGE_SENTINEL_BASE_ID] * 2
    tokens[6] = IMAGE_SENTINEL_BASE_ID
    step = _step(table, [(0, list(range(4, 8)), tokens[4:])])
    step.lookback.np[0] = tokens[3::-1][: N - 1]
    lookback = step.lookback.copy_to_gpu()
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    args = {**step.adapter_args(), "lookback_token_ids": lookback, "cache": cache}
    batch = from_vllm_step(**args, image_token_id=IMAGE_SENTINEL_BASE_ID)
    assert batch.dead_mask is not None and batch.lookback_dead is not None
    assert batch.dead_mask.tolist() == [False, False, True, False]
    assert batch.lookback_dead[0].tolist() == [True, True, False]
    ours = _hasher()(batch, cache).cpu().numpy()
    image = step.input_ids == IMAGE_SENTINEL_BASE_ID
    theirs = _vllm_ids(_vllm_hash_state(), step, lookback=lookback, image_mask=image)
    assert np.array_equal(ours, theirs)
    dead = np.array([t == IMAGE_SENTINEL_BASE_ID for t in tokens])
    one_shot = hash_sequence(_token_map().compress(np.array(tokens)), _consts(), dead)
    assert np.array_equal(ours, one_shot[4:])
    # Control: without the id the placeholders hash as text, silently.
    fresh = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    text = _hasher()(from_vllm_step(**{**args, "cache": fresh}), fresh).cpu().numpy()
    assert not np.array_equal(text, one_shot[4:])


# Never-written slots ---------------------------------------------------------------


def test_never_written_slot_hashes_as_pad_where_vllm_reads_id_zero() -> None:
    """History nobody wrote (KV from elsewhere, no lookback ids): engramrt's cache starts
    EMPTY and hashes it as pad, the one-shot hash of a sequence start; vLLM's starts at
    zeros and hashes it as compressed id 0. Wherever history was written both agree."""
    table = _block_table()
    table.add_row([3, 5], 0)
    tokens = _tokens(7, 9)
    step = _step(table, [(0, [5, 6], tokens[5:])])
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    ours = _hasher()(from_vllm_step(**step.adapter_args(), cache=cache), cache).cpu().numpy()
    theirs = _vllm_ids(_vllm_hash_state(), step)
    consts, compressed = _consts(), _token_map().compress(np.array(tokens[5:]))
    as_pad = hash_sequence(np.array([consts.pad_id] * 3 + list(compressed)), consts)[3:]
    as_zero = hash_sequence(np.array([0] * 3 + list(compressed)), consts)[3:]
    assert np.array_equal(ours, as_pad)
    assert np.array_equal(theirs, as_zero)
    assert not np.array_equal(as_pad, as_zero)


# Slot mapping length ---------------------------------------------------------------


def test_slot_mapping_shorter_than_the_tokens_is_refused() -> None:
    """6 slots for 8 tokens and no count of real tokens: tokens 6-7 would never be
    written and the next decode step would read pad for them."""
    table = _block_table()
    table.add_row([3, 5], 0)
    tokens = _tokens(9, 10)
    step = _step(table, [(0, list(range(8)), tokens[:8])])
    args = {**step.adapter_args(), "slot_mapping": step.meta.slot_mapping[:6]}
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    with pytest.raises(ValidationError, match=r"slot_mapping has 6 entries; expected at least"):
        from_vllm_step(**args, cache=cache)
    with pytest.raises(ValidationError, match="num_tokens_unpadded=8"):
        from_vllm_step(**args, num_tokens_unpadded=8)
    # Control: converted without the check, the next decode step reads pad for 6-7.
    hasher = _hasher()
    hasher(from_vllm_step(**args, validate=False), cache)
    decode = _step(table, [(0, [8], tokens[8:])])
    ids = hasher(from_vllm_step(**decode.adapter_args(), cache=cache), cache).cpu().numpy()
    assert not np.array_equal(ids[0], _one_shot(tokens)[8])
