"""LoRA adapters over HTTP: `routes` (list, mount, unmount, available), `catalog` (the
--adapters-dir listing), `select` (a request's adapter from its `model` or `adapter` field)."""
