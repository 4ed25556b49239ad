"""The launcher's parts: the plan of a job, its processes, the
report of how it ended, and the horovodrun runner for local jobs."""
