"""OpenAI Responses: `routes`, `translate`, `encode` (the item and event stream), `store` (stored
responses for previous_response_id and GET)."""
