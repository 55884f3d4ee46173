"""Named fused elementwise ops, each a traced expression (cupyops.fuse): bias + activation,
gated linear units, and the residual branch's bias + dropout + add. One kernel each; operands
broadcast and promote as in NumPy (a `(cols,)` bias over `(rows, cols)` activations)."""
from __future__ import annotations

from .. import fx
from .elementwise import fuse

APPROXIMATIONS = ("none", "tanh")


@fuse
def _bias_gelu(x, bias):
    return fx.gelu(x + bias)


@fuse
def _bias_gelu_tanh(x, bias):
    return fx.gelu_tanh(x + bias)


@fuse
def _bias_silu(x, bias):
    return fx.silu(x + bias)


@fuse
def _swiglu(a, b):
    return fx.silu(a) * b


@fuse
def _geglu(a, b):
    return fx.gelu(a) * b


@fuse
def _geglu_tanh(a, b):
    return fx.gelu_tanh(a) * b


@fuse
def _bias_dropout_add(x, bias, residual, p, seed, offset):
    return residual + fx.dropout(x + bias, p, seed, offset)


# The fused function of each approximation, per op: a named op's call is a lookup and its
# fused function's call (traced and planned once per signature).
_BIAS_GELU = dict(zip(APPROXIMATIONS, (_bias_gelu, _bias_gelu_tanh)))
_GEGLU = dict(zip(APPROXIMATIONS, (_geglu, _geglu_tanh)))


def _gelu_variant(variants: dict, approximate: str):
    try:
        return variants[approximate]
    except (KeyError, TypeError):
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}") from None


def named_function(op: str, approximate: str = "none"):
    """The fused function (cupyops.fuse) behind the named op `op`, of the approximation for
    bias_gelu and geglu: its operands the op's, in order (cupyops.torch calls it on tensors)."""
    if op == "bias_gelu" or op == "geglu":
        return _gelu_variant(_BIAS_GELU if op == "bias_gelu" else _GEGLU, approximate)
    if op == "swiglu":
        return _swiglu
    if op == "bias_silu":
        return _bias_silu
    if op == "bias_dropout_add":
        return _bias_dropout_add
    raise ValueError(f"no named elementwise op {op!r}")


def bias_gelu(x, bias, approximate: str = "none", *, out=None, policy: str = "auto", stream=None):
    """gelu(x + bias) in one kernel: torch.nn.functional.gelu(x + bias, approximate=approximate)."""
    return _gelu_variant(_BIAS_GELU, approximate).call((x, bias), out, policy, stream)


def bias_silu(x, bias, *, out=None, policy: str = "auto", stream=None):
    """silu(x + bias) in one kernel: torch.nn.functional.silu(x + bias)."""
    return _bias_silu.call((x, bias), out, policy, stream)


def swiglu(a, b, *, out=None, policy: str = "auto", stream=None):
    """silu(a) * b in one kernel: torch.nn.functional.silu(a) * b."""
    return _swiglu.call((a, b), out, policy, stream)


def geglu(a, b, approximate: str = "none", *, out=None, policy: str = "auto", stream=None):
    """gelu(a) * b in one kernel: torch.nn.functional.gelu(a, approximate=approximate) * b."""
    return _gelu_variant(_GEGLU, approximate).call((a, b), out, policy, stream)


def bias_dropout_add(x, bias, residual, p: float, seed: int, offset: int = 0, *, out=None,
                     policy: str = "auto", stream=None):
    """residual + dropout(x + bias) in one kernel: kept elements scaled by 1 / (1 - p), the keep
    mask `cupyops.dropout_mask(shape, p, seed, offset)` of the output's shape (Philox4x32-10
    of each element's linear index + offset, keyed by seed). torch equivalent:
    residual + torch.nn.functional.dropout(x + bias, p) with a mask that depends only on
    (shape, p, seed, offset)."""
    return _bias_dropout_add.call((x, bias, residual, fx.check_dropout_p(p), int(seed), int(offset)), out, policy,
                                  stream)
