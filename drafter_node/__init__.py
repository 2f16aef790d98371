"""pipespec: drafter_node."""
