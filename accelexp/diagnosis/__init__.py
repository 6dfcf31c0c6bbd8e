"""Where a run's time goes and what bounds it.

- `accounting`: always-on, per-epoch time accounting of the training steps (input wait, forward,
  backward, optimizer, communication, on CUDA the GPU's busy fraction), with no host sync per step.
- `flops`: the model's FLOPs per sample and the device's measured matmul peak, for the share of
  the peak a run reaches.
- `verdict`: the bounding resource of a run from its accounting, with the evidence and the
  overrides to try next (printed, a `diagnosis` tag, a `diagnosis.md` artifact).
- `profiler`: `profile=true` — torch.profiler traces of a few steps on every rank, logged to
  MLflow, and Holistic Trace Analysis of them where there are GPU kernels to analyse.
"""
