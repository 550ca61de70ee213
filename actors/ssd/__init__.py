"""The SSD tier's actors: `spill_queue` (write-behind), `durability` (what must reach disk, the
shutdown flush), `demotion_timer` (idle entries to disk), and `open` (opening the tier at start-up)."""
