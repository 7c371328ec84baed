"""pytest set-up shared by every test file."""
import os

import torch

# Weights and data sets cannot be downloaded in CI or on the GPU machine; tests build models from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the kernels run on Triton's interpreter. The kernel modules set this flag themselves, but only when
# they are imported before anything decorates a Triton function; setting it here makes the collection order of the
# test files irrelevant.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
