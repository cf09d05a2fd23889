"""The run's state folder: its lock, attempts, stop requests and finished marks."""
