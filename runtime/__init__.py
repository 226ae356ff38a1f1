"""zgraph runtime (installed as ``zgraph.runtime``): process groups, sharded state, executors."""
