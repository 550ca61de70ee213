"""kill -9 at random moments while the SSD tier writes, 20 times on one cache directory.

Each iteration starts a server on the same `--ssd-cache` directory, checks that the start-up
scan reaped every temp file the last kill left, replays a few earlier prompts (any entry on disk
is restored; the output must equal the prompt's first, cold, answer), then sends two new prompts
and kills the server -9 in the middle of the writes their puts cause: mostly during an admin
flush (forced writes), every fourth iteration during the background write-behind (1 s after the
put). Pieces are slowed to 10 ms each (`cache.ssd_writer.PIECE_DELAY_S`, set by the server's
launcher; a file here is ~8 pieces) so a random kill often lands mid-file.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from cache.ssd_format import TMP_SUFFIX
from cache.ssd_store import QUARANTINE
from tests.e2e.server_process import Server

ITERATIONS = 8
WORDS = "agent tool call result plan step memory file patch test build deploy review".split()


def prompt_text(i: int) -> str:
    rng = random.Random(i)
    return f"prompt{i} " + " ".join(rng.choice(WORDS) for _ in range(120))


def temp_files(root):
    return [p for p in root.rglob(f"*{TMP_SUFFIX}") if ".identity." not in p.name]


@pytest.mark.slow
def test_kill_9_during_writes_never_serves_a_corrupt_entry(qwen3_dir, tmp_path):
    ssd = tmp_path / "ssd"
    prompts = [prompt_text(i) for i in range(2 * ITERATIONS)]
    # A prompt's first answer is a cold run: nothing on disk or in RAM shares more than its
    # first few tokens with it (checked through cached_tokens); later answers must equal it.
    expected: dict[str, str] = {}

    rng = random.Random(1234)
    sent: list[str] = []
    reaped = restores = mid_write_kills = 0
    for it in range(ITERATIONS):
        server = Server(qwen3_dir, "--ssd-cache", str(ssd), piece_delay_s=0.01)
        try:
            assert temp_files(ssd) == [], "the start-up scan left temp orphans"
            before = server.stats()["ssd_cache"]
            reaped += before["reaped_temp_files"]
            assert before["quarantined"] == 0, "an atomic write left a corrupt final file"
            for p in rng.sample(sent, min(3, len(sent))):
                assert server.complete(p)["choices"][0]["text"] == expected[p], f"iteration {it}: wrong output"
            after = server.stats()["ssd_cache"]
            restores += after["restores"]
            assert after["restore_failures"] == 0, "a file passed the scan but failed its restore"
            new = prompts[2 * it : 2 * it + 2]
            for p in new:
                first = server.complete(p)
                # at most the shared "prompt" word comes from the RAM tier; nothing from disk
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
                expected[p] = first["choices"][0]["text"]
            assert server.stats()["ssd_cache"]["restores"] == after["restores"]
            sent += new
            if it % 4 != 3:
                # Forced writes: the admin flush writes both puts back to back, now.
                threading.Thread(target=_post_quietly, args=(server.base + "/admin/cache/flush",), daemon=True).start()
                time.sleep(rng.uniform(0.02, 0.2))
            else:
                # Background write-behind: the durability debounce fires 1 s after the put.
                time.sleep(1.0 + rng.uniform(0.0, 0.2))
            mid_write_kills += bool(temp_files(ssd))
            server.proc.kill()  # SIGKILL: no flush, no cleanup
            server.proc.wait()
        finally:
            server.kill()

    server = Server(qwen3_dir, "--ssd-cache", str(ssd))
    try:
        assert temp_files(ssd) == []
        final = server.stats()["ssd_cache"]
        reaped += final["reaped_temp_files"]
        for p in sent:  # every prompt, restored or not, gives the cold output
            assert server.complete(p)["choices"][0]["text"] == expected[p]
        restores += server.stats()["ssd_cache"]["restores"]
        assert server.stats()["ssd_cache"]["restore_failures"] == 0
    finally:
        server.kill()
    assert list(ssd.glob(f"*/{QUARANTINE}/*")) == []  # nothing was ever found corrupt
    print(
        f"\n{ITERATIONS} kill -9 iterations: {mid_write_kills} landed mid-file, {reaped} temp files reaped, "
        f"{restores} restores from disk, {final['entries']} entries survived"
    )
    assert mid_write_kills >= 3 and reaped >= mid_write_kills  # the kills really hit writes
    assert restores >= 5  # and the disk tier really served later iterations


def _post_quietly(url: str) -> None:
    try:
        httpx.post(url, timeout=30)
    except httpx.HTTPError:
        pass  # the server was killed under it
