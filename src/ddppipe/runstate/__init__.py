"""What runs left on disk: the state folder (its lock, attempts, stop requests, finished marks)
and a model-based sweep's rounds."""
