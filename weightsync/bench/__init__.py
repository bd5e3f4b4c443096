"""``weightsync bench``: weightsync against blocking broadcasts on the user's own hosts (``run``,
launched with torchrun), and the synthetic LLM-shaped state dict every benchmark pushes
(``model``). Shipped in the wheel; ``import weightsync`` never imports it."""
