"""Artifacts built before RL: the scripted expert, the warm start (SFT) and the step-trace buffer (Ray Data)."""
