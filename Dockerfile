# The playbook's environment: NVIDIA's PyTorch container (PyTorch, Triton and CUDA inside) plus our small requirements.
#   docker build -t kernel-playbook .
#   docker run --gpus all -it --rm --ipc=host -p 6006:6006 -v "$PWD":/workspace \
#     -v "$HOME/.cache/huggingface":/root/.cache/huggingface kernel-playbook
# Inside, `tensorboard --logdir traces/tensorboard --bind_all` serves profile_baseline.py --tensorboard logs on port 6006.
FROM nvcr.io/nvidia/pytorch:26.01-py3

WORKDIR /workspace
COPY requirements.txt /tmp/requirements.txt
# The container's own PyTorch and Triton stay; only what the scripts add on top is installed (transformers, accelerate,
# datasets, huggingface_hub, tensorboard with its PyTorch Profiler plugin, ...). The image pins every package it ships
# in /etc/pip/constraint.txt (NGC releases since 25.03), and transformers 5.17 needs a newer safetensors than it pins:
# only the pins of PyTorch and Triton are kept, so that nothing replaces them.
# requirements.txt's Triton range is for pip installs outside the image: the image's own Triton is the one that
# matches its PyTorch, so that line is left out here.
RUN grep -iE '^(torch|triton)\b' /etc/pip/constraint.txt > /tmp/torch-constraint.txt; \
    grep -v '^triton' /tmp/requirements.txt > /tmp/requirements-image.txt; \
    PIP_CONSTRAINT=/tmp/torch-constraint.txt pip install --no-cache-dir -r /tmp/requirements-image.txt

# Print what the playbook's step 1 asks you to verify: PyTorch, Triton, the GPU (and the packages the scripts add).
CMD ["python", "-c", "import torch, triton, transformers, accelerate, datasets; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| datasets', datasets.__version__); print('GPU:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"]
