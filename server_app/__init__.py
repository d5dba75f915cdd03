"""The ServerApp: validates the job, runs the rounds, writes checkpoints and results."""
