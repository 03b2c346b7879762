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
from timm.layers import DropPath

from .nhwc_conv import depthwise_conv_nhwc, pointwise_conv_nhwc
from .residual_alpha import ResidualAlpha

__all__ = ['CONV_CONFIGS', 'ConvShortcut', 'create_conv_shortcuts']

# Table 3's conv-block configurations as the pointwise flag of each shortcut, in order.
CONV_CONFIGS = {'A': (), 'B': (False,), 'C': (True,), 'D': (True, False)}


class ConvShortcut(nn.Module):
    """x + DropPath(alpha * act(pw(act(dw(x))))) on NHWC feature maps.

    The depthwise conv runs on the NCHW view of the NHWC map, which is channels-last in memory (no layout copies); the
    pointwise conv is a product over channels, a GEMM (``layers.nhwc_conv``).
    """

    def __init__(
            self,
            dim: int,
            pointwise: bool,
            alpha_init: float,
            drop_path: float = 0.0,
            kernel_size: int = 7,
            act_layer: type[nn.Module] = nn.GELU,
            alpha_learnable: bool = True,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dw = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim, **dd)
        self.act1 = act_layer()
        self.pw = nn.Conv2d(dim, dim, 1, **dd) if pointwise else None
        self.act2 = act_layer() if pointwise else nn.Identity()
        self.alpha = ResidualAlpha(dim, alpha_init, learnable=alpha_learnable, **dd)
        self.drop_path = DropPath(drop_path)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """act(pw(act(dw(x)))) on an NHWC map, the residual's branch before alpha and drop path."""
        if not torch.jit.is_scripting():
            y = self.act1(depthwise_conv_nhwc(self.dw, x))
            return y if self.pw is None else self.act2(pointwise_conv_nhwc(self.pw, y))
        y = self.act1(self.dw(x.permute(0, 3, 1, 2)))
        if self.pw is not None:
            y = self.act2(self.pw(y))
        return y.permute(0, 2, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.alpha(self.branch(x)))


def create_conv_shortcuts(dim: int, conv_config: str, alpha_init: float, drop_path: float,
                          alpha_learnable: bool = True, device=None, dtype=None) -> nn.ModuleList:
    """The shortcuts of one block for a Table 3 configuration letter ('A'-'D'); alphas fixed unless alpha_learnable."""
    if conv_config not in CONV_CONFIGS:
        raise ValueError(f'unknown conv_config {conv_config!r}; expected one of {sorted(CONV_CONFIGS)}')
    return nn.ModuleList([
        ConvShortcut(dim, pointwise, alpha_init, drop_path, alpha_learnable=alpha_learnable, device=device,
                     dtype=dtype)
        for pointwise in CONV_CONFIGS[conv_config]])
