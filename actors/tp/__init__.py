"""Tensor parallelism across processes: `leader` (rank 0, in the GPU worker), `follower` (`python
-m actors.tp.follower`, ranks 1..N-1), `link` (the messages between them)."""
