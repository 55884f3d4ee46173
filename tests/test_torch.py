"""cupyops.torch: the ops as torch custom ops with autograd, the drop-in modules.

CPU: `import cupyops` imports no torch. GPU with torch (marked gpu; skipped
without torch): torch.autograd.gradcheck in float64 of every function;
outputs and gradients against torch's own ops in float16 / bfloat16 /
float32; torch.compile(fullgraph=True) of a small transformer block against
eager; LayerNorm / RMSNorm state_dict round trips with torch's modules.
The fused softmax's tests skip while cupyops has no fused_softmax.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

GRAD_TOLERANCES = {"float16": dict(rtol=2e-2, atol=2e-2), "bfloat16": dict(rtol=5e-2, atol=5e-2),
                   "float32": dict(rtol=1e-4, atol=1e-5)}


def test_import_cupyops_imports_no_torch():
    code = "import sys, cupyops; assert 'torch' not in sys.modules, 'cupyops imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


@pytest.fixture(scope="module")
def ct(torch):
    import cupyops.torch as ct
    return ct


def _needs_fused_softmax(ct):
    if not hasattr(ct, "fused_softmax"):
        pytest.skip("cupyops has no fused_softmax yet")


def _inputs(torch, *shapes, dtype="float64", seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, dtype=getattr(torch, dtype), device="cuda", generator=generator).requires_grad_()
            for shape in shapes]


def _functions(torch, ct):
    """name -> (cupyops.torch call, torch's own call, input shapes)."""
    F = torch.nn.functional
    found = {
        "softmax": (lambda x: ct.softmax(x, -1), lambda x: torch.softmax(x, -1), [(6, 33)]),
        "softmax dim 0": (lambda x: ct.softmax(x, 0), lambda x: torch.softmax(x, 0), [(6, 33)]),
        "log_softmax": (lambda x: ct.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1), [(6, 33)]),
        "layer_norm": (lambda x, w, b: ct.layer_norm(x, (33,), w, b, 1e-5),
                       lambda x, w, b: F.layer_norm(x, (33,), w, b, 1e-5), [(6, 33), (33,), (33,)]),
        "layer_norm 2 axes": (lambda x, w: ct.layer_norm(x, (3, 11), w),
                              lambda x, w: F.layer_norm(x, (3, 11), w), [(6, 3, 11), (3, 11)]),
        "layer_norm residual": (lambda x, r, w, b: torch.cat(ct.layer_norm(x, 33, w, b, residual=r)),
                                lambda x, r, w, b: torch.cat([F.layer_norm(x + r, (33,), w, b), x + r]),
                                [(6, 33), (6, 33), (33,), (33,)]),
        "rms_norm": (lambda x, w: ct.rms_norm(x, (33,), w, 1e-6), lambda x, w: F.rms_norm(x, (33,), w, 1e-6),
                     [(6, 33), (33,)]),
        "rms_norm residual": (lambda x, r, w: torch.cat(ct.rms_norm(x, [33], w, 1e-6, residual=r)),
                              lambda x, r, w: torch.cat([F.rms_norm(x + r, (33,), w, 1e-6), x + r]),
                              [(6, 33), (6, 33), (33,)]),
        "bias_gelu": (lambda x, b: ct.bias_gelu(x, b), lambda x, b: F.gelu(x + b), [(6, 33), (33,)]),
        "bias_gelu tanh": (lambda x, b: ct.bias_gelu(x, b, "tanh"), lambda x, b: F.gelu(x + b, approximate="tanh"),
                           [(6, 33), (33,)]),
        "bias_silu": (lambda x, b: ct.bias_silu(x, b), lambda x, b: F.silu(x + b), [(6, 33), (33,)]),
        "swiglu": (lambda a, b: ct.swiglu(a, b), lambda a, b: F.silu(a) * b, [(6, 33), (6, 33)]),
        "geglu": (lambda a, b: ct.geglu(a, b), lambda a, b: F.gelu(a) * b, [(6, 33), (6, 33)]),
        "bias_dropout_add p=0": (lambda x, b, r: ct.bias_dropout_add(x, b, r, 0.0, 7),
                                 lambda x, b, r: r + (x + b), [(6, 33), (33,), (6, 33)]),
    }
    if hasattr(ct, "fused_softmax"):
        def reference(x, b):
            causal = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
            return torch.softmax((x * 0.5 + b).masked_fill(~causal, float("-inf")), -1)
        found["fused_softmax causal bias"] = (lambda x, b: ct.fused_softmax(x, scale=0.5, bias=b, causal=True),
                                              reference, [(2, 3, 9, 9), (9, 9)])
    return found


FUNCTIONS = ["softmax", "softmax dim 0", "log_softmax", "layer_norm", "layer_norm 2 axes", "layer_norm residual",
             "rms_norm", "rms_norm residual", "bias_gelu", "bias_gelu tanh", "bias_silu", "swiglu", "geglu",
             "bias_dropout_add p=0", "fused_softmax causal bias"]


def _function(torch, ct, name):
    found = _functions(torch, ct)
    if name not in found:
        _needs_fused_softmax(ct)
    return found[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FUNCTIONS)
def test_gradcheck_float64(torch, ct, name):
    function, _, shapes = _function(torch, ct, name)
    assert torch.autograd.gradcheck(function, _inputs(torch, *shapes), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gradcheck_with_dropout(torch, ct):
    """Dropout masks are a function of (shape, p, seed, offset): the same on every call."""
    x, b, r = _inputs(torch, (6, 33), (33,), (6, 33))
    assert torch.autograd.gradcheck(lambda x, b, r: ct.bias_dropout_add(x, b, r, 0.25, 11, 3), (x, b, r),
                                    eps=1e-6, atol=1e-5)
    if hasattr(ct, "fused_softmax"):
        s, sb = _inputs(torch, (2, 9, 9), (9,))
        assert torch.autograd.gradcheck(lambda s, sb: ct.fused_softmax(s, bias=sb, dropout=0.3, seed=5), (s, sb),
                                        eps=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_against_torch(torch, ct, name, dtype):
    function, reference, shapes = _function(torch, ct, name)
    ours = _inputs(torch, *shapes, dtype=dtype, seed=1)
    theirs = [a.detach().clone().requires_grad_() for a in ours]
    y, expected = function(*ours), reference(*theirs)
    assert y.dtype == expected.dtype and y.shape == expected.shape
    torch.testing.assert_close(y, expected, **GRAD_TOLERANCES[dtype])
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, ours, dy), torch.autograd.grad(expected, theirs, dy)):
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got / scale, want / scale, **GRAD_TOLERANCES[dtype])


def _routes(torch, ct):
    """name -> (eager call, the registered custom op's call: its outputs, the first one y,
    inputs)."""
    from cupyops import torch_elementwise

    x, w, b, r = _inputs(torch, (64, 96), (96,), (96,), (64, 96), dtype="float32", seed=3)
    routes = {
        "softmax": (lambda x: (ct.softmax(x, -1),), lambda x: (torch.ops.cupyops.softmax(x, -1),), [x]),
        "rms_norm residual": (lambda x, w, r: ct.rms_norm(x, (96,), w, 1e-6, residual=r),
                              lambda x, w, r: ct._rms_norm.custom(x, w, r, 1, 1e-6), [x, w, r]),
        "layer_norm": (lambda x, w, b: (ct.layer_norm(x, 96, w, b),),
                       lambda x, w, b: ct._layer_norm.custom(x, w, b, None, 1, 1e-5), [x, w, b]),
        "swiglu": (lambda x, r: (ct.swiglu(x, r),), lambda x, r: (torch_elementwise.swiglu_op.op.custom(x, r),),
                   [x, r]),
        "bias_dropout_add": (lambda x, b, r: (ct.bias_dropout_add(x, b, r, 0.3, 9, 2),),
                             lambda x, b, r: (torch_elementwise.bias_dropout_add_op.op.custom(x, b, r, 0.3, 9, 2),),
                             [x, b, r]),
    }
    if hasattr(ct, "fused_softmax"):
        s, bias = _inputs(torch, (2, 3, 16, 16), (16,), dtype="float32", seed=4)
        rng = torch.tensor([9, 2], dtype=torch.int64)
        routes["fused_softmax"] = (
            lambda s, bias: (ct.fused_softmax(s, scale=0.5, bias=bias, causal=True, dropout=0.2, seed=9, offset=2),),
            lambda s, bias: ct._fused_softmax.custom(s, bias, None, rng, 0.5, True, 0, 0.2, -1, True), [s, bias])
    return routes


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softmax", "rms_norm residual", "layer_norm", "swiglu", "bias_dropout_add",
                                  "fused_softmax"])
def test_eager_route_matches_the_custom_op(torch, ct, name):
    """Eager calls run a torch.autograd.Function of their own (statistics kept as CuPy arrays)
    or, with no gradient wanted, the bare computation; the registered custom op (what
    torch.compile traces) gives the same outputs and gradients, bit for bit."""
    routes = _routes(torch, ct)
    if name not in routes:
        _needs_fused_softmax(ct)
    eager, custom, inputs = routes[name]
    got, want = eager(*inputs), custom(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(eager(*inputs), want))
    dy = torch.randn_like(want[0])
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got[0], inputs, dy),
                                                 torch.autograd.grad(want[0], inputs, dy)))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["log_softmax", "rms_norm", "layer_norm residual", "fused_softmax", "swiglu",
                                  "bias_dropout_add"])
def test_repeated_calls_are_replayed(torch, ct, monkeypatch, kind):
    """From the second call of a layout a softmax, a norm, the fused softmax or an elementwise op
    launches cupyops' remembered kernels on the tensors themselves (cupyops.torch_replay): no
    cupyops function called, the first call's outputs and gradients bit for bit; a tensor of
    another layout (16-byte phase) is not replayed with them and is still right."""
    import cupyops
    from cupyops.ops.elementwise import FusedFunction

    if kind == "fused_softmax":
        _needs_fused_softmax(ct)
    x, w, b, r = _inputs(torch, (64, 96), (96,), (96,), (64, 96), dtype="float32", seed=5)
    dy = torch.randn(64, 96, device="cuda")

    def call(x):
        if kind == "rms_norm":
            return ct.rms_norm(x, (96,), w, 1e-6), (x, w)
        if kind == "fused_softmax":
            return ct.fused_softmax(x.view(2, 32, 96), scale=0.5, bias=b, causal=True, dropout=0.2, seed=3,
                                    offset=8).view(64, 96), (x, b)
        if kind == "log_softmax":
            return ct.log_softmax(x, -1), (x,)
        if kind == "swiglu":
            return ct.swiglu(x, r), (x, r)
        if kind == "bias_dropout_add":
            return ct.bias_dropout_add(x, b, r, 0.25, 3, 8), (x, b, r)
        y, h = ct.layer_norm(x, 96, w, b, residual=r)
        return y + h, (x, w, b, r)

    def run(x):
        y, leaves = call(x)
        return (y, *torch.autograd.grad(y, leaves, dy))

    first = run(x)
    with torch.no_grad():
        plain = call(x)[0]
    calls = []
    for name in ("log_softmax", "log_softmax_backward", "rms_norm", "layer_norm", "rms_norm_backward",
                 "layer_norm_backward", "fused_softmax", "fused_softmax_backward"):
        if hasattr(cupyops, name):
            monkeypatch.setattr(cupyops, name,
                                lambda *a, _f=getattr(cupyops, name), **k: calls.append(1) or _f(*a, **k))
    monkeypatch.setattr(FusedFunction, "call", lambda *a, _f=FusedFunction.call, **k: calls.append(1) or _f(*a, **k))
    again = run(x)
    with torch.no_grad():
        assert torch.equal(call(x)[0], plain)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    shifted = torch.empty(64 * 96 + 1, device="cuda")[1:].view(64, 96).copy_(x.detach()).requires_grad_()
    moved = run(shifted)
    assert calls, "a tensor at another 16-byte phase took the replay of an aligned one"
    torch.testing.assert_close(moved[0], first[0], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_runs_on_torchs_current_stream(torch, ct):
    x, w = _inputs(torch, (64, 128), (128,), dtype="float32")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = ct.rms_norm(x, (128,), w)
        z = ct.softmax(y, -1)
    stream.synchronize()
    torch.testing.assert_close(z, torch.softmax(torch.nn.functional.rms_norm(x, (128,), w), -1))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("arguments", [{}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_module_state_dict_round_trip(torch, ct, kind, arguments):
    if kind == "LayerNorm":
        arguments = {**arguments, "bias": False} if arguments.get("eps") else arguments
    theirs = getattr(torch.nn, kind)((4, 16), device="cuda", **arguments)
    for parameter in theirs.parameters():
        torch.nn.init.normal_(parameter)
    ours = getattr(ct, kind)((4, 16), device="cuda", **arguments)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(8, 4, 16, device="cuda")
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    again = getattr(torch.nn, kind)((4, 16), device="cuda", **arguments)
    again.load_state_dict(ours.state_dict())
    torch.testing.assert_close(again(x), theirs(x))


def _example_block(torch, use_cupyops: bool):
    """examples/transformer_block.py's TransformerBlock (64 wide, 4 heads, no dropout) on the GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "transformer_block.py"
    spec = importlib.util.spec_from_file_location("transformer_block_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.TransformerBlock(64, 4, 0.0, use_cupyops).cuda()


@pytest.mark.gpu
def test_compile_fullgraph_transformer_block(torch, ct):
    torch.manual_seed(0)
    block = _example_block(torch, use_cupyops=True)
    reference = _example_block(torch, use_cupyops=False)
    reference.load_state_dict(block.state_dict())
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    y = compiled(x)
    torch.testing.assert_close(y, block(x))
    torch.testing.assert_close(y, reference(x), rtol=1e-4, atol=1e-4)
    y.square().mean().backward()
    grad = x.grad.clone()
    x.grad = None
    reference(x).square().mean().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-3, atol=1e-5)
    assert all(p.grad is not None for p in block.parameters())
