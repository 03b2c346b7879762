"""The convolutional shortcuts LipsFormer adds before each attention (Qi et al., ICLR 2023, section 4.2.1 and 5.3).

Each shortcut is a weighted residual around a depthwise 7x7 convolution, optionally followed by a pointwise one:

    x <- x + DropPath(alpha (.) GELU(PW(GELU(DW(x)))))     (pointwise=True)
    x <- x + DropPath(alpha (.) GELU(DW(x)))               (pointwise=False)

Configuration D of Table 3 (the authors' code) is the first then the second; C is the first alone, B the second
alone, A none. With GELU's Lipschitz constant g = 1.1289 (exact GELU),

    Lip <= 1 + max|alpha| * g^2 * ||DW|| * ||PW||     or     1 + max|alpha| * g * ||DW||

where ||.|| is the operator norm of the convolution (for a depthwise conv, the largest |DFT| of any channel's
kernel; at most sqrt(49) times the norm of the (C, 49) reshaped weight that spectral init sets to 1).
"""
import torch
import torch.nn as nn

from .depthwise_conv import depthwise_conv2d
from .lean_autograd import gelu_residual, scaled_linear
from .weighted_residual import ResidualDropPath, ScaleLayer

__all__ = ['CONV_CONFIGS', 'ConvShortcut', 'create_conv_shortcuts']

# Table 3's conv-block configurations as the pointwise flag of each shortcut, in order.
CONV_CONFIGS = {'A': (), 'B': (False,), 'C': (True,), 'D': (True, False)}


class ConvShortcut(nn.Module):
    """x + DropPath(alpha * act(pw(act(dw(x))))) on NHWC feature maps.

    With exact GELUs (the default) the depthwise conv is :func:`~lipsformer.layers.depthwise_conv.depthwise_conv2d`
    (a faster weight gradient on CPU), the pointwise conv runs as a linear layer over channels on the NHWC map, and
    both GELUs go through :mod:`~lipsformer.layers.lean_autograd`: the backward keeps x, dw(x) and pw(GELU(dw(x))),
    not the GELUs' outputs.
    """

    lean: torch.jit.Final[bool]

    def __init__(
            self,
            dim: int,
            pointwise: bool,
            alpha_init: float,
            drop_path: float = 0.0,
            kernel_size: int = 7,
            act_layer: type[nn.Module] = nn.GELU,
            alpha_learnable: bool = True,
    ) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)
        self.act1 = act_layer()
        self.pw = nn.Conv2d(dim, dim, 1) if pointwise else None
        self.act2 = act_layer() if pointwise else nn.Identity()
        self.alpha = ScaleLayer(dim, alpha_init, learnable=alpha_learnable)
        self.drop_path = ResidualDropPath(drop_path)
        self.lean = all(isinstance(act, nn.GELU) and act.approximate == 'none'
                        for act in (self.act1, self.act2) if not isinstance(act, nn.Identity))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """act(pw(act(dw(x)))) on an NHWC map, the residual's branch before alpha and drop path."""
        # A permuted NHWC tensor is an NCHW tensor in channels-last memory: the convs run without layout copies.
        y = self.act1(self.dw(x.permute(0, 3, 1, 2)))
        if self.pw is not None:
            y = self.act2(self.pw(y))
        return y.permute(0, 2, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lean:
            # alpha, the drop-path mask and the sum in one multiply-add (ResidualDropPath).
            return self.drop_path.residual(x, self.branch(x), self.alpha.gamma)
        z = depthwise_conv2d(x, self.dw.weight, self.dw.bias)
        if self.pw is not None:
            z = scaled_linear(z, self.pw.weight.flatten(1), self.pw.bias, gelu=True)
        scale = self.drop_path.branch_scale(z, self.alpha.gamma)
        assert scale is not None  # alpha is always there; for TorchScript's Optional
        return gelu_residual(x, z, scale)


def create_conv_shortcuts(dim: int, conv_config: str, alpha_init: float, drop_path: float,
                          alpha_learnable: bool = True) -> nn.ModuleList:
    """The shortcuts of one block for a Table 3 configuration letter ('A'-'D'); alphas fixed unless alpha_learnable."""
    if conv_config not in CONV_CONFIGS:
        raise ValueError(f'unknown conv_config {conv_config!r}; expected one of {sorted(CONV_CONFIGS)}')
    return nn.ModuleList([
        ConvShortcut(dim, pointwise, alpha_init, drop_path, alpha_learnable=alpha_learnable)
        for pointwise in CONV_CONFIGS[conv_config]])
