"""The prefix cache: which prompts are cached, each node's share, a hit's prefill."""
