"""Test rig: simulated multi-host clusters in network namespaces. Not imported by the product."""
