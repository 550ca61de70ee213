"""HTTP plumbing under every route: `security` (keys, the admin gate, CORS, body caps),
`cross_site` (Host / Origin / Content-Type guards), `forwarded` (the client behind a proxy),
`connection` (keep-alive soundness), `wire` (JSON bodies, SSE), `strict_json`, `protocol_errors`
(hypercorn's own 400s as JSON), `lifecycle` (loading / shutdown answers), `offload` (blocking work
off the event loop)."""
