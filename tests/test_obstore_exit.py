"""Programs that used the obstore transport end with their own exit status, never SIGABRT.

obstore's tokio threads hand each finished request back with ``loop.call_soon_threadsafe``; a
thread still inside it when the interpreter finalizes aborts the process (CI's stop 13:
``s3capture conformance`` exited -6 after printing "2 passed"). ``s3capture.transport_obstore``
waits for such threads at ``close`` and at exit.
"""

from __future__ import annotations

import pytest

from helpers import split_bucket_url

pytest.importorskip("obstore")


def test_obstore_exit_waits_for_a_thread_still_handing_back_a_result():
    """obstore's tokio threads complete each future with ``loop.call_soon_threadsafe``, whose
    self-pipe write releases the GIL; if the program finishes meanwhile and the thread takes the
    GIL back during finalization, the process aborts with SIGABRT after a run that succeeded
    (CI's stop 13: ``conformance`` exited -6 after "2 passed"). ``settle_completions`` must see
    such a thread and wait for it, and stop waiting once it is through."""
    import asyncio
    import threading

    from s3capture.transport_obstore import _rust_threads_in_asyncio, settle_completions

    loop = asyncio.new_event_loop()
    inside, release = threading.Event(), threading.Event()
    real_write = loop._write_to_self

    def slow_write() -> None:
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            release.wait(10)
        real_write()

    loop._write_to_self = slow_write
    worker = threading.Thread(target=loop.call_soon_threadsafe, args=(lambda: None,))
    try:
        assert settle_completions(timeout=0.05) is True  # nobody inside: at once
        worker.start()
        assert inside.wait(10)
        assert _rust_threads_in_asyncio() == 1
        assert settle_completions(timeout=0.05) is False
        release.set()
        assert settle_completions(timeout=10) is True
        assert _rust_threads_in_asyncio() == 0
    finally:
        release.set()
        worker.join(10)
        loop.close()


_EXIT_SCRIPT = """
import asyncio, sys
from s3capture.transport import make_transport

async def main(close):
    transport = make_transport("obstore", sys.argv[1])
    for i in range(4):
        await transport.put(f"exit/{i}", b"x" * 100)
        await transport.get(f"exit/{i}")
    if close:
        await transport.close()

asyncio.run(main(sys.argv[2] == "close"))
print("done")
"""


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
@pytest.mark.parametrize("ending", ["close", "no-close"])
def test_an_obstore_program_exits_0_after_its_last_request(s3_env, bucket_url, ending, tmp_path):
    """End to end: a program whose last obstore request finished exits with 0, whether it closes
    its transport (``ObstoreTransport.close`` settles) or not (the ``atexit`` hook does). Before
    the fix about one exit in six aborted here; twelve exits pass by chance with p < 0.15."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    bucket, _ = split_bucket_url(bucket_url)
    script = tmp_path / "exit_after_requests.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1] / "src")}

    def run(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), bucket, ending], env=env, capture_output=True, text=True, timeout=120
        )

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, range(12)))
    failed = [(r.returncode, r.stderr[-500:]) for r in runs if r.returncode != 0 or r.stdout.strip() != "done"]
    assert failed == []
