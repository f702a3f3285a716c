"""
What grpcio's asyncio server costs an ext_proc stream, with nothing to do
=========================================================================

::

    python benchmarks/grpc_floor.py                  # 1, 4, 8 and 12 messages a stream
    python benchmarks/grpc_floor.py --messages 10 --streams 2000

``meshkit extproc`` serves Envoy's ``ExternalProcessor`` on grpcio's asyncio server
(``docs/extproc.md``); ``extproc_bench.py`` measures the picker behind a real Envoy.
This measures the floor under it: a processor that answers every message with an
empty ``ProcessingResponse`` and does nothing else, on the same server class, driven
the way Envoy drives one HTTP request: one stream, each message sent after the
answer to the one before. Server on CPU 0, client (grpcio's blocking stub) on CPU 1;
server CPU per stream = utime + stime from ``/proc`` over the measured streams.
The difference between two message counts, over their difference, is the cost of
one more exchange; what is left at one message is the stream's own.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SERVER = """
import asyncio, grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

class Nothing(pbg.ExternalProcessorServicer):
    async def Process(self, messages, context):
        async for _ in messages:
            yield pb.ProcessingResponse()

async def main():
    server = grpc.aio.server()
    pbg.add_ExternalProcessorServicer_to_server(Nothing(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(stub: object, pb: object, n: int) -> None:
    """One stream of ``n`` exchanges, each message sent after the last answer."""
    answered: queue.SimpleQueue[None] = queue.SimpleQueue()

    def messages() -> Iterator[object]:
        for i in range(n):
            if i:
                answered.get(timeout=30)  # never hang on a lost answer
            yield pb.ProcessingRequest()  # type: ignore[attr-defined]

    got = 0
    for _ in stub.Process(messages()):  # type: ignore[attr-defined]
        got += 1
        answered.put(None)
    if got != n:
        raise RuntimeError(f"{got} answers to {n} messages")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", default="1,4,8,12", help="exchanges per stream")
    ap.add_argument("--streams", type=int, default=1000, help="measured streams per count")
    ap.add_argument("--server-cpu", default="0")
    ap.add_argument("--client-cpu", default="1")
    args = ap.parse_args(argv)

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

    os.sched_setaffinity(0, {int(args.client_cpu)})
    server = subprocess.Popen(
        ["taskset", "-c", args.server_cpu, sys.executable, "-c", SERVER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbg.ExternalProcessorStub(channel)
            for _ in range(200):
                stream(stub, pb, 4)  # warm-up
            rows = []
            for n in (int(x) for x in args.messages.split(",")):
                c0, t0 = cpu_s(server.pid), time.perf_counter()
                for _ in range(args.streams):
                    stream(stub, pb, n)
                wall = time.perf_counter() - t0
                cpu = cpu_s(server.pid) - c0
                rows.append((n, cpu / args.streams * 1e6, wall / args.streams * 1e6))
    finally:
        server.kill()
        server.wait()
    import grpc as g

    print(f"grpcio {g.__version__}, python {sys.version.split()[0]}, {args.streams} streams each")
    print("| messages per stream | server CPU µs per stream | wall µs per stream |")
    print("|---:|---:|---:|")
    for n, cpu, wall in rows:
        print(f"| {n} | {cpu:.0f} | {wall:.0f} |")
    if len(rows) > 1:
        (n0, c0_, _), (n1, c1_, _) = rows[0], rows[-1]
        print(f"\none more exchange: {(c1_ - c0_) / (n1 - n0):.0f} µs of server CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
