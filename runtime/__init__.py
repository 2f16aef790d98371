"""pipespec: runtime."""
