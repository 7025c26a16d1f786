"""Ray actors: the rollout fleet, the learner group and the weight sync between them."""
