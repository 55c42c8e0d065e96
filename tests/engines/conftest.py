"""The engine tests: engramrt against the real step metadata of SGLang and vLLM.

The engines are no dependency of engramrt: ``scripts/test-engines`` builds
``.engines-venv`` with them at exact pins and runs this folder there. Anywhere
else (``scripts/test``) an engine that is not installed at its pin has its tests
skipped, with the reason. Inside the job (``ENGRAMRT_ENGINE_JOB=1``) only an
engine the job declared skipped (its wheel could not be installed) may skip;
any other that is missing or does not import fails the run.
"""

from __future__ import annotations

from tests.engines.helpers import ENGINES, engine_skip_reason


def pytest_report_header() -> list[str]:
    """One line per engine: its version here, or why its tests are skipped."""
    return [
        f"engine {name}=={version}: {engine_skip_reason(name) or 'installed'}"
        for name, version in ENGINES.items()
    ]
