#!/usr/bin/env python3
"""Where the client CPU of a capture call goes: N capture calls under cProfile (``time.process_time``).

A capture call is what ``tools/bench_transport.py`` times in its capture rows (and what Gym's
middleware does per model call): ``resolve`` (LIST of the request's fingerprint prefix),
``begin_call`` (PUT intent, then GET fence) and ``put`` (PUT entry with a GET of the fence).
``--workers`` rollouts of ``--calls`` calls run at once per round, every round on fresh rollouts,
after one unmeasured warm-up round.

Prints the client CPU per call of the whole process (obstore's Rust threads included) and of the
event-loop thread alone (``time.thread_time``), then, with ``--profile``, the functions with the most
cumulative and own time. A profile inflates Python-heavy code: read the shares, and take the CPU
per call from a run without ``--profile`` (or from ``bench_transport``). For a sampling profile of
the same run without that distortion: ``py-spy record -f raw -o out.txt -- python
tools/profile_capture.py --rounds 60``.

Usage::

    python tools/profile_capture.py                                 # SeaweedFS, obstore, 6 rounds
    python tools/profile_capture.py --server moto --transport aioboto3 --profile --top 40
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
import uuid

import msgspec
from _benchcommon import start_server
from bench_transport import capture_rollout, template_calls

from s3capture.store import S3TokenStore


async def run(args: argparse.Namespace) -> None:
    server = start_server(args.server)
    try:
        bucket = f"s3capture-profile-{uuid.uuid4().hex[:8]}"
        import aioboto3

        async with aioboto3.Session().client("s3", endpoint_url=server.endpoint_url) as admin:
            await admin.create_bucket(Bucket=bucket)
        store = S3TokenStore(f"s3://{bucket}/profile", endpoint_url=server.endpoint_url, transport=args.transport)
        specs = template_calls(store, args.calls, args.prompt_len, args.gen_len)

        async def one_round(r: int) -> None:
            jobs = []
            for w in range(args.workers):
                rollout_id = f"prof-{r}-{w}-{uuid.uuid4().hex[:6]}"
                entries = [msgspec.structs.replace(s.entry, rollout_id=rollout_id) for s in specs]
                jobs.append(capture_rollout(store, rollout_id, entries, specs))
            await asyncio.gather(*jobs)

        await one_round(-1)
        before = dict(store.transport.request_counts)
        profile = cProfile.Profile(time.process_time) if args.profile else None
        cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        for r in range(args.rounds):
            await one_round(r)
        if profile is not None:
            profile.disable()
        cpu, thread, wall = time.process_time() - cpu0, time.thread_time() - thread0, time.perf_counter() - wall0
        n = args.rounds * args.workers * args.calls
        sent = {op: count - before.get(op, 0) for op, count in store.transport.request_counts.items()}
        await store.close()
        print(
            f"{n} capture calls on {args.server}, transport={args.transport}"
            f"{' (under cProfile)' if profile else ''}: client CPU {cpu / n * 1000:.2f} ms/call "
            f"(event-loop thread {thread / n * 1000:.2f}), wall {wall / n * 1000:.2f} ms/call; "
            f"requests/call {', '.join(f'{op} {count / n:.2f}' for op, count in sorted(sent.items()))}"
        )
        if profile is not None:
            stats = pstats.Stats(profile, stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(args.top)
            stats.sort_stats("tottime").print_stats(args.top)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", default="seaweedfs", choices=("moto", "seaweedfs", "ceph"))
    parser.add_argument("--transport", default="obstore", choices=("aioboto3", "obstore"))
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (default 6)")
    parser.add_argument("--workers", type=int, default=8, help="rollouts captured at once (default 8)")
    parser.add_argument("--calls", type=int, default=6, help="calls per rollout per round (default 6)")
    parser.add_argument("--prompt-len", type=int, default=768, help="first call's prompt tokens (default 768)")
    parser.add_argument("--gen-len", type=int, default=128, help="generation tokens per call (default 128)")
    parser.add_argument("--profile", action="store_true", help="run the measured rounds under cProfile")
    parser.add_argument("--top", type=int, default=30, help="functions printed per ordering (default 30)")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
