"""Tensor parallelism on torch.distributed (lesson 09): one engine, N processes, 1/N of every layer each.

    parallel_state.py   the process groups (gloo on the CPU, NCCL on GPUs, a gloo group for
                        control messages), their start-up from tcp:// or env:// (torchrun), and
                        the checks that a model splits N ways (teaching errors)
    launch.py           the driver starts N - 1 worker processes (torch.multiprocessing, spawn),
                        watches them, stops them; what a worker process runs
    step_inputs.py      one step's inputs as tensors, broadcast from the driver to the workers

The layers that split the weights are in models/parallel_layers.py and the model built from them
in models/parallel_llama.py; the runner that drives the workers step by step is
worker/tp_worker.py. With `tensor_parallel_size=1` none of these files is imported.
"""
