"""Small example epilogues, used by the README, `coda-dsl demo` and as CLI targets:

    coda-dsl emit coda_dsl.examples:residual_rms
    coda-dsl explain coda_dsl.examples:leaky_relu --const slope=0.01
"""
import coda_dsl as cd


@cd.epilogue
def residual_rms(acc, residual: cd.Tensor, gamma: cd.VecN):
    h = acc + residual
    return {"D": h, "h_gamma": h * gamma}


@cd.epilogue
def bias_gelu(acc, bias: cd.VecN):
    return cd.gelu(acc + bias, approximate="tanh")


@cd.epilogue
def leaky_relu(acc, slope: cd.Const):
    # slope is baked into the kernel: each distinct value is its own build.
    return cd.where(acc > 0, acc, acc * slope)
