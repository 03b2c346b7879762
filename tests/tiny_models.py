"""The tiny LipsFormer shapes the tests build, defined once.

- :data:`TINY_SWIN` / :data:`TINY_CSWIN` (64x64 inputs) keep every code path of their family: two-branch and
  one-branch CSwin stages, a Swin stage smaller than its window, conv shortcuts, post-norms.
- :data:`SMALLEST_SWIN` (32x32, one block and one head per stage) is for tests that train or evaluate a whole network
  end to end in seconds.
"""
TINY_SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, img_size=64)
TINY_CSWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), split_size=(1, 2, 2, 2), img_size=64)
TINY_MODELS = {'lipsformer_swin_tiny': TINY_SWIN, 'lipsformer_cswin_tiny': TINY_CSWIN}

SMALLEST_MODEL = 'lipsformer_swin_tiny'
SMALLEST_SWIN = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4, img_size=32)
# The same architecture as train.py's model.kwargs (img_size is the config's model.img_size).
SMALLEST_SWIN_KWARGS = {key: list(value) if isinstance(value, tuple) else value
                        for key, value in SMALLEST_SWIN.items() if key != 'img_size'}

# timm's own Swin at TINY_SWIN's shape (the same keyword arguments): the control of the tool tests, which must pass on
# it as they do on any plain module graph.
TIMM_SWIN = 'swin_tiny_patch4_window7_224'

# One block per stage but the real windows (7) and stripes (1, 2, 7, 7), for exports at 224 and at 256x320, where
# Swin pads its 7x7 windows and CSwin its 7-wide stripes (stage 3 is 16x20).
EXPORT_MODELS = {
    'lipsformer_swin_tiny': dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4)),
    'lipsformer_cswin_tiny': dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4)),
    TIMM_SWIN: dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4)),
}
