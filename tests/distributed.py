"""Run a function on several gloo processes and collect each rank's result, or its traceback."""
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _detach(value):
    """Tensors become numpy arrays: shared-memory tensors would not outlive the worker process. numpy has no
    bfloat16 (a CUDA run's embeddings): those become float32, exactly."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def _worker(rank, world_size, port, fn, args, results, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two processes on two cores
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        results.put((rank, "ok", _detach(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Workers fork from a server process that has imported torch and the trainer once (~4.5 s a process on these
# CPUs otherwise); the server itself holds no threads or process groups, so each fork starts clean.
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "train_gpt"])


def run_on_ranks(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) on world_size processes (backend "nccl": one GPU each); returns the results
    ordered by rank.

    fn must be a module-level function (it is pickled by name). A rank that raises fails the caller with
    that rank's traceback; a hang fails after `timeout` seconds instead of blocking the suite.
    """
    results = _context.Queue()
    port = free_port()
    procs = [_context.Process(target=_worker, args=(r, world_size, port, fn, args, results, backend), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
