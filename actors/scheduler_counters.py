"""What the scheduler counts: rows by outcome, forwards, held heads, tokens, preemptions and the
live-KV peak (/stats `batch`, /metrics)."""

from __future__ import annotations

import attrs


@attrs.define
class SchedulerCounters:
    submitted_rows: int = 0
    finished_rows: int = 0  # EOS or length
    stopped_rows: int = 0  # stop string
    aborted_rows: int = 0
    failed_rows: int = 0
    steps: int = 0
    prefill_chunks: int = 0
    group_prefills: int = 0  # prefill_group forwards (each also counts as a prefill chunk)
    grouped_rows: int = 0  # rows opened for a group prefill
    solo_rows: int = 0  # rows opened to prefill alone
    forked_rows: int = 0  # sibling choices opened from their leader's prefill (no prefill of their own)
    held_heads: int = 0  # queue heads held for requests still on their way in
    held_s: float = 0.0  # their total wait
    tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified (TokenOut.drafted)
    accepted_tokens: int = 0  # and accepted by the model
    preemptions: int = 0  # running rows sent back to the queue: the live-KV budget was full
    resumes: int = 0  # preempted rows opened again
    peak_kv_bytes: int = 0  # the most the active rows held together (as the live-KV budget bills them)
