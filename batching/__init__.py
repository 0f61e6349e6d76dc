"""Host-side decisions: what runs in each step. Plain Python and numpy; never imports jax."""
