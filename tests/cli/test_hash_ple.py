"""``engramrt hash --config`` on a Qwen4-Exp config.json: PLE row ids ``[T, L, C]``.

The CLI's ids (one shot and streamed in chunks, through the reference and the Triton
kernel) are compared with the package's reference (``engramrt.families.qwen4_ple.ids``), with
a plain-Python reading of docs/families.md §2-§3 written here, and, where transformers 5.23.0
is installed, with the oracle's own ids for the config.json it saved. A control drops the
context between chunks and sees both the CLI's verdict and the comparison fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engramrt.cli import main
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.ids import PleConstants, ple_row_ids

LIN, FULL = "linear_attention", "full_attention"

# A small composite Qwen4-Exp config as transformers writes it: the PLE fields under
# text_config; PLE on decoder layers 3 and 1 (listed out of order: L follows sorted ids);
# an eos_token_id list whose element 0 is the PLE EOS (8 is an ordinary token).
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "ple_layer_ids": [3, 1],
    "ple_embed_dim": 16,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "vocab_size": 300,
    "eos_token_id": [7, 8],
    "hidden_size": 16,
    "num_hidden_layers": 4,
    "layer_types": [LIN, LIN, LIN, FULL],
}
EOS = 7
# Fresh ids: a start, an EOS inside (a segment boundary), two EOS in a row, the other
# eos_token_id entry 8 (ordinary), 0 and V - 1.
TOKENS = [5, 211, 7, 9, 10, 7, 7, 12, 8, 8, 299, 0, 144, 7, 31]


def _run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def _write(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def composite(tmp_path) -> Path:
    """A ``qwen4_exp`` config.json (fields under ``text_config``)."""
    return _write(tmp_path, "config.json", {"model_type": "qwen4_exp", "text_config": TEXT_CONFIG})


def _reference(tokens: list[int]) -> list:
    """``[T, L, C]`` of the package's numpy reference, hashing the whole request at once."""
    config = PleConfig.from_hf(TEXT_CONFIG)
    return ple_row_ids(np.array(tokens), PleConstants.from_config(config), EOS).tolist()


# -- docs/families.md §2-§3 read plainly (Python ints, trial division) -------------------------

_MASK = 2**64 - 1
_G = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    z = (z + _G) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _signed(z: int) -> int:
    z &= _MASK
    return z - 2**64 if z >= 2**63 else z


def spec_row_ids(tokens: list[int], fields: dict[str, Any]) -> list:
    """Row ids ``[T, L, C]`` as docs/families.md §2-§3 state them."""
    n, h, v = fields["ngram_size"], fields["heads_per_ngram"], fields["vocab_size"]
    eos = fields["eos_token_id"][0]
    cols = (n - 1) * h
    half = max(1, ((2**63 - 1) // v) // 2)
    primes, candidate = [], fields["ngram_vocab_size_base"]
    layers = sorted(set(fields["ple_layer_ids"]))
    while len(primes) < len(layers) * cols:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    rows = [[[0] * cols for _ in layers] for _ in tokens]
    for l in range(len(layers)):  # noqa: E741 (the spec's name for the PLE index)
        mults = [
            2 * (_splitmix64((fields["seed"] + 10007 * l + _G * (i + 1)) & _MASK) % half) + 1
            for i in range(n)
        ]
        sizes = primes[l * cols : (l + 1) * cols]
        offsets = [sum(sizes[:c]) for c in range(cols)]
        for t, token in enumerate(tokens):
            values, blocked = [token], False
            for s in range(1, n):
                blocked = blocked or t - s < 0 or tokens[t - s] == eos
                values.append(eos if blocked else tokens[t - s])
            for order in range(2, n + 1):
                mix = 0
                for s in range(order):
                    mix ^= _signed(values[s] * mults[s])
                for j in range(h):
                    c = (order - 2) * h + j
                    rows[t][l][c] = mix % sizes[c] + offsets[c]
    return rows


def test_spec_reading_equals_the_reference() -> None:
    """The two oracles of this file agree (and the defaults' multipliers are the SPEC's)."""
    assert spec_row_ids(TOKENS, TEXT_CONFIG) == _reference(TOKENS)
    default = {**TEXT_CONFIG, "vocab_size": 248_320}
    half = ((2**63 - 1) // 248_320) // 2
    assert [2 * (_splitmix64((1234 + _G * (i + 1)) & _MASK) % half) + 1 for i in range(3)] == [
        23703573157769,
        20109073645365,
        8052911324071,
    ]
    assert spec_row_ids([5, 7], default) != spec_row_ids([5, 8], default)


# -- one shot and chunked -----------------------------------------------------------------


def test_one_shot_json_equals_the_reference(capsys, composite) -> None:
    code, out, err = _run(
        capsys, "hash", "--config", composite, "--ids", ",".join(map(str, TOKENS)), "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["row_ids"] == _reference(TOKENS) == spec_row_ids(TOKENS, TEXT_CONFIG)
    assert report["family"] == "qwen4-ple" and report["matches_one_shot"] is True
    assert report["ple_layer_ids"] == [1, 3] and report["eos_token_id"] == EOS
    assert np.array(report["row_ids"]).shape == (len(TOKENS), 2, 4)


@pytest.mark.parametrize("chunks", ["1", "2,3", "4,1,1,5", "3,1,1,1,1,1,1,1,1,1,1,1,1"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_chunked_out_file_equals_one_shot(capsys, tmp_path, composite, chunks, backend) -> None:
    """Streaming carries the context between chunks: any split gives the one-shot ids."""
    import os

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on a CPU needs TRITON_INTERPRET=1")
    out_file = tmp_path / "rows.npy"
    ids = ",".join(map(str, TOKENS))
    args = ["hash", "-c", composite, "--ids", ids, "--chunks", chunks, "--backend", backend]
    code, out, err = _run(capsys, *args, "--out", out_file)
    assert code == 0, err
    saved = np.load(out_file)
    assert saved.dtype == np.int64 and saved.shape == (len(TOKENS), 2, 4)
    assert saved.tolist() == _reference(TOKENS)
    flat = " ".join(out.split())
    assert f"backend {backend}: matches one-shot hashing" in flat
    assert f"saved [{len(TOKENS)}, 2, 4] int64 to" in flat


def test_text_config_ids_file_and_model_directory(capsys, tmp_path) -> None:
    """A text-only config (``qwen4_exp_text`` at top level), read from a model directory,
    with the ids in a .npy file: the same ids."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _write(model_dir, "config.json", TEXT_CONFIG)
    ids_file = tmp_path / "ids.npy"
    np.save(ids_file, np.array(TOKENS, dtype=np.int32))
    code, out, err = _run(
        capsys, "hash", "-c", model_dir, "--ids-file", ids_file, "--chunks", "5,5", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["row_ids"] == _reference(TOKENS)


def test_control_a_context_dropped_between_chunks_is_seen(capsys, composite, monkeypatch) -> None:
    """If each chunk started as a fresh request, the ids would differ from the reference
    and the CLI would say so (exit 1); one chunk is unaffected."""
    import torch

    from engramrt.cli import hash_ple

    def stream_forgetting(hasher, token_ids, chunks):
        rows, start = [], 0
        for size in chunks or [len(token_ids)]:
            chunk = torch.as_tensor(token_ids[start : start + size])
            rows.append(hasher(chunk, torch.tensor([0, size]), hasher.start_contexts(1))[0].numpy())
            start += size
        if start < len(token_ids):
            rest = torch.as_tensor(token_ids[start:])
            qsl = torch.tensor([0, len(rest)])
            rows.append(hasher(rest, qsl, hasher.start_contexts(1))[0].numpy())
        return np.concatenate(rows)

    monkeypatch.setattr(hash_ple, "stream_ple", stream_forgetting)
    ids = ",".join(map(str, TOKENS))
    code, out, _ = _run(capsys, "hash", "-c", composite, "--ids", ids, "--chunks", "2,3", "--json")
    report = json.loads(out)
    assert code == 1 and report["matches_one_shot"] is False
    assert report["row_ids"] != _reference(TOKENS)
    code, out, _ = _run(capsys, "hash", "-c", composite, "--ids", ids, "--json")
    assert code == 0 and json.loads(out)["row_ids"] == _reference(TOKENS)


# -- errors ---------------------------------------------------------------------------------


def _error(capsys, *args: object) -> str:
    code, _, err = _run(capsys, *args)
    assert code == 2 and "Traceback" not in err, err
    return " ".join(err.split())


def test_ple_off_names_the_field_and_value(capsys, tmp_path) -> None:
    off = _write(tmp_path, "off.json", {**TEXT_CONFIG, "ple_layer_ids": []})
    assert _error(capsys, "hash", "-c", off, "--ids", "1") == (
        f"error: --config='{off}' has ple_layer_ids=[] (PLE off); expected a list of at "
        f"least one one-indexed decoder layer with PLE, e.g. [2]"
    )
    fields = {k: v for k, v in TEXT_CONFIG.items() if k != "ple_layer_ids"}
    absent = _write(tmp_path, "absent.json", {"model_type": "qwen4_exp", "text_config": fields})
    assert _error(capsys, "hash", "-c", absent, "--ids", "1") == (
        f"error: --config='{absent}' has no ple_layer_ids (PLE off); expected a list of at "
        f"least one one-indexed decoder layer with PLE, e.g. [2]"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"ple_embed_dim": 10},
            "ple_embed_dim=10 must be a multiple of the n-gram head count C = (ngram_size - 1) "
            "* heads_per_ngram = 4",
        ),
        (
            {"ple_layer_ids": [4]},
            "ple_layer_ids has 4, whose layer_types entry is 'indexed_attention'; PLE runs only "
            "on 'linear_attention' layers",
        ),
        ({"eos_token_id": None}, "eos_token_id=None (null or []) must be set when PLE is on "),
    ],
)
def test_bad_ple_fields_name_the_config_field_and_value(capsys, tmp_path, changes, message):
    bad = _write(tmp_path, "bad.json", {**TEXT_CONFIG, **changes})
    assert _error(capsys, "hash", "-c", bad, "--ids", "1").startswith(
        f"error: --config='{bad}': {message}"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ids", "5,6,300"],
            "--ids holds 300 at position 2; expected token ids in [0, vocab_size=300) or the "
            "EOS id 7",
        ),
        (
            ["--ids", "-1"],
            "--ids holds -1 at position 0; expected token ids in [0, vocab_size=300) or the "
            "EOS id 7",
        ),
        (
            ["--ids", "5,6", "--history", "slot"],
            "--history='slot' is for deepseek-engram configs; a qwen4-ple request carries its "
            "last N - 1 = 2 ids between chunks (leave --history out)",
        ),
        (["--ids", "5,6", "--chunks", "3"], "chunks=[3] add up to 3, more than the 2 tokens"),
        (["--ids", "5,6", "--chunks", "0,1"], "chunks=[0, 1] must all be positive"),
        (
            ["--ids", "5", "--backend", "cuda"],
            "backend='cuda' is not one of auto, triton, reference",
        ),
    ],
)
def test_bad_input_is_one_exact_line(capsys, composite, args, message) -> None:
    assert _error(capsys, "hash", "-c", composite, *args) == f"error: {message}"


def test_text_needs_a_tokenizer(capsys, composite) -> None:
    assert _error(capsys, "hash", "-c", composite, "--text", "hello") == (
        f"error: --text with the qwen4-ple config '{composite}' needs --tokenizer (the default "
        f"is DeepSeek-V4's tokenizer); or give --ids / --ids-file"
    )


def test_a_config_of_two_families_is_refused(capsys, tmp_path) -> None:
    both = {k: v for k, v in TEXT_CONFIG.items() if k != "model_type"}
    both["engram_layer_ids"] = [1]
    path = _write(tmp_path, "both.json", both)
    assert _error(capsys, "hash", "-c", path, "--ids", "1") == (
        f"error: --config='{path}' has the fields of several memory families "
        f"(deepseek-engram: engram_layer_ids; qwen4-ple: ple_embed_dim, ple_layer_ids); "
        f"expected the fields of one"
    )


# -- the oracle -----------------------------------------------------------------------------


def test_ids_equal_the_oracle_for_the_config_it_saved(capsys, tmp_path) -> None:
    """transformers saves the config.json (composite, with its defaults); the CLI, chunked,
    gives the ids its ``Qwen4ExpTextNGramEmbedding`` feeds the table."""
    transformers = pytest.importorskip(
        "transformers", reason="the PLE oracle transformers==5.23.0 is not installed"
    )
    if transformers.__version__ != "5.23.0":
        pytest.skip(f"transformers {transformers.__version__}; the PLE oracle is 5.23.0")
    import torch
    from transformers.models.qwen4_exp import configuration_qwen4_exp, modeling_qwen4_exp

    fields = {k: v for k, v in TEXT_CONFIG.items() if k != "model_type"}
    configuration_qwen4_exp.Qwen4ExpConfig(text_config=fields).save_pretrained(tmp_path)
    text = configuration_qwen4_exp.Qwen4ExpTextConfig(**fields)
    captured: list[torch.Tensor] = []
    for ple_index, layer_id in enumerate(sorted(fields["ple_layer_ids"])):
        module = modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding(
            text, embedding_dim=16, layer_idx=layer_id - 1, ple_layer_index=ple_index
        )
        module.ngram_embedding.register_forward_hook(
            lambda _m, args, _out: captured.append(args[0][0].clone())
        )
        with torch.no_grad():
            module(torch.tensor([TOKENS]), None)
    oracle = torch.stack(captured, dim=1).tolist()  # [T, L, C]
    ids = ",".join(map(str, TOKENS))
    code, out, err = _run(
        capsys, "hash", "-c", tmp_path, "--ids", ids, "--chunks", "4,1,3", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["row_ids"] == oracle
