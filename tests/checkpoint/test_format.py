"""The streaming safetensors writer and the header reader, against ``safetensors`` itself."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engramrt.checkpoint import SafetensorsStreamWriter, TensorSpec, read_header
from engramrt.checkpoint.safetensors_format import HEADER_ALIGNMENT
from engramrt.errors import CheckpointError


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randint(0, 256, (37, 64), generator=g, dtype=torch.uint8).view(
            torch.float8_e4m3fn
        ),
        "s_u8": torch.randint(0, 256, (37, 2), generator=g, dtype=torch.uint8),
        "s_e8m0": torch.randint(0, 256, (37, 2), generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu
        ),
        "f": torch.randn(5, 7, generator=g, dtype=torch.float32),
        "b": torch.randn(3, 33, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 64, dtype=torch.uint8),
    }


_CODES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
}


def _write_streamed(path, tensors, order, block_rows, metadata=None):
    specs = [TensorSpec(n, _CODES[tensors[n].dtype], tuple(tensors[n].shape)) for n in order]
    with open(path, "wb") as handle:
        writer = SafetensorsStreamWriter(handle, specs, metadata)
        # Interleave tensors block by block, the way the converter writes weight and scale.
        cursors = dict.fromkeys(order, 0)
        while any(cursors[n] < tensors[n].shape[0] for n in order):
            for name in order:
                begin = cursors[name]
                block = tensors[name][begin : begin + block_rows]
                if block.shape[0]:
                    writer.append(name, block.contiguous().view(torch.uint8).numpy().tobytes())
                cursors[name] = begin + block.shape[0]
        writer.finish()
    return writer


@pytest.mark.parametrize("block_rows", [1, 5, 1000])
def test_stream_writer_output_loads_bit_exactly(tmp_path, block_rows) -> None:
    tensors = _random_tensors(block_rows)
    order = ["w", "s_u8", "f", "s_e8m0", "empty", "b"]
    path = tmp_path / "x.safetensors"
    writer = _write_streamed(path, tensors, order, block_rows, {"k": "v", "n": "3"})
    assert path.stat().st_size == writer.nbytes
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v", "n": "3"}
        assert set(f.keys()) == set(order)
        for name in order:
            got = f.get_tensor(name)
            assert got.dtype == tensors[name].dtype and got.shape == tensors[name].shape
            assert torch.equal(got.view(torch.uint8), tensors[name].view(torch.uint8)), name
        # Row slices read only what was asked for and match too.
        assert torch.equal(
            f.get_slice("w")[3:11].view(torch.uint8), tensors["w"][3:11].view(torch.uint8)
        )
    header = read_header(path)
    assert header.data_start % HEADER_ALIGNMENT == 0
    assert [header.tensors[n].dtype for n in ("w", "s_u8", "s_e8m0")] == [
        "F8_E4M3",
        "U8",
        "F8_E8M0",
    ]
    assert list(header.tensors) == order  # laid out in the order given


def test_read_header_parses_files_safetensors_wrote(tmp_path) -> None:
    tensors = _random_tensors(7)
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"a": "b"})
    header = read_header(path)
    assert header.metadata == {"a": "b"}
    for name, tensor in tensors.items():
        entry = header.tensors[name]
        assert entry.dtype == _CODES[tensor.dtype]
        assert entry.shape == tuple(tensor.shape)
        assert entry.nbytes == tensor.numel() * tensor.element_size()


def test_unfinished_file_never_loads(tmp_path) -> None:
    """Until finish() the header length is 0: a crash at any point leaves a file nothing loads."""
    tensors = _random_tensors(3)
    specs = [TensorSpec("w", "F8_E4M3", (37, 64)), TensorSpec("s", "U8", (37, 2))]
    path = tmp_path / "partial.safetensors"
    with open(path, "wb") as handle:
        writer = SafetensorsStreamWriter(handle, specs)
        writer.append("w", tensors["w"].view(torch.uint8).numpy().tobytes())
        writer.append("s", tensors["s_u8"].numpy().tobytes())  # every byte, but no finish()
    with pytest.raises(SafetensorError):
        safe_open(str(path), framework="pt")
    with pytest.raises(CheckpointError, match="unfinished write"):
        read_header(path)


def test_writer_refuses_incomplete_or_overfull_tensors(tmp_path) -> None:
    specs = [TensorSpec("w", "U8", (4, 8))]
    with open(tmp_path / "a.safetensors", "wb") as handle:
        writer = SafetensorsStreamWriter(handle, specs)
        writer.append("w", bytes(range(24)))
        with pytest.raises(CheckpointError, match=r"'w'.*incomplete|incomplete.*'w'"):
            writer.finish()
        with pytest.raises(CheckpointError, match=r"bytes \[24, 40\); expected at most 32"):
            writer.append("w", bytes(16))
        with pytest.raises(CheckpointError, match="not in this file"):
            writer.append("v", bytes(1))
    with open(tmp_path / "b", "wb") as handle, pytest.raises(CheckpointError, match="twice"):
        SafetensorsStreamWriter(handle, specs * 2)


def test_read_header_refuses_corrupt_files(tmp_path) -> None:
    tensors = _random_tensors(5)
    good = tmp_path / "good.safetensors"
    save_file(tensors, str(good))
    data = good.read_bytes()

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(truncated)

    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="2 bytes"):
        read_header(tiny)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 6) + b"{nope}" + bytes(8))
    with pytest.raises(CheckpointError, match="not JSON"):
        read_header(garbage)

    lying = tmp_path / "lying.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    lying.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=r"'x' \(F32 \[4\]\) spans 8 bytes; expected 16"):
        read_header(lying)

    with pytest.raises(CheckpointError, match="cannot be read"):
        read_header(tmp_path / "missing.safetensors")
