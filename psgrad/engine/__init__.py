"""The parameter server's two engines, which roles compose: ``server`` (decode-and-sum, per-layer
update, reply; sync and async) and ``worker`` (hooks that push coded gradients and pull layers)."""
