"""from_sglang_batch on SGLang's own step metadata, against SGLang's own Engram hasher.

Steps are built the way SGLang's scheduler builds them: request rows from a real
``ReqToTokenPool`` (row 0 is its reserved padding row), KV slots from a real
``TokenToKVPoolAllocator`` (slot 0 is its reserved padding slot), a real
``ForwardBatch``. Each step is hashed twice: by engramrt (adapter, slot cache,
hasher) and by SGLang's Triton hash kernel (interpreted on the CPU) fed with
engramrt's constants and SGLang's per-request history rows; both must equal
hashing every request's whole sequence at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.engines.helpers import import_engine, requires_engine

from engramrt.adapters import from_sglang_batch, sglang_request_history, sglang_slot_cache
from engramrt.adapters.sglang import MM_PAD_SHIFT_VALUE
from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, NgramHasher, hash_sequence

pytestmark = requires_engine("sglang")

IMAGE_TOKEN_ID = 129264  # the bundled tokenizer's image placeholder


@pytest.fixture(scope="module")
def sg():
    return import_engine(
        "sglang",
        "sglang.srt.model_executor.forward_batch_info",
        "sglang.srt.mem_cache.memory_pool",
        "sglang.srt.mem_cache.allocator.token",
        "sglang.srt.managers.schedule_batch",
        "sglang.kernels.ops.embeddings.engram_hash",
    )


@pytest.fixture(scope="module")
def consts(token_map) -> HashConstants:
    return HashConstants.from_config(PRESETS["tiny"], token_map)


@pytest.fixture(scope="module")
def hasher(consts, token_map) -> NgramHasher:
    return NgramHasher(consts, token_map, "cpu", backend="reference")


class SGLangPools:
    """SGLang's request and KV pools, and SGLang's Engram history rows beside them."""

    def __init__(self, sg, n: int) -> None:
        self.sg = sg
        self.req_pool = sg.memory_pool.ReqToTokenPool(
            size=8, max_context_len=64, device="cpu", enable_memory_saver=False
        )
        self.kv = sg.token.TokenToKVPoolAllocator(
            size=256, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
        )
        # SGLang's EngramHasher.init_history: [rows, N-1] oldest first, int32.
        self.history = torch.zeros(self.req_pool._alloc_size, n - 1, dtype=torch.int32)
        self.tokens: dict[int, list[int]] = {}  # pool row: every token so far

    def new_request(self) -> int:
        (row,) = self.req_pool.alloc_rows(1)
        self.tokens[row] = []
        return row

    def extend(self, rows: list[int], chunks: list[list[int]], mode=None):
        """A ForwardBatch of one chunk per request, KV slots allocated and written."""
        fbi = self.sg.forward_batch_info
        prefix = [len(self.tokens[r]) for r in rows]
        out_cache_loc = []
        for row, start, chunk in zip(rows, prefix, chunks, strict=True):
            slots = self.kv.alloc(len(chunk))
            self.req_pool.write((row, slice(start, start + len(chunk))), slots.to(torch.int32))
            out_cache_loc.append(slots)
            self.tokens[row] += chunk
        seq_lens = torch.tensor([len(self.tokens[r]) for r in rows])
        lens = torch.tensor([len(c) for c in chunks])
        return fbi.ForwardBatch(
            forward_mode=mode or fbi.ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=torch.tensor([t for c in chunks for t in c]),
            req_pool_indices=torch.tensor(rows),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            out_cache_loc=torch.cat(out_cache_loc),
            seq_lens_sum=int(seq_lens.sum()),
            positions=torch.cat(
                [torch.arange(p, p + len(c)) for p, c in zip(prefix, chunks, strict=True)]
            ),
            extend_prefix_lens=torch.tensor(prefix),
            extend_seq_lens=lens,
            extend_start_loc=torch.cumsum(lens, 0) - lens,
            extend_seq_lens_cpu=lens.tolist(),
            extend_prefix_lens_cpu=prefix,
        )

    def reject(self, row: int, num_tokens: int) -> None:
        """Drop a request's last ``num_tokens`` (rejected drafts)."""
        del self.tokens[row][len(self.tokens[row]) - num_tokens :]

    def sglang_hash(self, batch, consts: HashConstants, token_map, *, commit: bool = True):
        """Hash ids of an extend batch by SGLang's kernel, on its history rows."""
        kernel = self.sg.engram_hash
        n, lens = consts.max_ngram_size, batch.extend_seq_lens
        layers, heads = consts.n_layers, consts.n_heads
        rows = torch.repeat_interleave(torch.arange(batch.batch_size), lens)
        ids, tokens = kernel.engram_hash_ids(
            batch.input_ids,
            batch.positions,
            mode=kernel.MODE_EXTEND,
            history=self.history,
            token_map=torch.as_tensor(token_map.map, dtype=torch.int64),
            multipliers=torch.as_tensor(consts.multipliers),
            primes=torch.as_tensor(consts.col_primes).reshape(layers, n - 1, heads),
            offsets=torch.as_tensor(consts.offsets),
            pad_id=consts.pad_id,
            num_real=int(lens.sum()),
            req_slots=batch.req_pool_indices,
            row=rows,
            starts=batch.extend_start_loc,
            image_token_id=IMAGE_TOKEN_ID,
            mm_pad_shift=self.sg.schedule_batch.MM_PAD_SHIFT_VALUE,
        )
        if commit:  # SGLang's commit: each request's last token and its N-2 predecessors
            last = batch.extend_start_loc + lens - 1
            self.history[batch.req_pool_indices] = tokens[last, : n - 1].flip(-1).to(torch.int32)
        return ids.numpy()


def one_shot(tokens: list[int], consts: HashConstants, token_map) -> np.ndarray:
    """Row ids of a whole sequence; image tokens (multimodal pads) are dead."""
    ids = np.asarray(tokens, dtype=np.int64)
    dead = ids >= MM_PAD_SHIFT_VALUE
    return hash_sequence(token_map.map[np.where(dead, 0, ids)], consts, dead)


def expected(pools: SGLangPools, batch, consts, token_map) -> np.ndarray:
    rows = batch.req_pool_indices.tolist()
    out = []
    for row, start, length in zip(
        rows,
        batch.positions[batch.extend_start_loc].tolist(),
        batch.extend_seq_lens.tolist(),
        strict=True,
    ):
        out.append(one_shot(pools.tokens[row], consts, token_map)[start : start + length])
    return np.concatenate(out)


def test_constants_and_pad_shift_agree_with_sglang(sg, consts) -> None:
    # The multipliers and primes SGLang derives from the config file engramrt writes.
    from types import SimpleNamespace

    from sglang.srt.layers import engram as sglang_engram  # noqa: F401  (its imports)
    from sglang.srt.layers.engram import EngramLayout, compute_hash_multipliers

    cfg = PRESETS["tiny"]
    hf = SimpleNamespace(**cfg.to_hf_dict())
    layout = EngramLayout.from_config(hf)
    assert (
        np.asarray(layout.primes).reshape(cfg.n_layers, -1).tolist() == consts.col_primes.tolist()
    )
    multipliers = compute_hash_multipliers(
        tuple(cfg.layer_ids), cfg.max_ngram_size, cfg.compressed_vocab_size
    )
    assert multipliers.tolist() == consts.multipliers.tolist()
    assert sg.schedule_batch.MM_PAD_SHIFT_VALUE == MM_PAD_SHIFT_VALUE


def test_reserved_row_and_slot(sg, consts) -> None:
    pools = SGLangPools(sg, consts.max_ngram_size)
    assert pools.new_request() != 0  # row 0: the padding row of graph-padded batches
    assert 0 not in pools.kv.alloc(200).tolist()  # slot 0: where padded tokens write


def run_engramrt(pools, batch, hasher, cache, **kwargs) -> np.ndarray:
    hash_batch = from_sglang_batch(
        input_ids=batch.input_ids,
        req_pool_indices=batch.req_pool_indices,
        req_to_token=pools.req_pool.req_to_token,
        hasher=hasher,
        positions=batch.positions,
        extend_seq_lens=batch.extend_seq_lens,
        cache=cache,
        **kwargs,
    )
    return hasher(hash_batch, cache).numpy()


def test_multimodal_pad_ids_are_dead_positions(sg, consts, token_map, hasher) -> None:
    pools = SGLangPools(sg, consts.max_ngram_size)
    cache = sglang_slot_cache(pools.kv.size + 1)
    a, b = pools.new_request(), pools.new_request()
    pad = MM_PAD_SHIFT_VALUE + 17  # SGLang's pad value of one image
    text = [100, 200, 300, 400]
    batch = pools.extend([a, b], [[*text, pad, pad, 500, 600], [700, pad, 800]])
    want = expected(pools, batch, consts, token_map)
    np.testing.assert_array_equal(pools.sglang_hash(batch, consts, token_map), want)
    np.testing.assert_array_equal(run_engramrt(pools, batch, hasher, cache), want)
    # Control: pad ids passed through to the hasher are not image positions.
    passed = run_engramrt(
        pools, batch, hasher, sglang_slot_cache(cache.num_slots), mm_pad_shift=None
    )
    assert not np.array_equal(passed, want)
    # The next chunk reads the image positions from the slot cache as dead.
    batch = pools.extend([a, b], [[900, 901], [902]])
    want = expected(pools, batch, consts, token_map)
    np.testing.assert_array_equal(pools.sglang_hash(batch, consts, token_map), want)
    np.testing.assert_array_equal(run_engramrt(pools, batch, hasher, cache), want)


def test_mm_pad_shift_is_configurable(sg, consts, token_map, hasher) -> None:
    pools = SGLangPools(sg, consts.max_ngram_size)
    cache = sglang_slot_cache(pools.kv.size + 1)
    a = pools.new_request()
    batch = pools.extend([a], [[100, 200, 5000, 300]])
    dead = np.array([False, False, True, False])
    ids = token_map.map[np.array([100, 200, 0, 300])]
    got = run_engramrt(pools, batch, hasher, cache, mm_pad_shift=5000)
    np.testing.assert_array_equal(got, hash_sequence(ids, consts, dead))


def test_verify_chunk_starts_at_positions(sg, consts, token_map, hasher) -> None:
    # A target-verify step: seq_lens (and seq_lens_cpu) count committed + draft tokens,
    # ForwardBatch.positions the draft tokens' own positions.
    fbi = sg.forward_batch_info
    pools = SGLangPools(sg, consts.max_ngram_size)
    cache = sglang_slot_cache(pools.kv.size + 1)
    a, b = pools.new_request(), pools.new_request()
    prefill = pools.extend([a, b], [[11, 12, 13, 14, 15], [21, 22]])
    run_engramrt(pools, prefill, hasher, cache)
    pools.sglang_hash(prefill, consts, token_map)
    drafts = [[16, 17, 18], [23, 24, 25]]
    verify = pools.extend([a, b], drafts, mode=fbi.ForwardMode.TARGET_VERIFY)
    assert verify.seq_lens_cpu.tolist() == [8, 5]  # committed + draft width
    want = expected(pools, verify, consts, token_map)
    np.testing.assert_array_equal(pools.sglang_hash(verify, consts, token_map, commit=False), want)
    np.testing.assert_array_equal(run_engramrt(pools, verify, hasher, cache), want)
    # Chunk starts from seq_lens_cpu, as if the step held one token past them: wrong.
    wrong = from_sglang_batch(
        input_ids=verify.input_ids,
        req_pool_indices=verify.req_pool_indices,
        req_to_token=pools.req_pool.req_to_token,
        hasher=hasher,
        extend_prefix_lens=verify.seq_lens_cpu,
        extend_seq_lens=verify.extend_seq_lens,
        cache=cache,
    )
    assert not np.array_equal(hasher(wrong, cache).numpy(), want)


def test_history_rows_mode(sg, consts, token_map, hasher) -> None:
    # SGLang's own design: a history row per pool row (req_pool_indices), no slots.
    fbi = sg.forward_batch_info
    pools = SGLangPools(sg, consts.max_ngram_size)
    history = sglang_request_history(pools.req_pool._alloc_size, hasher)
    a, b = pools.new_request(), pools.new_request()

    def check(batch, decode: bool = False) -> None:
        hash_batch = from_sglang_batch(
            input_ids=batch.input_ids,
            req_pool_indices=batch.req_pool_indices,
            req_to_token=pools.req_pool.req_to_token,
            hasher=hasher,
            positions=batch.positions,
            extend_seq_lens=None if decode else batch.extend_seq_lens,
            history="rows",
        )
        assert hash_batch.request_slots.tolist() == batch.req_pool_indices.tolist()
        want = expected(pools, batch, consts, token_map)
        np.testing.assert_array_equal(hasher(hash_batch, history).numpy(), want)

    check(pools.extend([a, b], [[11, 12, 13, 14, 15], [21, 22]]))  # chunked prefill
    check(pools.extend([a, b], [[16, 17], [23]]))  # a's next chunk, b's first decode
    verify = pools.extend([a, b], [[31, 32, 33], [41, 42, 43]], fbi.ForwardMode.TARGET_VERIFY)
    check(verify)
    pools.reject(a, 2)  # a accepts one draft, b two
    pools.reject(b, 1)
    for row in (a, b):  # the accepted tokens' KV slots are the pool row's
        pools.req_pool.req_to_token[row, len(pools.tokens[row]) :] = 0
    check(pools.extend([a, b], [[34], [44]]), decode=True)
    check(pools.extend([a, b], [[35], [45]]), decode=True)


def sglang_source(module: str) -> str:
    """The text of an sglang module, read without importing it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).read_text()


def test_plugin_instructions_name_real_code(sg) -> None:
    # docs/adapters.md, "In SGLang's model runner": every call site and field it names.
    doc = (Path(__file__).parents[2] / "docs" / "adapters.md").read_text()
    section = doc.split("### In SGLang's model runner", 1)[1]
    sources = {
        "sglang.srt.models.deepseek_v4": [
            "class DeepseekV4Model",
            "self.engram_hasher(input_ids, forward_batch)",
        ],
        "sglang.srt.model_executor.model_runner_components.ngram_embedding_manager": [
            "class NgramEmbeddingManager",
            "init_history(req_to_token_pool.req_to_token.shape[0], device)",
        ],
        "sglang.srt.model_executor.model_runner": [
            "def _forward_raw",
            "self.decode_cuda_graph_runner",
            "self.req_to_token_pool =",
            "self.token_to_kv_pool_allocator =",
        ],
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner": ["raw_bs", "raw_num_token"],
        "sglang.srt.layers.engram": ["class EngramHasher", "class Engram("],
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph": [
            "def eager_on_graph"
        ],
    }
    for module, needles in sources.items():
        text = sglang_source(module)
        for needle in needles:
            assert needle in text, f"{module} has no {needle!r}"
    fields = {f.name for f in dataclasses.fields(sg.forward_batch_info.ForwardBatch)}
    named = set(re.findall(r"forward_batch\.(\w+)", section))
    assert named and named <= fields | {"forward_mode"}, named - fields
    mode = sg.forward_batch_info.ForwardMode
    for method in re.findall(r"forward_mode\.(\w+)\(\)", section):
        assert hasattr(mode, method), method
    pools = SGLangPools(sg, 4)
    assert pools.req_pool.req_to_token.shape[0] == pools.req_pool.size + 1
    assert pools.kv.size == 256
