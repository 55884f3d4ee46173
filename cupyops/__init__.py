"""cupyops: fused GPU kernels for CuPy arrays, rendered from templates and compiled by NVRTC."""
from pathlib import Path as _Path

# In a source checkout, cli/, kernels/ and templates/ sit beside this package;
# the wheel installs them inside it (cupyops.cli, cupyops/kernels, ...). Both
# layouts resolve through __path__.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "cli" / "__init__.py").is_file() and (_checkout / "kernels").is_dir():
    __path__.append(str(_checkout))

__version__ = "0.1.0"

from .ops.norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward  # noqa: E402
from .ops.softmax import log_softmax, log_softmax_backward, softmax, softmax_backward  # noqa: E402
from . import fx  # noqa: E402
from .fx import where  # noqa: E402
from .ops.elementwise import elementwise, fuse  # noqa: E402
from .ops.activations import bias_dropout_add, bias_gelu, bias_silu, geglu, swiglu  # noqa: E402

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm", "layer_norm_backward", "rms_norm",
           "rms_norm_backward", "fuse", "elementwise", "fx", "where", "bias_gelu", "bias_silu", "swiglu",
           "geglu", "bias_dropout_add"]
from .ops.conv2d_int8 import conv2d_int8  # noqa: E402
from .ops.conv_layout import from_nchw32, pack_conv_filter, to_nchw32  # noqa: E402

__all__ += ["conv2d_int8", "pack_conv_filter", "to_nchw32", "from_nchw32"]
from .ops.fused_softmax import dropout_mask, fused_softmax, fused_softmax_backward  # noqa: E402

__all__ += ["fused_softmax", "fused_softmax_backward", "dropout_mask"]
from .callcache import release_kept_outputs  # noqa: E402

__all__ += ["release_kept_outputs"]
