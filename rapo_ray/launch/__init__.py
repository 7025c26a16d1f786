"""The top: the Ray topology of a run (launcher), resource plans, the command line and the local Ray reaper."""
