"""Deployments on one machine: the topology, the supervisor (`pdserve up`) and the ports it holds."""
