"""The agent: tag protocol, trajectories and the multi-turn loop."""
