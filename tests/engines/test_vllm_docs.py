"""docs/adapters.md and docs/integration.md against vLLM 0.33.0's real classes.

Every vLLM name the pages give (a dotted ``vllm.`` path, or ``Class.member``
of the classes below) must exist; the places the plug-in table names must
hold the calls it says; the splitting-ops snippet must build a real
``CompilationConfig`` naming engramrt's registered operators. The
environment is test_vllm_adapter.py's.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as in test_vllm_adapter.py: vLLM keeps Triton on
model = pytest.importorskip(
    "vllm.models.deepseek_v41.nvidia.model",
    reason="vllm==0.33.0 is not importable (see test_vllm_adapter.py for its environment)",
)

from vllm.config import CompilationConfig, SchedulerConfig  # noqa: E402
from vllm.models.deepseek_v41.common.engram import NgramHashState  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

import engramrt.custom_ops  # noqa: E402,F401  (registers the engramrt:: operators)

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ("adapters.md", "integration.md")

CLASSES = {
    "CommonAttentionMetadata": CommonAttentionMetadata,
    "DeepseekSparseSWAMetadata": DeepseekSparseSWAMetadata,
    "NgramHashState": NgramHashState,
    "DeepseekV4Model": model.DeepseekV4Model,
    "DeepseekV4DecoderLayer": model.DeepseekV4DecoderLayer,
    "GPUModelRunner": GPUModelRunner,
    "SchedulerOutput": SchedulerOutput,
    "SchedulerConfig": SchedulerConfig,
    "CompilationConfig": CompilationConfig,
}


def _text() -> str:
    """The pages without their SGLang sections (SGLang has classes of the same names)."""
    kept = []
    for page in PAGES:
        for section in re.split(r"(?m)^(?=#{2,3} )", (DOCS / page).read_text()):
            if "SGLang" not in section.partition("\n")[0]:
                kept.append(section)
    return "".join(kept)


def _has_member(cls: type, name: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", {})
    return name in fields or hasattr(cls, name)


def _resolve(path: str) -> object:
    """``vllm.a.b.Class.member``: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if isinstance(obj, type) and name in getattr(obj, "__dataclass_fields__", {}):
                obj = obj.__dataclass_fields__[name]
            else:
                obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_dotted_vllm_paths_exist() -> None:
    paths = sorted(set(re.findall(r"`(vllm(?:\.\w+)+)`", _text())))
    assert "vllm.v1.attention.backend.CommonAttentionMetadata" in paths
    for path in paths:
        _resolve(path)


def test_class_members_named_exist() -> None:
    names = sorted(set(re.findall(r"`(\w+)\.(\w+)`", _text())))
    checked = [(c, m) for c, m in names if c in CLASSES]
    assert len(checked) >= 10
    missing = [f"{c}.{m}" for c, m in checked if not _has_member(CLASSES[c], m)]
    assert not missing


def test_the_plug_in_places_hold_the_calls_named() -> None:
    """The table's rows: where vLLM builds, binds and calls its hasher and Engram modules."""
    init = inspect.getsource(model.DeepseekV4Model.__init__)
    assert "NgramHashState(" in init and "swa_cache_layer" in init  # the sliding-window group
    assert "self.engram_hash(" in inspect.getsource(model.DeepseekV4Model.forward)
    assert "self.engram(" in inspect.getsource(model.DeepseekV4DecoderLayer.forward)
    assert "kv_cache" in inspect.getsource(NgramHashState.ensure_cache)
    assert "max_num_reqs" in inspect.getsource(GPUModelRunner)  # the lookback buffer's rows


def test_history_binding_names_the_sliding_window_group() -> None:
    page = (DOCS / "adapters.md").read_text()
    binding = page[page.index("**History binding.** Bind one `SlotHashCache` per runner") :]
    binding = binding[: binding.index("\n\n")]
    assert "sliding-window" in binding
    assert "full attention" not in _text()


def test_splitting_ops_snippet_builds_a_real_config() -> None:
    page = (DOCS / "adapters.md").read_text()
    section = page[page.index("CUDA graphs: in vLLM's piecewise mode") :]
    snippet = re.search(r"```\n(compilation_config = .*?)```", section, re.S)
    assert snippet is not None
    scope: dict = {"CompilationConfig": CompilationConfig}
    exec(snippet.group(1), scope)
    ops = scope["compilation_config"].splitting_ops
    assert set(CompilationConfig._attention_ops) <= set(ops)
    engram_ops = [op for op in ops if op.startswith("engramrt::")]
    assert engram_ops == ["engramrt::plan_step_slot_cache", "engramrt::run_layer"]
    for op in engram_ops:
        assert hasattr(torch.ops.engramrt, op.removeprefix("engramrt::"))
