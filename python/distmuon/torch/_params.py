"""Which parameters get Muon, and how each one is seen as matrices by the engine.

Muon is for the hidden-layer matrices. Embeddings and the output head are conventionally left to
AdamW (Keller Jordan; Moonlight), as are vectors and scalars. Without a model the only clue is a
parameter's name; with a model, nn.Embedding/nn.EmbeddingBag and convolution modules are
recognised by type.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from distmuon.torch._dist import is_dtensor, local_tensor

MuonFilter = Callable[[str, torch.Tensor], bool]

# Owning-module names that mean "embedding" or "output head" in common model code
# (GPT-2: wte, wpe, lm_head; Llama: embed_tokens, output; timm: head).
_HEAD_NAMES = frozenset({"wte", "wpe", "lm_head", "head", "output"})
_PARAMETRIZED = re.compile(r"\.parametrizations\.([^.]+)\.original\d*$")


def is_embedding_or_head_name(name: str) -> bool:
    """True when the module that owns parameter `name` looks like an embedding or output head.

    Only the owning module (the component before the attribute) is looked at, so that
    'encoder.layer.0.attention.output.dense.weight' (a hidden layer) is not caught by 'output'.
    """
    # A parametrized weight (torch.nn.utils.parametrize: spectral_norm, weight_norm) is stored as
    # '<module>.parametrizations.<attr>.original[N]': its owner is <module>.
    name = _PARAMETRIZED.sub(r".\1", name)
    parts = name.lower().split(".")
    owner = parts[-2] if len(parts) >= 2 else parts[0]
    owner = re.sub(r"_?\d+$", "", owner)  # 'head_0' -> 'head'
    return "embed" in owner or owner in _HEAD_NAMES


@dataclass
class ParamInfo:
    """What the optimizer knows about one parameter besides the tensor."""

    name: str
    named: bool  # the name came from the user or the model (not made up)
    embedding: bool = False  # owned by nn.Embedding / nn.EmbeddingBag
    conv: bool = False  # owned by a convolution: (out, in, *kernel) is one out x (in*k) matrix


def module_param_infos(model: nn.Module) -> dict[int, ParamInfo]:
    """ParamInfo per id(param) for every parameter of `model`, named as named_parameters()."""
    infos = {id(p): ParamInfo(name, True) for name, p in model.named_parameters()}
    for module in model.modules():
        # (attribute, parameter) pairs the module owns; a parametrized attribute's originals
        # (spectral_norm, weight_norm) count as the attribute itself.
        owned = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if parametrize.is_parametrized(module):
            for attr, plist in module.parametrizations.items():
                owned += [(attr, p) for p in plist.parameters(recurse=False)]
        for attr, p in owned:
            info = infos.get(id(p))
            if info is None:
                continue
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                info.embedding = True
            if isinstance(module, nn.modules.conv._ConvNd) and attr == "weight":
                info.conv = True
    return infos


def default_muon_filter(name: str, param: torch.Tensor, info: ParamInfo | None = None) -> bool:
    """The default choice: matrices (2D and up, both sides > 1) that are not embeddings or the
    output head. A (1, 1, d) token or (d, 1) column is a vector in disguise and gets AdamW."""
    if param.ndim < 2:
        return False
    if info is not None and info.embedding:
        return False
    rows, cols = matrix_shape(param, info.conv if info else False)[-2:]
    if rows == 1 or cols == 1:
        return False
    return not is_embedding_or_head_name(name)


def matrix_shape(param: torch.Tensor, conv: bool) -> list[int]:
    """The shape the engine registers for a Muon parameter.

    2D stays as is; a convolution kernel (out, in, *kernel) becomes out x (in * prod(kernel));
    any other 3D tensor is a batch of matrices (stacked experts, per-head weights); 4D and up
    without a model to tell are taken as convolution kernels.
    """
    shape = list(param.shape)
    if len(shape) == 2 or (len(shape) == 3 and not conv):
        return shape
    return [shape[0], math.prod(shape[1:])]


def check_tensor_param(param: object, name: str) -> torch.Tensor:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"parameter '{name}' is a {type(param).__name__}, not a torch.Tensor")
    if param.is_complex():
        raise TypeError(f"parameter '{name}' is complex ({param.dtype}); distmuon handles real tensors only")
    if param.layout != torch.strided:
        raise TypeError(f"parameter '{name}' has layout {param.layout}; distmuon needs dense tensors")
    if not param.is_floating_point():
        raise TypeError(f"parameter '{name}' has dtype {param.dtype}; distmuon needs a float dtype")
    if param.numel() == 0:
        raise ValueError(f"parameter '{name}' is empty (shape {tuple(param.shape)})")
    local = local_tensor(param) if is_dtensor(param) else param
    if param.requires_grad and not local.is_contiguous():
        raise ValueError(
            f"parameter '{name}' is not contiguous (shape {tuple(local.shape)}, strides {local.stride()}): "
            "the engine updates parameters in place in row-major memory. A channels_last model "
            "(model.to(memory_format=torch.channels_last)) makes its convolution weights so: keep the "
            "weights contiguous (convert the inputs to channels_last only), or make them contiguous "
            "again before building the optimizer"
        )
    return param


def split_named(entries: Iterable[object]) -> tuple[list[torch.Tensor], list[str] | None]:
    """Params and names from a list of tensors or of (name, tensor) pairs (not mixed)."""
    params: list[torch.Tensor] = []
    names: list[str] = []
    for e in entries:
        if isinstance(e, tuple):
            if len(e) != 2 or not isinstance(e[0], str):
                raise TypeError(f"named parameters must be (str, Tensor) pairs (got {e!r:.80})")
            names.append(e[0])
            params.append(e[1])
        else:
            params.append(e)  # type: ignore[arg-type]
    if names and len(names) != len(params):
        raise ValueError("all parameters must be named, or none (got a mix of (name, tensor) and tensors)")
    return params, (names or None)


RowBlocks = dict[str, int]


def check_row_blocks(row_blocks: object) -> RowBlocks:
    """``row_blocks``: name pattern (fnmatch) -> number of equal row blocks."""
    if row_blocks is None:
        return {}
    if not isinstance(row_blocks, dict):
        raise TypeError(f"row_blocks must be a dict of name pattern -> number of row blocks (got {row_blocks!r:.80})")
    for pattern, k in row_blocks.items():
        if not isinstance(pattern, str):
            raise TypeError(f"row_blocks keys are parameter name patterns (got {pattern!r})")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise TypeError(
                f"row_blocks['{pattern}'] must be a number of equal row blocks (got {k!r}); blocks of "
                "different sizes (a GQA q, k, v) are not supported: give the rows of one head per block"
            )
    return dict(row_blocks)


def row_blocks_of(name: str, row_blocks: RowBlocks) -> int:
    """How many equal row blocks `row_blocks` cuts parameter `name` into (1: none); the first
    matching pattern counts."""
    return next((k for pattern, k in row_blocks.items() if fnmatch.fnmatchcase(name, pattern)), 1)


def blocked_shape(name: str, shape: list[int], blocks: int) -> list[int]:
    """The engine's shape of a matrix cut into `blocks` equal row blocks: a batch of them."""
    if blocks == 1:
        return shape
    if len(shape) != 2:
        raise ValueError(
            f"row_blocks cuts '{name}' (shape {tuple(shape)}), but only a 2D matrix can be cut into row blocks"
        )
    if shape[0] % blocks:
        raise ValueError(
            f"row_blocks cuts '{name}' ({shape[0]} rows) into {blocks} blocks, which do not divide its rows"
        )
    return [blocks, shape[0] // blocks, shape[1]]
