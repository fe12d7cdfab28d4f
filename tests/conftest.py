"""Shared fixtures: the real default model (converted once per machine) and a tiny
random Llama that uses the real tokenizer, so every path runs in seconds."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The eight public benchmark files of the paper's Table 1, shipped in the repository
# (GAIA and GPQA are gated: scripts/prepare_data.py writes them beside these).
BENCHMARKS = ROOT / "data" / "benchmarks"

from engine import LLM  # noqa: E402
from support.models import DEFAULT_MODEL, resolve_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The offline default checkpoint (the first call converts the GGUF file, ~30 s)."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_path) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, saved in HF format
    (built as `python -m scripts.tiny_model DIR` builds it for a fork)."""
    from scripts.tiny_model import build
    return build(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir) -> LLM:
    from support.models import load_model
    model, tok = load_model(tiny_model_dir, "cpu", "float32")
    return LLM(model, tok)
