"""cncore_jax: growable embedding tables for JAX (work in progress, issue 14)."""
