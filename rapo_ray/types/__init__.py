"""Types every layer shares: the tag protocol, token-in/token-out trajectories, the environment protocol, the learner batch."""
