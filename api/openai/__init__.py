"""OpenAI's chat completions, completions and models routes: `routes` (the blueprint),
`translate` (a body into the typed chat request), `encode` (events into chunks and whole answers)."""
