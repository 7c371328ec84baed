# The playbook's environment: NVIDIA's PyTorch container (PyTorch, Triton and CUDA inside) plus our small requirements.
#   docker build -t kernel-playbook .
#   docker run --gpus all -it --rm --ipc=host -v "$PWD":/workspace -v "$HOME/.cache/huggingface":/root/.cache/huggingface kernel-playbook
FROM nvcr.io/nvidia/pytorch:26.01-py3

WORKDIR /workspace
COPY requirements.txt /tmp/requirements.txt
# The container's own PyTorch and Triton stay; only what the scripts add on top is installed.
RUN pip install --no-cache-dir -r /tmp/requirements.txt

# Print what the playbook's step 1 asks you to verify: PyTorch, Triton, the GPU.
CMD ["python", "-c", "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__); print('GPU:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"]
