"""Where a run's math happens (--device), and the moves into and out of it.

Whatever one stage hands to the next stays in host memory: statistics, refinement samples, fits, the tensors
written. A stage moves what it computes on to the device, works there, and hands back host copies. So --device
cuda changes where the work runs, and nothing of what is kept, spilled to disk or written.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")
Device = torch.device | str  # "cpu", "cuda", "cuda:1", or a torch.device


def moved(value, device: Device | None = None, dtype: torch.dtype | None = None):
    """`value` with every tensor in it (in tuples, lists and dicts too) on `device` (None: where it is), the
    floating ones also cast to `dtype` where one is given. Tensors already so are returned as they are, not
    copied."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=cast)
    if isinstance(value, (tuple, list)):
        return type(value)(moved(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: moved(item, device, dtype) for key, item in value.items()}
    return value


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `tensor` in host memory that owns its storage: never a view into a batch that is dropped
    later, wherever the batch lives."""
    return tensor.detach().to(device=HOST, dtype=dtype or tensor.dtype, copy=True)


def unavailable(device: str) -> str | None:
    """Why `device` ("cpu", "cuda", "cuda:N") cannot be used here, in a line; None where it can."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"--device {device} was asked for, but torch sees no CUDA device here"
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        return (f"--device {device} was asked for, but torch sees {count} CUDA device(s) here: "
                f"cuda:0 to cuda:{count - 1}")
    return None


def training_products(device: Device) -> torch.dtype:
    """The dtype a refinement step's matrix products run in on `device`: bfloat16 where the hardware multiplies
    it natively, float32 elsewhere (an emulated bfloat16 product is slower than float32's). Measured on a CPU
    with AVX512-BF16: the attention's batched product in a third of float32's time, a CP layer's refinement
    25-40% faster, and all-MiniLM-L6-v2's held-out KL after refinement the same to 1e-5. Held-out checks, which
    choose the state kept, stay in float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no native bfloat16 products
        native = False
    return torch.bfloat16 if device.type == "cpu" and native else torch.float32


def pass_dtype(device: Device, stored: torch.dtype) -> torch.dtype:
    """The dtype a calibration pass runs weights stored in `stored` in on `device`: their own, as transformers
    runs a checkpoint by default, where the device multiplies it natively (bfloat16 with AVX512-BF16, AMX or a
    GPU; float16 on a GPU); float32 elsewhere (an emulated half-precision product is several times slower).
    Measured on SmolLM2-135M stored in bfloat16 (2 cores with AVX512-BF16): a plain pass over 300 documents took
    38-41 s in bfloat16, the same pass in float32 about twice that."""
    if stored == torch.bfloat16 and training_products(device) == torch.bfloat16:
        return torch.bfloat16
    if stored == torch.float16 and torch.device(device).type == "cuda":
        return torch.float16
    return torch.float32


def floating_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of `module`'s first floating parameter (float32 where it has none): what a checkpoint loaded in
    its own dtype stores."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def in_pass_dtype(module: torch.nn.Module, device: Device) -> torch.nn.Module:
    """`module` (a model loaded in its own dtype, or a block) made ready for a pass on `device`: left in its dtype
    where pass_dtype keeps it, else cast to float32 in place. nn.Module's own float(): transformers refuses its
    override on models loaded through a quantizer (ours); on meta parameters the cast is free."""
    if pass_dtype(device, floating_dtype(module)) == torch.float32:
        torch.nn.Module.float(module)
    return module
