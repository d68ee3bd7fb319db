"""Model execution: a process's worker and runner, CUDA graphs (whole-step and piecewise), the drafter's runner and process, tensor parallelism, device choices and the step's tensors."""
