"""The instruments: what a model costs and how it trains, measured the same way on any machine.

- :mod:`.model_specs`: the model specs every instrument takes (``name[key=value,...]``, ``fast_path=``,
  ``compile=``, ``file:`` factories) and the flags that name the measured step;
- :mod:`.benchmark`: images/s, memory and TFLOP/s of timm models, interleaved in one process
  (``lipsformer-benchmark``); :mod:`.step_profile`: what a profiled step ran on the device;
- :mod:`.kernel_count`: kernels, bytes and dispatched ops of one eager CUDA step, counted without a GPU;
- :mod:`.complexity`: parameters and multiply-accumulates, without materialising weights;
- :mod:`.gpu_check`: the GPU check in one command (``scripts/gpu_check.sh``);
- :mod:`.stability`: the paper's central claim, stable training without warmup, swept in miniature
  (``python -m lipsformer.instruments.stability``).
"""
