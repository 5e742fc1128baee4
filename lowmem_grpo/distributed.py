"""torch.distributed glue: which process this is, its share of the work, and the few reductions a step
needs (docs/algorithm.md §21). With one process every function here is the identity, and nothing is
initialised.

torchrun launches the processes and does the rendezvous (it sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT); `join` only reads what it set. NCCL on CUDA (one GPU per process, LOCAL_RANK), gloo on CPU.

What crosses the wire in a step: each process's scored completions (token ids, texts, rewards: small next
to the model) so that every process holds the whole batch and computes the advantages, the aggregation
normalisers and the metrics exactly as one process would; the trainable (LoRA) gradients, summed once per
update; and a few per-token figures for the metrics. Never the base model's weights.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist


class DistributedError(Exception):
    """An exchange between the processes failed: one did not come within train.collective_timeout_s (it hangs)
    or its connection closed (it exited or was killed)."""


@contextlib.contextmanager
def _exchange(what: str):
    """Turn a failed collective into one clear error (the CLI prints it as one line and exits 2)."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:   # gloo and NCCL raise RuntimeError subclasses
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"process {dist.get_rank()}: {what} with the other processes failed: another "
                               "process exited, was killed, or did not reach it within train.collective_timeout_s "
                               f"({first})") from None


@dataclass(frozen=True)
class World:
    """This process's place among the job's: rank in [0, size)."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """Process 0: the one that writes metrics, samples and checkpoints."""
        return self.rank == 0


ON_SIGNAL = {"train": "on SIGINT (Ctrl-C) and SIGTERM the processes finish their step and checkpoint it; --resume "
                      "continues from the last checkpoint",
             "eval": "on SIGINT (Ctrl-C) each process writes the completions it has to the eval folder, as "
                     "samples.part-R-of-N.jsonl beside a summary.part-R-of-N.json that says interrupted"}
HANDLED = {"train": (signal.SIGINT, signal.SIGTERM), "eval": (signal.SIGINT,)}   # (interrupts.StopFlag; evaluate.py)


def on_signal(command: str, sig: signal.Signals) -> str:
    """What the processes of `command` did with the signal torchrun passed on to them. A signal they do not handle
    ended them at once: the SIGTERM of an eval was said to have written each process's share (found by a red team),
    and nothing was written."""
    if sig in HANDLED[command]:
        return ON_SIGNAL[command]
    if command == "train":
        return (f"{sig.name} ended the processes at once, their step not checkpointed (Ctrl-C or SIGTERM lets them "
                "finish it); --resume continues from the last checkpoint")
    return (f"{sig.name} ended the processes at once: nothing of this eval was written (Ctrl-C has each process "
            "write the completions it has)")


def shutdown_timeout_s(collective_timeout_s: float) -> int:
    """How long torchrun waits, once it has passed a signal on, for the processes to end before it kills them:
    they finish their step and checkpoint it first. torchrun's default, 30 s, killed a step that took longer,
    unsaved (found by a red team); a step's phase lags the others by at most train.collective_timeout_s, and the
    checkpoint's write comes after."""
    return int(math.ceil(collective_timeout_s)) + 120


def launch(nproc: int, argv: list[str], shutdown_timeout: int = 30) -> None:
    """`torchrun --standalone --nproc_per_node nproc --shutdown_timeout S -m lowmem_grpo ARGV`, run by torchrun's
    own entry point in this process (it becomes the job's agent). A process that fails, and the agent's own stop
    on a signal, come out as one DistributedError naming the process and how it ended; torchrun has stopped the
    others by then. torchrun's module-level entry (torch.distributed.run: parse_args, run) and its elastic errors,
    checked against torch 2.13; tests/test_distributed.py runs every way out of here."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(["--standalone", f"--nproc_per_node={nproc}", f"--shutdown_timeout={shutdown_timeout}",
                        "-m", "lowmem_grpo", *argv]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise DistributedError(f"process {rank} of {nproc} ended with {how} (its own error, if it printed one, is "
                               "above); torchrun stopped the other processes") from None
    except SignalException as exc:
        raise DistributedError(f"torchrun got {exc.sigval.name} and passed it on: {on_signal(argv[0], exc.sigval)}") \
            from None


def launched_size() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_main() -> bool:
    """This is process 0 of those torchrun started (or the only one): known from torchrun's RANK, also before the
    process group is joined and after it is left."""
    return os.environ.get("RANK", "0") == "0"


def join(timeout_s: float) -> World:
    """Join the process group torchrun set up (once per process), or World() for a single process.
    timeout_s: how long a collective waits for a process that does not come (a hung peer; torchrun
    itself stops the job when a process exits)."""
    if launched_size() <= 1:
        return World()
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:   # one GPU per process: before any CUDA tensor (NCCL and the model load on this device)
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if problem := gpus_problem(local + 1):
                raise DistributedError(f"process {local} on this machine: {problem}")
            torch.cuda.set_device(local)
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        except ValueError as exc:   # torch's env:// rendezvous: a variable torchrun sets is missing (a traceback before)
            raise DistributedError(f"WORLD_SIZE={launched_size()} is set, so this process is one of a torchrun job, "
                                   f"but not all that torchrun sets is ({str(exc).strip().splitlines()[0]}): start "
                                   "it with torchrun (lowmem-grpo train --nproc N), or unset WORLD_SIZE") from None
        stop_when_orphaned()
    return current()


def gpus_problem(nproc: int) -> Optional[str]:
    """Why nproc processes cannot each have a GPU of this machine (CUDA only), or None."""
    if not torch.cuda.is_available() or nproc <= torch.cuda.device_count():
        return None
    return (f"{nproc} processes need a GPU each, and {torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES): "
            "lower --nproc (torchrun's --nproc_per_node)")


def stop_when_orphaned(poll_s: float = 1.0) -> None:
    """Ctrl-C this process (SIGINT: it finishes its step and checkpoints it, or writes its eval share) once its
    parent, torchrun's agent, is gone: an agent killed with SIGKILL cannot stop its workers, which ran on as orphans
    in their own sessions, holding the run folder and their GPUs (found by a red team). A daemon thread that
    watches the parent's pid."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="lowmem-grpo-orphan-watch", daemon=True).start()


def current() -> World:
    """The World of an initialised process group, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def leave(finished: bool = False) -> None:
    """Leave the process group (at the end of a command), if this process joined one. finished: every process
    reached the end, so wait for the others first. A process that tears its connections down while a peer is
    still using them can take that peer down at exit (gloo: "terminate called without an active exception",
    SIGABRT after an `eval --nproc 2` had printed its results, seen once in CI). After an error there is no
    wait: the peers may never come, and torchrun stops them."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            barrier(current(), "finishing the command")
        dist.destroy_process_group()


def barrier(world: World, what: str) -> None:
    """Wait until every process has reached this point (`what`: the exchange's name in the error if one fails):
    e.g. what process 0 alone writes (the run's last checkpoint) is on disk once every process has passed it."""
    if world.size == 1:
        return
    with _exchange(what):
        dist.barrier()


def end_worker() -> None:
    """Under torchrun, a process that finished its command ends here, with its output flushed: os._exit skips the
    interpreter's teardown, where gloo's threads can still abort the process ("terminate called without an active
    exception", SIGABRT) after its work is done and the group left; torchrun then reports the job as failed. Seen
    in CI at the end of a resumed 2-process run, after `leave`'s barrier. Its files are closed by then (the
    trainer's sinks, the eval's results). A single process returns and exits as usual."""
    if launched_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextlib.contextmanager
def joined(timeout_s: float):
    """`with joined(timeout) as world:` a command's time in the process group (join, then leave)."""
    world = join(timeout_s)
    try:
        yield world
    except BaseException:
        leave()
        raise
    leave(finished=True)


def shard_bounds(n: int, world: World) -> tuple[int, int]:
    """[start, stop) of this process's contiguous share of n items: shares differ by at most one, the
    earlier processes taking the larger ones, and rank order is item order."""
    base, extra = divmod(n, world.size)
    start = world.rank * base + min(world.rank, extra)
    return start, start + base + (world.rank < extra)


def shard(items: Sequence, world: World) -> list:
    """This process's contiguous share of items (shard_bounds)."""
    start, stop = shard_bounds(len(items), world)
    return list(items[start:stop])


def shares(items: Sequence, world: World) -> list[list]:
    """Every process's share of items (shard), in rank order."""
    return [shard(items, World(r, world.size)) for r in range(world.size)]


def gather(obj: Any, world: World) -> list:
    """Every process's obj, in rank order, on every process. Pickled: keep it small. Tensors in it (also in
    lists, tuples, dicts and dataclasses) travel as CPU tensors, so that they unpickle anywhere."""
    if world.size == 1:
        return [obj]
    out: list = [None] * world.size
    with _exchange("gathering a step's results"):
        dist.all_gather_object(out, _on_cpu(obj))
    return out


def gather_lists(items: list, world: World) -> list:
    """Every process's list, concatenated in rank order (one process: items itself)."""
    if world.size == 1:
        return items
    return [x for part in gather(items, world) for x in part]


def _on_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _on_cpu(getattr(obj, f.name)) for f in fields(obj) if f.init})
    return obj


def sampling_seed(seed: int, world: World) -> int:
    """The seed of this process's sampling stream: the recipe's for process 0 (one process samples as it
    always did), a distinct one for each other process (docs/algorithm.md §21)."""
    return seed + SEED_STRIDE * world.rank


SEED_STRIDE = 1_000_003   # for seeds below it, no two (seed, rank) pairs share a stream


def any_true(flag: bool, world: World) -> bool:
    """True on every process when it is True on any (e.g. a Ctrl-C that reached one process)."""
    if world.size == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], device=_device())
    with _exchange("agreeing on a stop"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_gradients(params: Iterable[torch.nn.Parameter], world: World) -> None:
    """Sum the parameters' gradients over the processes, in place, one flat all-reduce per dtype. Each process's
    loss already carries the batch-wide aggregation weights (docs/algorithm.md §21), so the sum is the
    gradient one process would have computed. A parameter without a gradient on some processes (no micro-batch
    there) takes part as zeros, and holds the sum afterwards like the others; one without a gradient on every
    process keeps none, as with one process: AdamW skips such a parameter, where a zero gradient would have moved
    it (weight decay) and its moments (found by a red team). Every process passes the same parameters in the same
    order (the same model), so the buffers line up."""
    if world.size == 1:
        return
    params = list(params)
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_device())
    with _exchange("summing the gradients"):
        dist.all_reduce(had)   # how many processes hold each parameter's gradient
    by_dtype: dict = {}
    for p, n in zip(params, had.tolist()):
        if not n:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():   # one flat buffer per dtype (LoRA weights are usually all float32)
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        with _exchange("summing the gradients"):
            dist.all_reduce(flat)
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
            offset += p.numel()


def broadcast_parameters(params: Iterable[torch.nn.Parameter], world: World) -> None:
    """Process 0's values of the parameters on every process (the trainable ones at start: one policy)."""
    if world.size == 1:
        return
    with torch.no_grad(), _exchange("sharing process 0's adapter weights"):
        for p in params:
            dist.broadcast(p.data, src=0)


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"
