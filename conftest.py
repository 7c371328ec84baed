"""pytest set-up shared by every test file: never reach for the Hugging Face Hub."""
import os

# Weights and data sets cannot be downloaded in CI or on the GPU machine; tests build models from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
