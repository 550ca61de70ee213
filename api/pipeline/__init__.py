"""Per-token text pipeline of one completion: tool router → stop matcher → think splitter."""
