#!/usr/bin/env python
"""Liger-Kernel's own op tests, run against our kernels.

Liger-Kernel checks its ops against PyTorch and transformers in test/transformers/test_rms_norm.py,
test_cross_entropy.py, test_fused_linear_cross_entropy.py, test_swiglu.py and test_rope.py. This script runs those
same test cases with our kernels in place of Liger's:
  1. it copies the five test files and the helpers they import (test/__init__.py, test/conftest.py, test/utils.py)
     from a Liger source (a git directory, a work tree, or an archive written by --export) into a scratch folder
     outside the checkout (--workdir), where the repository's own pytest run does not collect them;
  2. it writes a conftest.py there that loads this file as a pytest plugin, the adapter: before the tests import
     anything, it replaces the Liger entry points they use (the autograd Functions, the nn.Modules and the functional
     wrappers) with thin shims around ours, which map Liger's argument names, positional order and return structure;
  3. it runs pytest there and writes a summary (--out): passed, failed and skipped per file, the skip reasons grouped,
     each failure's first line, the versions and the device.
No Liger file enters this repository: the tests are copied at run time. The liger_kernel package must be importable
(the tests import its utilities and the classes they compare), pinned to 0.8.5: --liger-wheel installs the wheel into
the scratch folder, offline.

What the shims map (Liger's name -> ours)
-----------------------------------------
- LigerRMSNormFunction, liger_rms_norm -> rmsnorm_kernel.rms_norm; LigerRMSNorm -> TritonRMSNorm. Liger's init_fn
  ("ones"/"zeros") sets the starting weight, whatever the offset (ours starts at 1 - offset). Liger's in_place
  default (True) is passed on.
- LigerSiLUMulFunction, liger_swiglu -> swiglu_kernel.swiglu (gate_multiplier in the kernel; down_multiplier is one
  torch multiply of the product, as our MLP applies it to its output); LigerSwiGLUMLP, LigerFalconH1SwiGLUMLP ->
  TritonLlamaMLP; LigerPhi3SwiGLUMLP -> TritonPhi3MLP.
- LigerRopeFunction, liger_rope, liger_rotary_pos_emb -> rope_kernel.apply_rotary_pos_emb. In Liger q and k are
  always [B, H, T, D] and unsqueeze_dim only names the axis of a 4-D cos to squeeze, so ours gets unsqueeze_dim=1;
  position_ids is unused there too. A rotary_dim narrower than the head is a failure (ours rotates whole heads).
- LigerCrossEntropyFunction, liger_cross_entropy, LigerCrossEntropyLoss -> cross_entropy_kernel.cross_entropy /
  TritonCrossEntropyLoss, with Liger's contract: the gradient written over the logits (inplace_backward=True), the
  targets range-checked (check_targets=True; an out-of-range target raises Liger's AssertionError, "out of
  bounds", carrying our message), the loss and z-loss returned in the logits' dtype (ours are fp32).
- LigerFusedLinearCrossEntropyFunction, liger_fused_linear_cross_entropy, LigerFusedLinearCrossEntropyLoss
  (called as (lin_weight, input, target, bias)) -> linear_cross_entropy_kernel.linear_cross_entropy /
  TritonLinearCrossEntropyLoss. chunk_mem_const, Liger's chunk-size knob, does not change results and is dropped.
- CrossEntropyOutput -> ours (the fields have the same names), so the tests' isinstance checks see our results.
The Functions' shims return Liger's 4-tuple (loss, z_loss, token_accuracy, predicted_tokens) from CE and linear CE.

Skipped on purpose (the reason names the category); everything else that differs fails
-------------------------------------------------------------------------------------
- [DTensor]: tensor-parallel inputs (torch.distributed.tensor); ours take plain tensors.
- [MoE]: Liger's Mixtral expert modules (LigerBlockSparseTop2MLP, LigerExperts); we have no MoE layers.
- [Liger-internal]: tests that launch Liger's own kernels or switch its launch paths, and calls that pick one of
  Liger's backends (ce_impl, ce_mode of the fused linear CE).
- [row_mode]: Liger's RMSNorm row_mode, a choice between two of its kernels.
Liger's own skips (bfloat16 where the device has none, CUDA-only paths) stay as Liger wrote them.
Guards: the original Liger Functions and Liger's backend dispatcher raise when reached, so a test that found a path
around the shims fails instead of passing on Liger's kernels. --break-shims turns every shim's result (and so its
gradients) into NaN: each test that looks at a value must then fail (a check that the shims are wired).

Running it
----------
Without a GPU the kernels run on Triton's CPU interpreter: slow, so --quick keeps the test cases whose integer
parameters (shapes) multiply to at most 2**20 (about 240 of the 524 cases, 5 minutes on a CPU). On a GPU box run
everything. That box has no network: where the git source is, export the test files as one archive into an ignored
folder of the checkout (runs/; an archive, so that no test file lies where pytest looks), then carry that folder and
the wheel (.whl/, ignored too) to the box and run there:
    python .ci/liger_op_tests.py --liger-src /path/to/Liger-Kernel.git --export runs/liger_tests.tar.gz
    python .ci/liger_op_tests.py --liger-src runs/liger_tests.tar.gz \\
        --liger-wheel .whl/liger_kernel-0.8.5-py3-none-any.whl --out runs/liger_op_tests.json
Arguments after `--` go to pytest (e.g. `-- -x`, or `-- -n 4` with pytest-xdist, under which the deselected count is
not reported). The exit code is 1 when a test failed or errored.
"""
import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIGER_VERSION = "0.8.5"  # the liger_kernel the project pins, and the tag whose tests are preferred
LIGER_REPOSITORY = "linkedin/Liger-Kernel"
# The five op test files, by op name (--ops), and the helpers they import or pytest loads beside them.
OP_TEST_FILES = {"rms_norm": "test/transformers/test_rms_norm.py",
                 "cross_entropy": "test/transformers/test_cross_entropy.py",
                 "fused_linear_cross_entropy": "test/transformers/test_fused_linear_cross_entropy.py",
                 "swiglu": "test/transformers/test_swiglu.py",
                 "rope": "test/transformers/test_rope.py"}
HELPER_FILES = ("test/__init__.py", "test/conftest.py", "test/utils.py")
OPTIONAL_HELPER_FILES = ("test/transformers/__init__.py",)  # absent in recent Liger trees
SOURCE_RECORD = "LIGER_SOURCE.json"  # what --export writes beside the files: where they came from
QUICK_MAX_ELEMENTS = 2 ** 20

# (test file, test function) -> (category, why): the tests that target what we deliberately do not have.
SKIPPED_TESTS = {
    ("test_rms_norm", "test_dtensor_rms_norm"): ("DTensor", "RMSNorm on tensor-parallel DTensor inputs"),
    ("test_swiglu", "test_dtensor_liger_silumul"): ("DTensor", "SwiGLU on tensor-parallel DTensor inputs"),
    ("test_swiglu", "test_correctness_mixtralblocksparsetop2mlp"): ("MoE", "Liger's Mixtral expert MLP "
                                                                    "(LigerBlockSparseTop2MLP)"),
    ("test_swiglu", "test_correctness_mixtralexperts"): ("MoE", "Liger's Mixtral experts module (LigerExperts)"),
    ("test_cross_entropy", "test_float32_internal"): ("Liger-internal", "launches Liger's liger_cross_entropy_kernel "
                                                      "directly"),
    ("test_swiglu", "test_swiglu_blackwell_tiled_matches_original"): ("Liger-internal", "switches Liger's SwiGLU "
                                                                      "launcher between its one-row and tiled "
                                                                      "kernels"),
}


# ----------------------------------------------------------------------------------------------------------------------
# 1. The adapter: shims around our kernels under Liger's names (runs inside pytest, loaded by the scratch conftest)
# ----------------------------------------------------------------------------------------------------------------------
# The Liger modules the five test files import from; each is imported before the names in it are replaced.
LIGER_MODULES = ("liger_kernel.ops", "liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu", "liger_kernel.ops.rope",
                 "liger_kernel.ops.cross_entropy", "liger_kernel.ops.fused_linear_cross_entropy",
                 "liger_kernel.transformers", "liger_kernel.transformers.functional",
                 "liger_kernel.transformers.rms_norm", "liger_kernel.transformers.swiglu",
                 "liger_kernel.transformers.rope", "liger_kernel.transformers.cross_entropy",
                 "liger_kernel.transformers.fused_linear_cross_entropy")
# (module, name): the objects the shims replace, wherever a liger_kernel module holds them.
REPLACED = (("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"), ("liger_kernel.ops", "LigerRMSNormFunction"),
            ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"), ("liger_kernel.ops", "LigerSiLUMulFunction"),
            ("liger_kernel.ops.rope", "LigerRopeFunction"), ("liger_kernel.ops", "LigerRopeFunction"),
            ("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction"),
            ("liger_kernel.ops", "LigerCrossEntropyFunction"),
            ("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction"),
            ("liger_kernel.ops", "LigerFusedLinearCrossEntropyFunction"),
            ("liger_kernel.transformers.rms_norm", "LigerRMSNorm"),
            ("liger_kernel.transformers.swiglu", "LigerSwiGLUMLP"),
            ("liger_kernel.transformers.swiglu", "LigerPhi3SwiGLUMLP"),
            ("liger_kernel.transformers.swiglu", "LigerFalconH1SwiGLUMLP"),
            ("liger_kernel.transformers.rope", "liger_rotary_pos_emb"),
            ("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss"),
            ("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss"),
            ("liger_kernel.transformers.functional", "liger_rms_norm"),
            ("liger_kernel.transformers.functional", "liger_swiglu"),
            ("liger_kernel.transformers.functional", "liger_rope"),
            ("liger_kernel.transformers.functional", "liger_cross_entropy"),
            ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
            ("liger_kernel.transformers.functional", "CrossEntropyOutput"))


def _make_shims(break_results):
    """The shims, by the Liger name they stand in for. Built on demand: they subclass our modules, whose files import
    torch and Triton. break_results=True makes every result NaN (--break-shims)."""
    import torch

    import cross_entropy_kernel
    import linear_cross_entropy_kernel
    import rmsnorm_kernel
    import rope_kernel
    import swiglu_kernel
    CrossEntropyOutput = cross_entropy_kernel.CrossEntropyOutput

    def result(t):
        return t * math.nan if break_results else t

    def skip_if_given(value, category, what):
        if value is not None:
            pytest.skip(f"[{category}] {what}")

    def check_activation(config):
        """Liger's MLPs refuse other activations, in these words."""
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Activation function {config.hidden_act} not supported.")

    # RMSNorm --------------------------------------------------------------------------------------------------------
    def rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        skip_if_given(row_mode, "row_mode", "Liger's RMSNorm row_mode chooses between two of its kernels")
        return result(rmsnorm_kernel.rms_norm(X, W, eps, offset, casting_mode, in_place))

    class LigerRMSNorm(rmsnorm_kernel.TritonRMSNorm):
        def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=True,
                     row_mode=None, elementwise_affine=True):
            skip_if_given(row_mode, "row_mode", "Liger's RMSNorm row_mode chooses between two of its kernels")
            if init_fn not in ("ones", "zeros"):
                raise ValueError(f"init_fn must be either 'ones' or 'zeros', got {init_fn}")
            super().__init__(hidden_size, eps, offset, casting_mode, in_place, elementwise_affine)
            if self.weight is not None:
                with torch.no_grad():
                    self.weight.fill_(1.0 if init_fn == "ones" else 0.0)

        def forward(self, hidden_states):
            return result(super().forward(hidden_states))

    # SwiGLU ---------------------------------------------------------------------------------------------------------
    def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        out = swiglu_kernel.swiglu(a, b, gate_multiplier=float(gate_multiplier))
        return result(out if down_multiplier == 1.0 else out * float(down_multiplier))

    class ResultChecked:
        """Mixed in before one of our MLP modules: its forward's output goes through result() like every shim's."""
        def forward(self, x):
            return result(super().forward(x))

    class LigerSwiGLUMLP(ResultChecked, swiglu_kernel.TritonLlamaMLP):
        def __init__(self, config, intermediate_size=None):
            check_activation(config)
            super().__init__(config.hidden_size,
                             config.intermediate_size if intermediate_size is None else intermediate_size)
            self.config = config

    class LigerFalconH1SwiGLUMLP(ResultChecked, swiglu_kernel.TritonLlamaMLP):
        def __init__(self, config):
            check_activation(config)
            gate_multiplier, down_multiplier = config.mlp_multipliers
            super().__init__(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False),
                             gate_multiplier=float(gate_multiplier), down_multiplier=float(down_multiplier))
            self.config = config

    class LigerPhi3SwiGLUMLP(ResultChecked, swiglu_kernel.TritonPhi3MLP):
        def __init__(self, config):
            check_activation(config)
            hidden, intermediate = config.hidden_size, config.intermediate_size
            super().__init__(torch.nn.Linear(hidden, 2 * intermediate, bias=False),
                             torch.nn.Linear(intermediate, hidden, bias=False))
            self.config = config

    # RoPE -----------------------------------------------------------------------------------------------------------
    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        if rotary_dim is not None and rotary_dim != q.shape[-1]:
            raise NotImplementedError(f"rotary_dim={rotary_dim} of a head of {q.shape[-1]}: rope_kernel.py rotates "
                                      f"whole heads (a model passes it the rotated slice)")
        q_embed, k_embed = rope_kernel.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        return result(q_embed), result(k_embed)

    # Cross-entropy --------------------------------------------------------------------------------------------------
    def as_fields(loss_or_output):
        """Our loss or CrossEntropyOutput as Liger's Functions return it: (loss, z_loss, accuracy, predicted)."""
        if isinstance(loss_or_output, CrossEntropyOutput):
            return tuple(loss_or_output)
        return loss_or_output, None, None, None

    def as_output(fields, wanted):
        """What Liger's functional wrappers and modules return: the loss alone, or a CrossEntropyOutput."""
        return CrossEntropyOutput(*fields) if wanted else fields[0]

    def in_logits_dtype(fields, dtype):
        """Liger's cross-entropy returns the loss and the z-loss in the logits' dtype; ours in fp32."""
        loss, z_loss, accuracy, predicted = fields
        return loss.to(dtype), None if z_loss is None else z_loss.to(dtype), accuracy, predicted

    def with_liger_target_error(call):
        """Liger refuses a target outside the vocabulary with an AssertionError that says "out of bounds"; ours with a
        ValueError naming the target and its position. The same refusal, raised as Liger's type."""
        try:
            return call()
        except ValueError as err:
            if "is outside [0," not in str(err):
                raise
            raise AssertionError(f"target out of bounds: {err}") from err

    def cross_entropy(_input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                      reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                      return_predicted_tokens=False):
        out = with_liger_target_error(lambda: cross_entropy_kernel.cross_entropy(
            _input, target, ignore_index, reduction, label_smoothing, inplace_backward=True, check_targets=True,
            weight=weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens))
        loss, *extras = in_logits_dtype(as_fields(out), _input.dtype)
        return (result(loss), *extras)

    def liger_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                            reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
                            return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False):
        # size_average and reduce: placeholders in Liger's signature too (torch's deprecated names), unused there.
        fields = cross_entropy(input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                               softcap, return_z_loss, return_token_accuracy, return_predicted_tokens)
        return as_output(fields, return_z_loss or return_token_accuracy or return_predicted_tokens)

    class LigerCrossEntropyLoss(cross_entropy_kernel.TritonCrossEntropyLoss):
        def __init__(self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                     reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                     return_predicted_tokens=False):
            super().__init__(ignore_index, reduction, label_smoothing, inplace_backward=True, check_targets=True,
                             weight=weight, lse_square_scale=lse_square_scale, softcap=softcap,
                             return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                             return_predicted_tokens=return_predicted_tokens)

        def forward(self, _input, target):
            out = with_liger_target_error(lambda: super(LigerCrossEntropyLoss, self).forward(_input, target))
            loss, *extras = in_logits_dtype(as_fields(out), _input.dtype)
            return as_output((result(loss), *extras),
                             self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens)

    # Fused linear cross-entropy -------------------------------------------------------------------------------------
    def linear_cross_entropy(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                             lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                             return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                             return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None, ce_mode=None,
                             chunk_mem_const=1):
        skip_if_given(ce_impl, "Liger-internal", "ce_impl picks one of Liger's cross-entropy backends")
        skip_if_given(ce_mode, "Liger-internal", "ce_mode picks one of Liger's cross-entropy kernel variants")
        out = linear_cross_entropy_kernel.linear_cross_entropy(
            _input, weight, target, bias, ignore_index, reduction, label_smoothing, ce_weight=ce_weight,
            lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens,
            accum_dtype=accum_dtype, use_token_scaling=use_token_scaling)
        loss, *extras = as_fields(out)
        return (result(loss), *extras)

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                         return_token_accuracy=False, return_predicted_tokens=False,
                                         chunk_mem_const=1):
        fields = linear_cross_entropy(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                                      label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
                                      use_token_scaling, return_token_accuracy, return_predicted_tokens)
        return as_output(fields, return_z_loss or return_token_accuracy or return_predicted_tokens)

    class LigerFusedLinearCrossEntropyLoss(linear_cross_entropy_kernel.TritonLinearCrossEntropyLoss):
        def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                     reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                     return_token_accuracy=False, return_predicted_tokens=False):
            super().__init__(ignore_index, reduction, label_smoothing, ce_weight=ce_weight,
                             lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                             return_token_accuracy=return_token_accuracy,
                             return_predicted_tokens=return_predicted_tokens, accum_dtype=accum_dtype,
                             use_token_scaling=use_token_scaling)

        def forward(self, lin_weight, _input, target, bias=None):  # Liger's order: the weight first
            loss, *extras = as_fields(super().forward(_input, lin_weight, target, bias))
            return as_output((result(loss), *extras),
                             self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens)

    def function(name, apply):
        """A stand-in for one of Liger's autograd Functions: only .apply is used, and ours are differentiable."""
        return type(name, (), {"apply": staticmethod(apply), "__doc__": f"Liger's {name}.apply, on our kernels."})

    return {"LigerRMSNormFunction": function("LigerRMSNormFunction", rms_norm), "LigerRMSNorm": LigerRMSNorm,
            "liger_rms_norm": lambda X, W, eps, offset=0.0, casting_mode="llama", in_place=True: rms_norm(
                X, W, eps, offset, casting_mode, in_place),
            "LigerSiLUMulFunction": function("LigerSiLUMulFunction", silu_mul),
            "liger_swiglu": lambda a, b: silu_mul(a, b), "LigerSwiGLUMLP": LigerSwiGLUMLP,
            "LigerPhi3SwiGLUMLP": LigerPhi3SwiGLUMLP, "LigerFalconH1SwiGLUMLP": LigerFalconH1SwiGLUMLP,
            "LigerRopeFunction": function("LigerRopeFunction", rope), "liger_rope": rope,
            "liger_rotary_pos_emb": rope,
            "LigerCrossEntropyFunction": function("LigerCrossEntropyFunction", cross_entropy),
            "liger_cross_entropy": liger_cross_entropy, "LigerCrossEntropyLoss": LigerCrossEntropyLoss,
            "LigerFusedLinearCrossEntropyFunction": function("LigerFusedLinearCrossEntropyFunction",
                                                             linear_cross_entropy),
            "liger_fused_linear_cross_entropy": liger_fused_linear_cross_entropy,
            "LigerFusedLinearCrossEntropyLoss": LigerFusedLinearCrossEntropyLoss,
            "CrossEntropyOutput": CrossEntropyOutput}


def _liger_modules():
    return [module for name, module in list(sys.modules.items())
            if module is not None and (name == "liger_kernel" or name.startswith("liger_kernel."))]


def _replace_everywhere(original, replacement):
    """Point every name in a loaded liger_kernel module that holds `original` (the object itself: `from x import y`
    copies the reference into each importer) at `replacement`; returns how many."""
    count = 0
    for module in _liger_modules():
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, replacement)
                count += 1
    return count


def install_adapter(break_results=False):
    """Replace Liger's entry points with the shims, then make Liger's own kernels unreachable: the original Functions'
    forward and Liger's backend dispatcher raise. Returns {Liger name: how many references were replaced}."""
    import importlib

    for name in LIGER_MODULES:
        importlib.import_module(name)
    shims = _make_shims(break_results)
    originals = {}  # id -> (original, Liger name); one original may sit under several (module, name) pairs
    for module_name, name in REPLACED:
        original = getattr(sys.modules[module_name], name)
        originals[id(original)] = (original, name)
    replaced = {}
    for original, name in originals.values():
        replaced[name] = replaced.get(name, 0) + _replace_everywhere(original, shims[name])

    def unreachable(what):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"liger_op_tests: Liger's own {what} was reached: a path of this test goes around the "
                               f"shims to Liger's kernels")
        return refuse

    for original, name in originals.values():
        if isinstance(original, type) and hasattr(original, "forward") and name.endswith("Function"):
            original.forward = staticmethod(unreachable(f"{name}.forward"))
    dispatch_module = importlib.import_module("liger_kernel.backends.dispatch")
    _replace_everywhere(dispatch_module.dispatch, unreachable("backend dispatcher (liger_kernel.backends.dispatch)"))
    return replaced


# ----------------------------------------------------------------------------------------------------------------------
# 2. The pytest hooks (active when the scratch conftest loads this file as a plugin)
# ----------------------------------------------------------------------------------------------------------------------
_RESULTS = {}  # nodeid -> {"outcome", "message"}
_STATE = {"deselected": 0, "replaced": {}}


def pytest_addoption(parser):
    group = parser.getgroup("liger_op_tests", "Liger-Kernel's op tests on our kernels (.ci/liger_op_tests.py)")
    group.addoption("--liger-report", default=None, help="write each test's outcome to this JSON file")
    group.addoption("--liger-quick", action="store_true",
                    help=f"keep only the cases whose integer parameters multiply to <= {QUICK_MAX_ELEMENTS}")
    group.addoption("--liger-break-shims", action="store_true", help="make every shim's result NaN (self-check)")


def pytest_configure(config):
    _STATE["replaced"] = install_adapter(config.getoption("liger_break_shims"))


def _case_elements(item):
    """The product of a test case's positive integer parameters (its shapes), ignore_index left out."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    sizes = [value for name, value in params.items()
             if isinstance(value, int) and not isinstance(value, bool) and value > 0 and name != "ignore_index"]
    return math.prod(sizes)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("liger_quick"):
        return
    kept = [item for item in items if _case_elements(item) <= QUICK_MAX_ELEMENTS]
    dropped = [item for item in items if _case_elements(item) > QUICK_MAX_ELEMENTS]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_deselected(items):
    _STATE["deselected"] += len(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before pytest's own skipif/xfail evaluation (also tryfirst, but registered earlier, so called later): these
    # reasons win over Liger's marks on the same tests.
    key = (item.path.stem, getattr(item, "originalname", item.name))
    if key in SKIPPED_TESTS:
        category, why = SKIPPED_TESTS[key]
        pytest.skip(f"[{category}] {why}")


def _first_lines(text, lines=2, limit=400):
    return "\n".join(str(text).strip().splitlines()[:lines])[:limit]


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":  # pytest-rerunfailures' earlier tries of a flaky-marked test
        return
    if report.when != "call" and report.passed:
        return
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed" if report.passed else "failed"
        message = report.wasxfail
    elif report.skipped:
        outcome = "skipped"
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        message = message.removeprefix("Skipped: ")
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else (report.longreprtext.strip().splitlines() or [""])[-1]
    else:
        outcome, message = "passed", ""
    entry = _RESULTS.get(report.nodeid)
    # The first failure of a test stays (a teardown error does not replace it); an error after a pass replaces it.
    if entry is None or entry["outcome"] not in ("failed", "error") and outcome != "passed":
        _RESULTS[report.nodeid] = {"outcome": outcome, "message": _first_lines(message)}


def pytest_collectreport(report):
    if report.failed:  # a test file that does not import: every case in it is lost, which must show
        _RESULTS[report.nodeid or "<collection>"] = {"outcome": "error",
                                                     "message": _first_lines(report.longreprtext.strip()
                                                                             .splitlines()[-1], 1)}


def _environment():
    import importlib.metadata

    import torch
    import transformers
    import triton

    import liger_kernel
    try:
        liger_version = importlib.metadata.version("liger_kernel")
    except importlib.metadata.PackageNotFoundError:
        liger_version = "unknown"
    device = (f"cuda: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
              else "cpu (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu")
    return {"device": device, "python": sys.version.split()[0], "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "liger_kernel": liger_version,
            "liger_kernel_path": str(Path(liger_kernel.__file__).parent)}


def pytest_sessionfinish(session):
    path = session.config.getoption("liger_report")
    if path is None or hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller writes
        return
    report = {"environment": _environment(), "replaced": _STATE["replaced"], "deselected": _STATE["deselected"],
              "results": _RESULTS}
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------------------
# 3. The Liger source: a git directory (files read at a tag or commit), a work tree, or an --export archive
# ----------------------------------------------------------------------------------------------------------------------
def _git(git_dir, *args):
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True)


class LigerSource:
    """Reads Liger's test files from `path`: an archive written by --export, a work tree (a folder holding
    test/transformers/), else a git directory, read at `rev` (default: the pinned version's tag when the source has
    it, else HEAD)."""

    def __init__(self, path, rev=None):
        self.path = Path(path).resolve()
        self.kind = ("archive" if self.path.is_file() and tarfile.is_tarfile(self.path)
                     else "folder" if (self.path / "test" / "transformers").is_dir() else "git")
        if self.kind != "git" and rev is not None:
            raise SystemExit(f"--rev applies to a git directory; {self.path} is a {self.kind}")
        if self.kind == "archive":
            with tarfile.open(self.path) as archive:
                self.members = {member.name: archive.extractfile(member).read()
                                for member in archive.getmembers() if member.isfile()}
            self.provenance = json.loads(self.members.get(SOURCE_RECORD, b'{"rev": "unknown"}'))
        elif self.kind == "folder":
            commit = subprocess.run(["git", "-C", str(self.path), "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
            self.provenance = {"repository": LIGER_REPOSITORY, "rev": "work tree", "commit": commit or None}
        else:
            if _git(self.path, "rev-parse", "--git-dir").returncode != 0:
                raise SystemExit(f"--liger-src {self.path}: not an --export archive, a folder with test/transformers/ "
                                 f"or a git directory")
            tag, note = f"v{LIGER_VERSION}", None
            if rev is None:
                tagged = _git(self.path, "rev-parse", "--verify", "-q", f"refs/tags/{tag}").returncode == 0
                rev, note = (tag, None) if tagged else ("HEAD", f"the source has no tag {tag}: tests taken at HEAD")
            commit = _git(self.path, "rev-parse", "--verify", f"{rev}^{{commit}}")
            if commit.returncode != 0:
                raise SystemExit(f"--rev {rev}: not a commit of {self.path}")
            self.commit = commit.stdout.strip()
            commit_line = _git(self.path, "log", "-1", "--format=%cs %s", self.commit).stdout.strip()
            self.provenance = {"repository": LIGER_REPOSITORY, "rev": rev, "commit": self.commit,
                               "commit_line": commit_line,
                               "note": note}

    def read(self, relpath):
        """The file's bytes, or None when the source lacks it."""
        if self.kind == "archive":
            return self.members.get(relpath)
        if self.kind == "folder":
            file = self.path / relpath
            return file.read_bytes() if file.is_file() else None
        shown = subprocess.run(["git", f"--git-dir={self.path}", "show", f"{self.commit}:{relpath}"],
                               capture_output=True)
        return shown.stdout if shown.returncode == 0 else None

    def files(self):
        """{relative path: bytes} of the test files and helpers."""
        found = {}
        for relpath in (*HELPER_FILES, *OP_TEST_FILES.values(), *OPTIONAL_HELPER_FILES):
            data = self.read(relpath)
            if data is None and relpath not in OPTIONAL_HELPER_FILES:
                raise SystemExit(f"the Liger source {self.path} has no {relpath}")
            if data is not None:
                found[relpath] = data
        return found

    def copy_to(self, folder):
        """Write the test files and helpers under folder, at the same relative paths."""
        for relpath, data in self.files().items():
            target = Path(folder) / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def export(self, archive_path):
        """Write the test files and helpers, with SOURCE_RECORD (where they came from), into one .tar.gz."""
        files = self.files()
        record = json.dumps({**self.provenance, "files": list(files)}, indent=1).encode() + b"\n"
        Path(archive_path).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive_path, "w:gz") as archive:
            for name, data in {**files, SOURCE_RECORD: record}.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), time.time()
                archive.addfile(info, io.BytesIO(data))
        return list(files)


# ----------------------------------------------------------------------------------------------------------------------
# 4. The command line: scratch folder, pytest run, summary
# ----------------------------------------------------------------------------------------------------------------------
CONFTEST = '''"""Written by .ci/liger_op_tests.py: loads its adapter, a pytest plugin, before Liger's tests import."""
import os
import sys

sys.path[:0] = {paths!r}
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

# Our kernel modules switch Triton to its CPU interpreter themselves, but only if nothing decorated a Triton
# function before them; Liger's modules are imported first here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest_plugins = ["liger_op_tests"]
'''
PYTEST_INI = """[pytest]
addopts = -ra -p no:cacheprovider
filterwarnings =
    ignore::DeprecationWarning
"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="liger_op_tests.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--liger-src", required=True,
                        help="Liger-Kernel's source: a git directory, a work tree, or an archive written by "
                             "--export")
    parser.add_argument("--rev", default=None,
                        help=f"for a git directory: the tag or commit to take the tests from (default: v{LIGER_VERSION}"
                             f" when the source has that tag, else HEAD)")
    parser.add_argument("--export", metavar="ARCHIVE", default=None,
                        help=f"only write the test files and helpers (with {SOURCE_RECORD}) into this .tar.gz, to "
                             f"carry them to a machine without network, then stop")
    parser.add_argument("--liger-wheel", default=None,
                        help=f"install this liger_kernel wheel (the project pins {LIGER_VERSION}) into the scratch "
                             f"folder, offline, and test with it")
    parser.add_argument("--liger-site", default=None,
                        help="a folder where liger_kernel is already installed (pip install --target); without this "
                             "or --liger-wheel, the environment's liger_kernel")
    parser.add_argument("--ops", default=",".join(OP_TEST_FILES),
                        help="comma-separated ops whose test files run (default: all five)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression, to select test cases")
    parser.add_argument("--quick", action="store_true",
                        help=f"only the cases whose shape parameters multiply to <= {QUICK_MAX_ELEMENTS} (for the "
                             f"CPU interpreter)")
    parser.add_argument("--break-shims", action="store_true",
                        help="self-check: every shim's result becomes NaN; each test that looks at a value must "
                             "fail")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "liger_op_tests"),
                        help="scratch folder for the copied tests, emptied first; outside the checkout, where the "
                             "repository's pytest run would collect them (default: %(default)s)")
    parser.add_argument("--out", default=str(REPO / "runs" / "liger_op_tests.json"),
                        help="where the summary JSON goes (default: %(default)s)")
    parser.add_argument("pytest_args", nargs="*", help="after `--`: more arguments for pytest (e.g. -x, -n 4)")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OP_TEST_FILES]
    if unknown or not ops:
        parser.error(f"--ops: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(OP_TEST_FILES)}")
    args.ops = ops
    return args


def _install_wheel(wheel, site):
    """pip install --no-deps --target site wheel, without an index (the GPU box has no network)."""
    if site.exists():
        shutil.rmtree(site)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(wheel)], check=True)


def _our_commit():
    """This checkout's HEAD (+uncommitted where tracked files changed); GIT_COMMIT and GIT_DIRTY, where set, name the
    commit of a copied tree instead, as the fine-tune scripts read them (a copy on a GPU box may carry a stale .git)."""
    if "GIT_COMMIT" in os.environ:
        return os.environ["GIT_COMMIT"] + ("+uncommitted" if os.environ.get("GIT_DIRTY", "0") != "0" else "")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (head.stdout.strip() + ("+uncommitted" if dirty else "")) or None


def summarize(raw, ops, source, args, elapsed_s, returncode):
    """The summary: counts per file and in total, the skip reasons grouped (with their category), failures."""
    outcomes = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    per_file = {Path(OP_TEST_FILES[op]).name: dict.fromkeys(outcomes, 0) for op in ops}
    skip_reasons, failures = {}, []
    for nodeid, entry in sorted(raw["results"].items()):
        counts = per_file.setdefault(Path(nodeid.split("::")[0]).name, dict.fromkeys(outcomes, 0))
        counts[entry["outcome"]] += 1
        if entry["outcome"] == "skipped":
            skip_reasons[entry["message"]] = skip_reasons.get(entry["message"], 0) + 1
        elif entry["outcome"] in ("failed", "error", "xpassed"):
            failures.append({"test": nodeid, "outcome": entry["outcome"], "message": entry["message"]})
    totals = {outcome: sum(counts[outcome] for counts in per_file.values()) for outcome in outcomes}
    totals["deselected"] = raw["deselected"]
    categories = {}
    for reason, count in skip_reasons.items():
        category = reason[1:reason.index("]")] if reason.startswith("[") and "]" in reason else "Liger's own skip"
        categories[category] = categories.get(category, 0) + count
    return {"what": "Liger-Kernel's op tests run against our kernels (.ci/liger_op_tests.py)",
            "liger_tests": source.provenance, "environment": raw["environment"], "our_commit": _our_commit(),
            "options": {"ops": ops, "k": args.keyword, "quick": args.quick, "break_shims": args.break_shims,
                        "pytest_args": args.pytest_args},
            "replaced": raw["replaced"], "totals": totals, "per_file": per_file,
            "skip_categories": dict(sorted(categories.items())),
            "skip_reasons": dict(sorted(skip_reasons.items(), key=lambda kv: -kv[1])), "failures": failures,
            "elapsed_s": round(elapsed_s, 1), "pytest_exit_code": returncode}


def print_summary(summary, out):
    env, source = summary["environment"], summary["liger_tests"]
    print(f"\nLiger-Kernel op tests on our kernels | {env['device']} | torch {env['torch']} | triton {env['triton']} | "
          f"transformers {env['transformers']} | liger_kernel {env['liger_kernel']}")
    print(f"Liger tests: {source.get('repository')} {source.get('rev')} = {source.get('commit')}"
          + (f" ({source['note']})" if source.get("note") else ""))
    columns = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    print(f"{'file':40s}" + "".join(f"{c:>9s}" for c in columns))
    for name, counts in summary["per_file"].items():
        print(f"{name:40s}" + "".join(f"{counts[c]:9d}" for c in columns))
    totals = summary["totals"]
    print(f"{'total':40s}" + "".join(f"{totals[c]:9d}" for c in columns)
          + (f"   ({totals['deselected']} deselected)" if totals["deselected"] else ""))
    if summary["skip_reasons"]:
        print("Skipped, by reason:")
        for reason, count in summary["skip_reasons"].items():
            print(f"  {count:5d}  {reason}")
    if summary["failures"]:
        print("Failed:")
        for failure in summary["failures"]:
            print(f"  {failure['test']}\n      {failure['message'].splitlines()[0] if failure['message'] else ''}")
    print(f"{summary['elapsed_s']} s; summary: {out}")


def main(argv=None):
    args = parse_args(argv)
    source = LigerSource(args.liger_src, args.rev)
    if args.export:
        written = source.export(args.export)
        print(f"{len(written)} files of {LIGER_REPOSITORY} {source.provenance.get('rev')} "
              f"({source.provenance.get('commit')}) -> {args.export}")
        return 0
    workdir = Path(args.workdir).resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    source.copy_to(workdir)
    site = None
    if args.liger_wheel:
        site = workdir / "site"
        _install_wheel(Path(args.liger_wheel).resolve(), site)
    elif args.liger_site:
        site = Path(args.liger_site).resolve()
    paths = [str(p) for p in (site, Path(__file__).resolve().parent, REPO) if p is not None]
    (workdir / "conftest.py").write_text(CONFTEST.format(paths=paths))
    (workdir / "pytest.ini").write_text(PYTEST_INI)
    raw_path = workdir / "outcomes.json"
    command = [sys.executable, "-m", "pytest", *(OP_TEST_FILES[op] for op in args.ops), f"--liger-report={raw_path}"]
    command += ["--liger-quick"] * args.quick + ["--liger-break-shims"] * args.break_shims
    command += ["-k", args.keyword] if args.keyword else []
    command += args.pytest_args
    print(f"Liger tests: {source.provenance.get('rev')} = {source.provenance.get('commit')} from {source.path}")
    print(f"in {workdir}: {' '.join(command[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    start = time.perf_counter()
    returncode = subprocess.run(command, cwd=workdir, env=env).returncode
    if not raw_path.is_file():
        print(f"pytest exited with {returncode} before the adapter wrote its report", file=sys.stderr)
        return returncode or 1
    summary = summarize(json.loads(raw_path.read_text()), args.ops, source, args, time.perf_counter() - start,
                        returncode)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary, args.out)
    totals = summary["totals"]
    return 1 if totals["failed"] or totals["error"] or totals["xpassed"] or returncode not in (0, 1, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
