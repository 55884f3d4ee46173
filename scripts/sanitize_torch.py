"""Runs every cupyops.torch function forward and backward twice on small tensors, for
compute-sanitizer (memcheck, racecheck): the first call of a layout through CuPy views, the
second replayed on the tensors' addresses (cupyops.torch_replay), with and without gradients,
odd columns and a tensor off the 16-byte grid. Prints "all paths ran (cupyops.torch)" at the
end; exits quietly where torch is not installed."""
from __future__ import annotations


def main():
    try:
        import torch
    except ImportError:
        print("torch not installed")
        return
    import cupyops.torch as ct

    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(*shape, dtype=torch.float16):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=generator).requires_grad_()

    for cols in (96, 33):
        x, r, w, b = tensor(48, cols), tensor(48, cols), tensor(cols), tensor(cols)
        shifted = torch.empty(48 * cols + 1, device="cuda", dtype=torch.float16)[1:].view(48, cols)
        shifted = shifted.copy_(x.detach()).requires_grad_()
        scores = tensor(2, 4, 12, cols)
        calls = [lambda x: ct.softmax(x, -1), lambda x: ct.log_softmax(x, 0),
                 lambda x: ct.layer_norm(x, (cols,), w, b, 1e-5, residual=r)[0],
                 lambda x: ct.rms_norm(x, (cols,), w, 1e-6), lambda x: ct.bias_gelu(x, b, "tanh"),
                 lambda x: ct.bias_silu(x, b), lambda x: ct.swiglu(x, r), lambda x: ct.geglu(x, r),
                 lambda x: ct.bias_dropout_add(x, b, r, 0.1, 7, 3)]
        for call in calls:
            for operand in (x, x, shifted):
                call(operand).float().square().sum().backward()
                with torch.no_grad():
                    call(operand)
        bias, mask = tensor(4, 12, cols), torch.rand(2, 1, 1, cols, device="cuda", generator=generator) > 0.2
        for _ in range(2):
            ct.fused_softmax(scores, scale=0.3, bias=bias, mask=mask, causal=True, dropout=0.1, seed=5,
                             offset=2).float().square().sum().backward()
    torch.cuda.synchronize()
    print("all paths ran (cupyops.torch)")


if __name__ == "__main__":
    main()
