"""distmuon: the Muon optimizer as cheap as AdamW in distributed training.

The C++ engine is exposed as :mod:`distmuon._C` (types only); the PyTorch optimizer is
:class:`distmuon.torch.Muon`.
"""

try:
    from distmuon._C import Error, TimeoutError, __version__, cuda_available
except ImportError as e:
    # A CUDA build needs libcudart, cuBLASLt and NCCL. In a PyTorch environment they come with
    # torch's wheels and are found once torch has loaded them (the extension binds to those
    # copies); elsewhere they must be on the loader's path.
    if "cannot open shared object file" not in str(e):
        raise
    import torch

    del torch  # only its libraries were wanted

    from distmuon._C import Error, TimeoutError, __version__, cuda_available

__all__ = ["Error", "TimeoutError", "__version__", "cuda_available"]
