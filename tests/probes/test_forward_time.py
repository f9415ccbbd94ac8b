"""The forward clock (`probes/forward_time.py`) of a loop under torchrun."""

import socket
import time

import torch
import torch.distributed as dist

from nbwatch.probes.forward_time import ForwardClock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.register_buffer("inv_freq", torch.ones(2))  # DDP broadcasts it each forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.inv_freq.sum())


def test_the_clock_on_ddp_of_a_module_compiled_in_place_with_fullgraph():
    """`DDP(m)` of `m.compile(fullgraph=True)`: the clock's hook where the inner module's
    forward begins was traced by torch.compile, and its `time.perf_counter()` broke the
    graph, which fullgraph refuses: the loop's first forward raised `Unsupported`. It is
    left out of the trace now; the wrapper's own hooks time the forward."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    net, count = _Net(), CompileCounter()
    net.compile(backend=count, fullgraph=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        clock = ForwardClock(ddp)
        x = torch.randn(4, 8)
        for _ in range(3):
            t0 = time.perf_counter()
            ddp(x).sum().backward()
            got = clock.take(t0)
            assert got["time/busy"] >= got["time/forward"] > 0, got
        clock.close()
    finally:
        dist.destroy_process_group()
    assert count.frame_count == 1  # one graph, compiled once
