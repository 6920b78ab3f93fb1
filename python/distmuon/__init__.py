"""distmuon: the Muon optimizer as cheap as AdamW in distributed training.

The C++ engine is exposed as :mod:`distmuon._C` (types only); the PyTorch optimizer is
:class:`distmuon.torch.Muon`.
"""

from distmuon._C import Error, TimeoutError, __version__, cuda_available

__all__ = ["Error", "TimeoutError", "__version__", "cuda_available"]
