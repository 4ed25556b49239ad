"""The staged step's private mechanics below `distribute`: stage contracts, the step
context, watched zones, the finite check."""
