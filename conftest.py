"""pytest set-up shared by every test file."""
import importlib
import os

import pytest
import torch

# Weights and data sets cannot be downloaded in CI or on the GPU machine; tests build models from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the kernels run on Triton's interpreter. The kernel modules set this flag themselves, but only when
# they are imported before anything decorates a Triton function; setting it here makes the collection order of the
# test files irrelevant.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Each family's stock RoPE function, taken before any test runs. rope_kernel.apply_rope replaces a family's
# apply_rotary_pos_emb in its modeling module, process-wide, and a fine-tune run in-process by one test leaves it
# replaced for the tests after it in the same worker.
STOCK_ROPE = {modeling: modeling.apply_rotary_pos_emb for modeling in (
    importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"))}


@pytest.fixture
def restore_rope(monkeypatch):
    """Every family's stock apply_rotary_pos_emb during the test (whatever ran before it), and what was there before
    put back after it."""
    for modeling, stock in STOCK_ROPE.items():
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", stock)
